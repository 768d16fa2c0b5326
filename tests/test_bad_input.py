"""Nothing hangs on bad input (DESIGN §1.6), on real gloo groups with short timeouts.

Every case raises a typed error naming the input on EVERY rank: the rank that got the
bad input raises its own error (InputError, CheckpointError), its peers raise
PeerRankError from the handshake in ``distributed.agree``; heads built differently
(vocab, hidden, tp, layout, pad_to, gather_output) make every rank raise
RankMismatchError before any logits move. Collective timeouts are set to 20 s, so a
hang would fail the test instead of stalling it.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import model_config, write_hf_dir
from rank_fns import bad_input_cases, exit_hard, raise_bad_seq_lens_on

from trtvocab.errors import InputError, PeerRankError, RankMismatchError
from trtvocab.launch import RankFailures, run_ranks

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
def records(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict]]:
    root = tmp_path_factory.mktemp("bad_ckpts")
    w = torch.randn(100, 16)
    paths = {
        "missing": write_hf_dir(root / "missing", {"model.norm.weight": torch.ones(16)},
                                model_config(100, 16, tie_word_embeddings=False)),
        "wrong_shape": write_hf_dir(root / "wrong_shape", {"lm_head.weight": w}, model_config(101, 16)),
        "untied": write_hf_dir(root / "untied", {"model.embed_tokens.weight": w},
                               model_config(100, 16, tie_word_embeddings=False)),
    }
    return run_ranks(bad_input_cases, TP, {k: str(v) for k, v in paths.items()}, timeout_s=TIMEOUT_S)


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


def test_all_cases_ran(records: list[list[dict]]) -> None:
    for rank in range(TP):
        assert [r["case"] for r in records[rank]] == list(EXPECT)


@pytest.mark.timeout(120)
def test_rank_failures_carry_each_ranks_typed_error() -> None:
    """Errors escaping the rank function arrive in RankFailures.errors with their types."""
    with pytest.raises(RankFailures) as info:
        run_ranks(raise_bad_seq_lens_on, 2, 1, timeout_s=TIMEOUT_S)
    errors = info.value.errors
    assert set(errors) == {0, 1}
    assert isinstance(errors[1], InputError) and "seq_lens" in str(errors[1])
    assert isinstance(errors[0], PeerRankError) and "rank(s) [1]" in str(errors[0])
    assert "rank 1: InputError" in str(info.value)


def test_launcher_does_not_wait_for_dead_ranks() -> None:
    """A rank that dies before reporting is noticed at once, not after the whole deadline."""
    start = time.monotonic()
    with pytest.raises(RankFailures) as info:
        run_ranks(exit_hard, 2, timeout_s=TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S
    assert "exited without a result" in str(info.value)


@pytest.mark.parametrize("module", ["head", "embedding"])
def test_replicated_rank_next_to_split_peers_fails_at_load_on_every_rank(tmp_path, module: str) -> None:
    """Rank 0 built replicated (attention DP without LM-head TP), its peers split: a replicated
    module makes no per-call collective, so the placement is compared in the load handshake,
    where every rank of a TP group takes part: every rank raises RankMismatchError naming it."""
    from rank_fns import load_replicated_next_to_split
    from safetensors.torch import save_file

    save_file({"lm_head.weight": torch.randn(101, 16)}, str(tmp_path / "model.safetensors"))
    started = time.monotonic()
    with pytest.raises(RankFailures) as info:
        run_ranks(load_replicated_next_to_split, TP, str(tmp_path), module, timeout_s=TIMEOUT_S)
    assert time.monotonic() - started < TIMEOUT_S
    errors = info.value.errors
    assert set(errors) == set(range(TP))
    for r in range(TP):
        assert isinstance(errors[r], RankMismatchError), errors[r]
        assert "mapping" in str(errors[r]) and "replicated" in str(errors[r])


def test_one_rank_failing_to_load_stops_every_rank(tmp_path) -> None:
    """The last rank's checkpoint copy is truncated (on a real cluster: a node with a bad
    copy): that rank raises CheckpointError from from_checkpoint, its peers PeerRankError
    from the load handshake, long before the collective timeout."""
    from rank_fns import load_then_forward
    from safetensors.torch import save_file

    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    save_file({"lm_head.weight": torch.randn(101, 16)}, str(good / "model.safetensors"))
    data = (good / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) - 16 * 4 * 5])  # drop the last 5 rows
    started = time.monotonic()
    with pytest.raises(RankFailures) as info:
        run_ranks(load_then_forward, TP, [str(good)] * (TP - 1) + [str(bad)], timeout_s=TIMEOUT_S)
    assert time.monotonic() - started < TIMEOUT_S
    errors = info.value.errors
    assert type(errors[TP - 1]).__name__ == "CheckpointError" and "truncated" in str(errors[TP - 1])
    assert all(isinstance(errors[r], PeerRankError) for r in range(TP - 1))
