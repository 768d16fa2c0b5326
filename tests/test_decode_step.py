"""A decode step pays for the cross-rank handshake once (trtvocab.distributed.Agreement).

The handshake runs on an operation's first call and when its signature changes; on later calls
the verdict rides on the call's first data collective. These tests count the collectives of real
gloo process groups (tp 3) and check that a bad input on one rank still makes every rank raise,
on the first, second and a later call, without waiting for any timeout.
"""

from __future__ import annotations

import time

from decode_rank_fns import (
    bad_input_on_later_calls,
    changes_in_steady_state,
    materialized_then_chunked,
    steady_counts,
)

from trtvocab.launch import run_ranks

TP = 3
TIMEOUT_S = 20


def test_steady_decode_step_is_one_collective_and_gives_the_same_tokens() -> None:
    results = run_ranks(steady_counts, TP, timeout_s=TIMEOUT_S)
    for r in results:
        # decode: the first step handshakes (1) and races (1); later steps race only.
        assert r["decode_counts"] == [2, 1, 1, 1, 1]
        # forward (gather_output=False) handshakes every call: no data moves there to carry a verdict.
        # sample's own handshake is paid once.
        assert r["separate_counts"] == [3, 2, 2, 2, 2]
        # top-k changes decode's signature: the first such step finds out in its steady gather (1),
        # renegotiates (1), then moves the merged top-k (1) and races (1); later steps: top-k
        # (carrying the verdict) + race.
        assert r["topk_counts"] == 4 + 2 + 2
        assert r["logprobs_counts"] == [2, 1, 1]
        assert r["decode"] == r["separate"] == r["reference"]
    assert all(r["decode"] == results[0]["decode"] for r in results)


def test_bad_input_on_one_rank_raises_everywhere_on_first_second_and_later_calls() -> None:
    bad_calls = [0, 1, 4]
    started = time.monotonic()
    results = run_ranks(bad_input_on_later_calls, TP, bad_calls, timeout_s=TIMEOUT_S)
    assert time.monotonic() - started < TIMEOUT_S
    for kind in ("decode", "forward", "sample", "logprobs", "top_p"):
        for call in range(max(bad_calls) + 2):
            outcomes = [r[kind][call][0] for r in results]
            if call in bad_calls:
                assert outcomes == ["PeerRankError", "InputError", "PeerRankError"], (kind, call, outcomes)
                assert "NaN" in results[1][kind][call][1]
            else:
                assert outcomes == ["ok"] * TP, (kind, call, [r[kind][call] for r in results])
                assert len({str(r[kind][call][1]) for r in results}) == 1  # the same tokens / logits everywhere


def test_changes_in_steady_state_renegotiate_or_raise_on_every_rank() -> None:
    started = time.monotonic()
    results = run_ranks(changes_in_steady_state, TP, timeout_s=TIMEOUT_S)
    assert time.monotonic() - started < TIMEOUT_S
    for r in results:
        assert r["one rank's batch"][0] == "RankMismatchError" and "batch rows" in r["one rank's batch"][1]
        assert r["one rank's forward batch"][0] == "RankMismatchError"
        assert "different numbers of rows" in r["one rank's forward batch"][1]
        assert r["one rank's temperature"][0] == "RankMismatchError"
        assert "argument digest" in r["one rank's temperature"][1]
        assert r["everyone's batch"][0] == "ok" and len(r["everyone's batch"][1]) == 6
        assert r["everyone's forward batch"] == ("ok", [6, 103])
        assert r["healthy after"][0] == "ok"
        assert r["forward healthy after"] == ("ok", [2, 103])
    assert [r["bad seq_lens"][0] for r in results] == ["InputError", "PeerRankError", "PeerRankError"]
    assert len({str(r["healthy after"][1]) for r in results}) == 1


def test_chunked_calls_after_steady_materialized_ones_still_fail_together() -> None:
    started = time.monotonic()
    results = run_ranks(materialized_then_chunked, TP, timeout_s=TIMEOUT_S)
    assert time.monotonic() - started < TIMEOUT_S
    for key in ("chunked", "greedy"):
        assert [r[key][0] for r in results] == ["PeerRankError", "InputError", "PeerRankError"], key
    assert all(r["after"][0] == "ok" for r in results)
    assert len({str(r["after"][1]) for r in results}) == 1
