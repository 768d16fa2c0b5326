"""A decode step pays for the cross-rank handshake once (trtvocab.parallel.distributed.Agreement).

The handshake runs on an operation's first call and when its signature changes; on later calls
the verdict rides on the call's first data collective. These tests count the collectives of real
gloo process groups (tp 3) and check that a bad input on one rank still makes every rank raise,
on the first, second and a later call, without waiting for any timeout: each rank measures every
call, from the bad input to the raise, against the collective timeout. One launch runs every case
(none kills a rank): :func:`decode_rank_fns.all_cases`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.parallel.decode_rank_fns import all_cases

pytestmark = pytest.mark.ranks  # every test here (docs/testing.md)

TP = 3
TIMEOUT_S = 20  # the collectives' timeout: a call that waited for a peer's timeout takes at least this
BAD_CALLS = [0, 1, 4]


@pytest.fixture(scope="module")
def results(launch_ranks: Callable[..., list[Any]]) -> list[dict[str, Any]]:
    return launch_ranks(all_cases, TP, BAD_CALLS, timeout_s=TIMEOUT_S)


def no_call_waited_for_a_timeout(per_rank: list[dict[str, Any]]) -> None:
    """Measured inside the ranks: every call (the failing ones too) returned before the
    collective timeout, so no rank raised because it waited for a peer that had given up."""
    slowest = max(max(r["seconds"]) for r in per_rank)
    assert slowest < TIMEOUT_S, f"a call took {slowest:.1f} s on its rank (collective timeout {TIMEOUT_S} s)"


def test_steady_decode_step_is_one_collective_and_gives_the_same_tokens(results: list[dict[str, Any]]) -> None:
    results = [r["steady"] for r in results]
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


def test_bad_input_on_one_rank_raises_everywhere_on_first_second_and_later_calls(results: list[dict[str, Any]]) -> None:
    bad_calls = BAD_CALLS
    results = [r["later calls"] for r in results]
    no_call_waited_for_a_timeout(results)
    for kind in ("decode", "forward", "sample", "logprobs", "top_p"):
        for call in range(max(bad_calls) + 2):
            outcomes = [r[kind][call][0] for r in results]
            if call in bad_calls:
                assert outcomes == ["PeerRankError", "InputError", "PeerRankError"], (kind, call, outcomes)
                assert "NaN" in results[1][kind][call][1]
            else:
                assert outcomes == ["ok"] * TP, (kind, call, [r[kind][call] for r in results])
                assert len({str(r[kind][call][1]) for r in results}) == 1  # the same tokens / logits everywhere


def test_changes_in_steady_state_renegotiate_or_raise_on_every_rank(results: list[dict[str, Any]]) -> None:
    results = [r["steady state changes"] for r in results]
    no_call_waited_for_a_timeout(results)
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


def test_chunked_calls_after_steady_materialized_ones_still_fail_together(results: list[dict[str, Any]]) -> None:
    results = [r["materialized then chunked"] for r in results]
    no_call_waited_for_a_timeout(results)
    for key in ("chunked", "greedy"):
        assert [r[key][0] for r in results] == ["PeerRankError", "InputError", "PeerRankError"], key
    assert all(r["after"][0] == "ok" for r in results)
    assert len({str(r["after"][1]) for r in results}) == 1
