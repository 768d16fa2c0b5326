"""Nothing hangs on bad input (contract §1.8, docs/contract.md), on real gloo groups with short timeouts.

Every case raises a typed error naming the input on EVERY rank: the rank that got the
bad input raises its own error (InputError, CheckpointError), its peers raise
PeerRankError from the handshake in ``distributed.agree``; heads built differently
(vocab, hidden, tp, layout, pad_to, gather_output) make every rank raise
RankMismatchError before any logits move. Collective timeouts are set to 20 s, so a
hang would fail the test instead of stalling it; "fails fast" is measured inside the ranks
(from the bad input to the raise) against that timeout, never as the launch's wall time.

Three launches: every case that leaves the ranks alive (:func:`rank_fns.bad_input_and_load_cases`),
errors escaping the rank function, and a rank that dies.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import model_config, write_hf_dir
from tests.parallel.rank_fns import bad_input_and_load_cases, exit_hard, raise_bad_seq_lens_on, what_a_rank_sees
from trtvocab.errors import InputError, PeerRankError
from trtvocab.parallel.launch import RankFailures

Launch = Callable[..., list[Any]]

TP = 3
TIMEOUT_S = 20  # collective timeout per rank; a hung case would surface as a DistributedError

# case -> (error on the bad rank(s), error on the others, text the bad rank's message contains)
EXPECT: dict[str, tuple[str, str, str]] = {
    "seq_lens sum != T (all)": ("InputError", "InputError", "seq_lens: lengths sum to 5"),
    "seq_lens sum != T (rank 1)": ("InputError", "PeerRankError", "seq_lens: lengths sum to 5"),
    "zero length (all)": ("InputError", "InputError", "seq_lens: every length must be >= 1"),
    "zero length (rank 1)": ("InputError", "PeerRankError", "seq_lens: every length must be >= 1"),
    "negative length (rank 1)": ("InputError", "PeerRankError", "seq_lens: every length must be >= 1"),
    "float seq_lens (rank 1)": ("InputError", "PeerRankError", "seq_lens: expected an integer dtype"),
    "wrong hidden size (all)": ("InputError", "InputError", "hidden_states: expected shape [N, 16]"),
    "wrong hidden size (rank 1)": ("InputError", "PeerRankError", "hidden_states: expected shape [N, 16]"),
    "wrong dtype (rank 1)": ("InputError", "PeerRankError", "hidden_states: expected dtype torch.float32"),
    "3-D hidden (rank 1)": ("InputError", "PeerRankError", "hidden_states: expected shape"),
    "empty batch (all)": ("InputError", "InputError", "hidden_states: empty batch"),
    "empty batch (rank 1)": ("InputError", "PeerRankError", "hidden_states: empty batch"),
    "empty batch, processor (rank 1)": ("InputError", "PeerRankError", "hidden_states: empty batch (T = 0)"),
    "different row counts (rank 1)": ("RankMismatchError", "RankMismatchError", "different numbers of rows"),
    "sampling k > V (rank 1)": ("InputError", "PeerRankError", "sampling.topk: k must be"),
    "sampling NaN (rank 1)": ("InputError", "PeerRankError", "sampling.greedy: local_logits contain NaN"),
    "sampling id out of range (rank 1)": ("InputError", "PeerRankError", "sampling.logprobs: token_ids"),
    "sampling wrong width (rank 1)": ("InputError", "PeerRankError", "sampling.greedy: local_logits must have"),
    "sampling min_p > 1 (rank 1)": ("InputError", "PeerRankError", "sampling.min_p: min_p must be in [0, 1]"),
    "sampling top_p = 0 (rank 1)": ("InputError", "PeerRankError", "sampling.top_p: top_p must be in (0, 1]"),
    "sampling different k (rank 1)": ("RankMismatchError", "RankMismatchError", "k / ids per row"),
    "sampling different rows (rank 1)": ("RankMismatchError", "RankMismatchError", "batch rows"),
    "different vocab (rank 1)": ("RankMismatchError", "RankMismatchError", "vocab_size"),
    "different hidden (rank 1)": ("RankMismatchError", "RankMismatchError", "hidden_size"),
    "different layout (rank 1)": ("RankMismatchError", "RankMismatchError", "vocab layout"),
    "different pad_to (rank 1)": ("RankMismatchError", "RankMismatchError", "vocab layout"),
    "different gather_output (rank 1)": ("RankMismatchError", "RankMismatchError", "gather_output"),
    "different tp (rank 1)": ("RankMismatchError", "RankMismatchError", "tp_size"),
    "missing tensor (all)": ("CheckpointError", "CheckpointError", "no 'lm_head.weight'"),
    "shape vs config.json (all)": ("CheckpointError", "CheckpointError", "config.json vocab_size is 101"),
    "untied, no lm_head (all)": ("CheckpointError", "CheckpointError", "tie_word_embeddings=false"),
    "healthy after": ("ok", "ok", ""),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, launch_ranks: Launch) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("bad_ckpts")
    w = torch.randn(100, 16)
    paths = {
        "missing": write_hf_dir(root / "missing", {"model.norm.weight": torch.ones(16)},
                                model_config(100, 16, tie_word_embeddings=False)),
        "wrong_shape": write_hf_dir(root / "wrong_shape", {"lm_head.weight": w}, model_config(101, 16)),
        "untied": write_hf_dir(root / "untied", {"model.embed_tokens.weight": w},
                               model_config(100, 16, tie_word_embeddings=False)),
    }
    # the last rank's checkpoint copy is truncated (on a real cluster: a node with a bad copy)
    good, bad = root / "good", root / "bad"
    good.mkdir()
    bad.mkdir()
    save_file({"lm_head.weight": torch.randn(101, 16)}, str(good / "model.safetensors"))
    data = (good / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) - 16 * 4 * 5])  # drop the last 5 rows
    load = {"replicated": str(good), "per_rank": [str(good)] * (TP - 1) + [str(bad)]}
    return launch_ranks(bad_input_and_load_cases, TP, {k: str(v) for k, v in paths.items()}, load,
                        timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def records(launched: list[dict[str, Any]]) -> list[list[dict]]:
    return [r["cases"] for r in launched]


@pytest.mark.ranks
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(EXPECT))
def test_every_rank_raises_a_typed_error(records: list[list[dict]], case: str) -> None:
    bad_type, other_type, fragment = EXPECT[case]
    bad_ranks = range(TP) if case.endswith("(all)") else [1]
    for rank in range(TP):
        (rec,) = [r for r in records[rank] if r["case"] == case]
        want = bad_type if rank in bad_ranks else other_type
        assert rec["type"] == want, f"rank {rank}: {rec['type']}: {rec['msg']}"
        if rank in bad_ranks:
            assert fragment in rec["msg"], f"rank {rank}: {rec['msg']!r} does not name the input ({fragment!r})"
        elif want == "PeerRankError":
            assert "rank(s) [1]" in rec["msg"], rec["msg"]


@pytest.mark.ranks
def test_all_cases_ran(records: list[list[dict]]) -> None:
    for rank in range(TP):
        assert [r["case"] for r in records[rank]] == list(EXPECT)


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_rank_failures_carry_each_ranks_typed_error(launch_ranks: Launch) -> None:
    """Errors escaping the rank function arrive in RankFailures.errors with their types."""
    with pytest.raises(RankFailures) as info:
        launch_ranks(raise_bad_seq_lens_on, 2, 1, timeout_s=TIMEOUT_S)
    errors = info.value.errors
    assert set(errors) == {0, 1}
    assert isinstance(errors[1], InputError) and "seq_lens" in str(errors[1])
    assert isinstance(errors[0], PeerRankError) and "rank(s) [1]" in str(errors[0])
    assert "rank 1: InputError" in str(info.value)


@pytest.mark.ranks
def test_launcher_does_not_wait_for_dead_ranks(tmp_path: Path, launch_ranks: Launch) -> None:
    """A rank that dies before reporting is noticed at once, not after the whole deadline
    (``2 * timeout_s + 60``): timed from the ranks' deaths (stamped by the ranks themselves), so the
    ranks' start-up is not part of it."""
    with pytest.raises(RankFailures) as info:
        launch_ranks(exit_hard, 2, str(tmp_path), timeout_s=TIMEOUT_S)
    returned = time.monotonic()
    died = max(float((tmp_path / f"rank{r}").read_text()) for r in range(2))
    assert returned - died < TIMEOUT_S, returned - died  # the launcher's grace after a failure: 3 s
    assert "exited without a result" in str(info.value)


@pytest.mark.ranks
def test_ranks_see_the_environment_and_directory_of_the_call(tmp_path: Path, launch_ranks: Launch,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks fork from a server started at the first launch (or earlier): what the caller changed
    since (a variable set, one removed, the directory) must still reach them, as it would a spawned rank."""
    monkeypatch.setenv("TRTVOCAB_TEST_GONE", "old")
    launch_ranks(what_a_rank_sees, 2, [], timeout_s=TIMEOUT_S)  # the server runs from here on, at the latest
    monkeypatch.delenv("TRTVOCAB_TEST_GONE")
    monkeypatch.setenv("TRTVOCAB_TEST_NEW", "new")
    monkeypatch.chdir(tmp_path)
    seen = launch_ranks(what_a_rank_sees, 2, ["TRTVOCAB_TEST_GONE", "TRTVOCAB_TEST_NEW"], timeout_s=TIMEOUT_S)
    for rank, view in enumerate(seen):
        assert view["env"] == {"TRTVOCAB_TEST_GONE": None, "TRTVOCAB_TEST_NEW": "new"}, (rank, view)
        assert Path(view["cwd"]).resolve() == tmp_path.resolve(), (rank, view)


@pytest.mark.ranks
@pytest.mark.parametrize("module", ["head", "embedding"])
def test_replicated_rank_next_to_split_peers_fails_at_load_on_every_rank(launched: list[dict[str, Any]],
                                                                         module: str) -> None:
    """Rank 0 built replicated (attention DP without LM-head TP), its peers split: a replicated
    module makes no per-call collective, so the placement is compared in the load handshake,
    where every rank of a TP group takes part: every rank raises RankMismatchError naming it,
    before the collective timeout (measured on each rank)."""
    recs = [r["loads"][f"replicated {module}"] for r in launched]
    for r, rec in enumerate(recs):
        assert "RankMismatchError" in rec["types"], (r, rec)
        assert "mapping" in rec["msg"] and "replicated" in rec["msg"], (r, rec)
        assert rec["seconds"] < TIMEOUT_S, (r, rec)


@pytest.mark.ranks
def test_one_rank_failing_to_load_stops_every_rank(launched: list[dict[str, Any]]) -> None:
    """The last rank's checkpoint copy is truncated (on a real cluster: a node with a bad
    copy): that rank raises CheckpointError from from_checkpoint, its peers PeerRankError
    from the load handshake, long before the collective timeout (measured on each rank)."""
    recs = [r["loads"]["one rank's copy truncated"] for r in launched]
    assert recs[TP - 1]["type"] == "CheckpointError" and "truncated" in recs[TP - 1]["msg"], recs[TP - 1]
    assert all(PeerRankError.__name__ in recs[r]["types"] for r in range(TP - 1)), recs
    assert all(rec["seconds"] < TIMEOUT_S for rec in recs), [rec["seconds"] for rec in recs]
    # the group is still usable afterwards: every rank loads the good copy and runs a forward
    assert all(r["loads"]["healthy after"]["type"] == "ok" for r in launched), [r["loads"] for r in launched]


RANKS_DIE_AT_START = '''
import os
import sys

if __name__ == "__mp_main__":  # each rank imports the caller's main script first: die there
    os._exit(3)
if __name__ == "__main__":
    from trtvocab.parallel.launch import run_ranks

    try:
        run_ranks(max, 2, b"x" * (4 << 20), timeout_s=30)  # work far larger than a pipe's buffer
    except Exception as exc:
        print(type(exc).__name__, str(exc).splitlines()[1])
'''


@pytest.mark.subprocess
@pytest.mark.timeout(240)
def test_caller_exits_when_ranks_die_before_reading_their_work(tmp_path: Path) -> None:
    """Ranks that die before they read their (large) work: the caller reports them and then exits,
    instead of waiting at exit for the work to be read."""
    import subprocess
    import sys

    script = tmp_path / "die_at_start.py"
    script.write_text(RANKS_DIE_AT_START)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("RankFailures rank 0: DistributedError: rank 0 exited without a result (exit code"), \
        done.stdout
