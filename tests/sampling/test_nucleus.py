"""The nucleus cut (``reductions.prefix_keep``, ``kept_prefix``): top-p's and typical-p's prefix.

The reference is exact rational arithmetic (``fractions.Fraction``) over the same float32
probabilities: list the tokens in the total order (key descending, id ascending), keep each while the
sum before it (each float32 probability rounded to ``2**-40``) is below the mass, the first always, all of
them at a mass of 1 (typical-p: and the whole tie at the cut, as transformers' ``TypicalLogitsWarper``
keeps it). ``prefix_keep`` must equal it **bitwise**, in process at tp 1 (one and two id
segments) and on real gloo groups at tp 2-4, uneven and padded, where every rank's columns together
must give the same mask. Then: the rounds are fixed (four gathers, whatever the data) and a step that
uses them reads nothing from the device.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
import torch

from tests.sampling import nucleus_rank_fns as F
from trtvocab.base.host_reads import HostReads
from trtvocab.sampling.reductions import RADIX_ROUNDS, kept_prefix, prefix_keep


def exact_keep(order: torch.Tensor, probs: torch.Tensor, mass: torch.Tensor, whole_ties: bool = False) -> torch.Tensor:
    """The reference; ``whole_ties``: then every token whose order value equals the last kept one's."""
    keep = torch.zeros(order.shape, dtype=torch.bool)
    for b in range(order.shape[0]):
        ranked = sorted(range(order.shape[1]), key=lambda i: (-float(order[b, i]) + 0.0, i))
        before, limit = Fraction(0), Fraction(float(mass[b]))
        for n, i in enumerate(ranked):
            keep[b, i] = n == 0 or before < limit or limit >= 1
            before += _fixed(float(probs[b, i]))
        if whole_ties:
            keep[b] |= order[b] >= order[b][keep[b]].min()
    return keep


def _fixed(p: float) -> Fraction:
    """The mass the definition adds for probability ``p``: ``p`` rounded (half to even) to ``2**-40``."""
    return Fraction(round(Fraction(p) * 2**40), 2**40) if p == p else Fraction(0)


def _local(t: torch.Tensor, _place: Any) -> torch.Tensor:
    return t[None]


@pytest.mark.parametrize("seed", [0, 1])
def test_tp1_cut_equals_exact_rational_arithmetic(seed: int) -> None:
    for x, mass, added in F.cases(seed):
        vocab = x.shape[1] - added
        place = F.placement(vocab, added, 1, 0, "uneven")
        probs = torch.softmax(x, dim=1)
        want = exact_keep(x, probs, mass)
        assert torch.equal(prefix_keep(x, probs, mass, place, _local), want)
        assert torch.equal(prefix_keep(x, probs, mass, place, _local, whole_ties=True),
                           exact_keep(x, probs, mass, whole_ties=True))
        # kept_prefix on the sorted list (the streamed path's candidates) agrees
        for b in range(x.shape[0]):
            ranked = sorted(range(x.shape[1]), key=lambda i, b=b: (-float(x[b, i]) + 0.0, i))
            assert int(kept_prefix(probs[b, ranked][None], mass[b:b + 1])[0]) == int(want[b].sum())


def test_ties_with_different_masses_are_ordered_by_id() -> None:
    """Typical-p's key ties tokens of different probability (|surprise - H| equal on both sides of H):
    the order within a tie is the id, and each tied token adds its own mass."""
    order = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -2.0, 0.0]])
    probs = torch.tensor([[0.1, 0.3, 0.05, 0.25, 0.2, 0.1]])
    place = F.placement(6, 0, 1, 0, "uneven")
    for mass in (0.15, 0.2, 0.41, 0.45, 0.5, 0.7, 0.8, 0.81):
        m = torch.tensor([mass])
        assert torch.equal(prefix_keep(order, probs, m, place, _local), exact_keep(order, probs, m)), mass
        # typical-p's rule keeps the whole tie at the cut
        got = prefix_keep(order, probs, m, place, _local, whole_ties=True)
        assert torch.equal(got, exact_keep(order, probs, m, whole_ties=True)), mass


@pytest.mark.ranks
@pytest.mark.parametrize(("tp", "layout"), [(2, "uneven"), (3, "padded"), (4, "uneven")])
def test_split_cut_equals_exact_rational_arithmetic(launch_ranks: Callable[..., list[Any]], tp: int,
                                                    layout: str) -> None:
    per_rank = launch_ranks(F.split_keep, tp, layout, 5, timeout_s=120)
    for n, (x, mass, _) in enumerate(F.cases(5)):
        for ties in (False, True):
            got = torch.zeros(x.shape, dtype=torch.bool)
            for masks in per_rank:
                got |= torch.tensor(masks[ties][n])
            assert torch.equal(got, exact_keep(x, torch.softmax(x, dim=1), mass, ties)), (tp, layout, n, ties)


def test_the_cut_takes_fixed_rounds_and_reads_nothing() -> None:
    seen: list[tuple[int, ...]] = []

    def gather(t: torch.Tensor, _place: Any) -> torch.Tensor:
        seen.append(tuple(t.shape))
        return t[None]

    for x, mass, added in F.cases(3):
        seen.clear()
        place = F.placement(x.shape[1] - added, added, 1, 0, "uneven")
        with HostReads() as reads:
            prefix_keep(x, torch.softmax(x, dim=1), mass, place, gather)
        assert reads.total == 0, dict(reads.by_call)
        rows, bins = x.shape[0], 256
        assert seen == [(rows, bins)] * (RADIX_ROUNDS - 1) + [(rows, bins * (2 if added else 1))]


def test_a_row_with_no_mass_keeps_its_first_token() -> None:
    """Every logit ``-inf``: the probabilities are NaN (``exp(-inf - -inf)``); as in a float reference, whose
    comparisons with NaN fail, only the first token stays (typical-p's whole tie: all of them)."""
    x = torch.full((2, 7), float("-inf"))
    x[1, 4] = 0.5
    probs = torch.softmax(x, dim=1)
    place = F.placement(7, 0, 1, 0, "uneven")
    keep = prefix_keep(x, probs, torch.tensor([0.9, 0.9]), place, _local)
    assert keep[0].tolist() == [True] + [False] * 6 and keep[1].tolist() == [False] * 4 + [True] + [False] * 2
    assert bool(prefix_keep(x, probs, torch.tensor([0.9, 0.9]), place, _local, whole_ties=True)[0].all())
    assert kept_prefix(probs[:1], torch.tensor([0.9])).tolist() == [1]


def test_masses_past_one_neither_overflow_nor_drop_tokens_at_one() -> None:
    """Logits of 1e9 tie: the float32 logsumexp rounds down and each tied token gets p = 1, so the row's
    masses add up to many times 1 (the sums must not wrap); and a mass of 1 keeps every token."""
    place = F.placement(64, 0, 1, 0, "uneven")
    for tied in (4, 8, 9, 16, 33, 64):
        x = torch.zeros(1, 64)
        x[0, :tied] = 1e9
        probs = torch.exp(x - torch.logsumexp(x, dim=1, keepdim=True))
        for mass in (0.5, 1.0):
            m = torch.tensor([mass])
            assert torch.equal(prefix_keep(x, probs, m, place, _local), exact_keep(x, probs, m)), (tied, mass)
        assert bool(prefix_keep(x, probs, torch.tensor([1.0]), place, _local).all())
        assert kept_prefix(probs, torch.tensor([1.0])).tolist() == [64]
