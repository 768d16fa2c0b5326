"""trtvocab.sampling.treesum: the one-pass vocab tree of (max, sum exp) pairs.

* the level-by-level cut of a range gives exactly the maximal aligned nodes (hypothesis);
* the C++ kernel (trtvocab/kernels/csrc/treesum.cpp) and the torch path give the same bits, on
  adversarial logits (+-inf, all -inf rows, huge and subnormal values, ties, -0.0);
* any split of the vocab into ranks / chunks, merged sibling by sibling, gives the whole range's
  bits; the result is within a stated float32 bound of a float64 ``logsumexp``;
* the chunked logsumexp / logprobs stream the weight once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trtvocab import LMHead
from trtvocab.kernels import tree as kernel_tree
from trtvocab.sampling import chunked, treesum

HAVE_KERNEL = kernel_tree.tree_available()


@contextmanager
def torch_path() -> Iterator[None]:
    """The torch ops of treesum.range_nodes, even where the kernel is available."""
    before = kernel_tree._tree_failure, kernel_tree._tree_checked
    kernel_tree._tree_failure, kernel_tree._tree_checked = "off for this test", True
    try:
        yield
    finally:
        kernel_tree._tree_failure, kernel_tree._tree_checked = before


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def hostile(rows: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * torch.tensor([1.0, 30.0, 1e30, 1e-40])[seed % 4]
    r = torch.rand(rows, n, generator=g)
    x[r < 0.2] = float("-inf")
    x[(r > 0.2) & (r < 0.22)] = 7.0  # ties
    x[(r > 0.22) & (r < 0.23)] = -0.0
    if rows > 1:
        x[1] = float("-inf")  # a row that allows nothing
    if n > 3 and seed % 3 == 0:
        x[0, n // 3] = float("inf")
    if rows > 2 and seed % 2 == 0:
        x[2, : n // 2] = float("inf")  # several +inf: same infinities merge
    return x


def merged(pieces: list[tuple[int, torch.Tensor]]) -> list[treesum.Node]:
    """Nodes of consecutive pieces ``(first_id, logits)``, merged sibling by sibling (as chunked does)."""
    stack: list[treesum.Node] = []
    for first, x in pieces:
        for node in treesum.range_nodes(x, first):
            treesum.push(stack, node)
    return stack


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**40), st.integers(0, 3000))
def test_range_nodes_are_the_maximal_aligned_nodes(start: int, n: int) -> None:
    x = torch.zeros(1, n)
    with torch_path():
        assert [(lv, i) for lv, i, _, _ in treesum.range_nodes(x, start)] == treesum.aligned_nodes(start, start + n)
    covered = sorted((i << lv, (i + 1) << lv) for lv, i in treesum.aligned_nodes(start, start + n))
    assert [a for a, _ in covered[1:]] == [b for _, b in covered[:-1]]  # contiguous, no overlap
    assert (covered[0][0], covered[-1][1]) == (start, start + n) if n else covered == []


@pytest.mark.skipif(not HAVE_KERNEL, reason=f"tree kernel unavailable: {kernel_tree._tree_failure}")
@pytest.mark.parametrize("seed", range(12))
def test_kernel_equals_torch_path_bitwise(seed: int) -> None:
    n = [1, 2, 7, 16, 255, 1024, 1025, 3001, 40000, 129280 // 3, 5, 70000][seed]
    rows = 1 + seed % 4
    x = hostile(rows, n, seed)
    first = [0, 1, 37, 1023, 2**20 - 3, 12345][seed % 6]
    got = treesum.range_nodes(x, first)
    with torch_path():
        want = treesum.range_nodes(x, first)
    assert [(lv, i) for lv, i, _, _ in got] == [(lv, i) for lv, i, _, _ in want]
    for (_, _, m1, s1), (_, _, m2, s2) in zip(got, want, strict=True):
        assert torch.equal(bits(m1), bits(m2)) or torch.equal(m1, m2)  # -0.0 vs 0.0 maxima compare equal
        assert torch.equal(bits(s1), bits(s2))


@pytest.mark.skipif(not HAVE_KERNEL, reason=f"tree kernel unavailable: {kernel_tree._tree_failure}")
def test_kernel_exp_matches_torch_exp() -> None:
    assert kernel_tree.tree_exp_check() is None


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("seed", range(6))
def test_any_split_gives_the_whole_range_bits(path: str, seed: int) -> None:
    if path == "kernel" and not HAVE_KERNEL:
        pytest.skip(f"tree kernel unavailable: {kernel_tree._tree_failure}")
    g = torch.Generator().manual_seed(100 + seed)
    vocab = [1, 9, 1000, 4097, 30522, 49152][seed]
    x = hostile(3, vocab, seed)
    cuts = sorted(set(torch.randint(0, vocab + 1, (int(torch.randint(1, 9, (1,), generator=g)),),
                                    generator=g).tolist()) | {0, vocab})
    pieces = [(a, x[:, a:b]) for a, b in itertools.pairwise(cuts)]
    run = torch_path() if path == "torch" else contextmanager(lambda: (yield))()
    with run:
        whole = treesum.merge_ranges(treesum.range_nodes(x, 0), vocab, 1, None, [(0, vocab)], like=x)
        split = treesum.merge_ranges(merged(pieces), vocab, 1, None, [(0, vocab)], like=x)
        singles = treesum.merge_ranges(merged([(j, x[:, j : j + 1]) for j in range(vocab)]) if vocab <= 1000 else
                                       merged(pieces), vocab, 1, None, [(0, vocab)], like=x)
    for a, b in ((whole, split), (whole, singles)):
        assert torch.equal(bits(a[1]), bits(b[1]))


@pytest.mark.parametrize("scale", [1.0, 20.0, 1e4])
def test_logsumexp_is_within_the_float32_bound_of_float64(scale: float) -> None:
    g = torch.Generator().manual_seed(int(scale))
    vocab = 49152
    x = torch.randn(4, vocab, generator=g) * scale
    x[0, :100] = float("-inf")
    _, lse, _ = treesum.tree_logsumexp(x, 0, vocab, 1, None, [(0, vocab)])
    ref = torch.logsumexp(x.double(), dim=1)
    # Each of the ceil(log2 V) levels rounds s by at most 3 ulps (exp, mul, add); log(s) then carries
    # that relative error as an absolute one, and m + log(s) rounds once more.
    depth = math.ceil(math.log2(vocab))
    bound = 3 * (depth + 1) * 2.0**-24 + 2.0**-23 * ref.abs() + 1e-7
    assert ((lse.double() - ref).abs() <= bound).all(), (lse.double() - ref).abs().max()


def test_special_rows_match_torch_logsumexp() -> None:
    x = torch.tensor([[float("-inf")] * 5, [1.0, float("inf"), 2.0, float("inf"), 0.0], [3.0] * 5])
    _, lse, _ = treesum.tree_logsumexp(x, 0, 5, 1, None, [(0, 5)])
    want = torch.logsumexp(x, dim=1)
    assert torch.isneginf(lse[0]) and torch.isposinf(lse[1])
    assert torch.allclose(lse[2], want[2])


def test_chunked_logsumexp_and_logprobs_stream_the_weight_once(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    head = LMHead(vocab_size=3001, hidden_size=32, dtype=torch.float32)
    head.load_weights({"weight": torch.randn(3001, 32)})
    passes: list[int] = []

    class Counting(chunked._Stream):
        def __iter__(self):  # type: ignore[no-untyped-def]
            passes.append(1)
            return super().__iter__()

    monkeypatch.setattr(chunked, "_Stream", Counting)
    x = torch.randn(5, 32)
    lse = chunked.stream_logsumexp(x, head, chunk=100)
    lp = chunked.stream_logprobs(x, head, torch.tensor([0, 1, 2, 3000, 7]), chunk=100)
    assert passes == [1, 1]
    assert torch.allclose(lse, torch.logsumexp((x.double() @ head.weights.dense_weight().double().T), 1).float(),
                          atol=1e-5)
    assert lp.shape == (5,)
