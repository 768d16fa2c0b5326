"""Functions that run on each rank of a ``run_ranks`` launch, and the helpers they share.

Spawned children unpickle these by module name (``tests.parallel.rank_fns.<fn>``), so this
module must be importable there: ``tests`` is a package, conftest puts the repository root on
``sys.path``, and spawn hands the parent's ``sys.path`` to every child.

Spawning costs seconds, so each function runs many cases in one launch and returns
small per-case records (numbers, flags, error types and texts); the test process
makes the assertions, so a failure names its case.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from trtvocab import LMHead, LogitsProcessor, Mapping, sampling
from trtvocab.errors import TrtVocabError
from trtvocab.parallel import distributed as D
from trtvocab.sampling import reductions

VOCABS = (30522, 30011)  # BERT's vocab, and a prime (no tp divides it)
HIDDEN = 64
ROWS = 6
TOPK = 10
ADP_ROWS = (3, 0, 5, 1, 2)  # rows each rank brings under attention DP


# ---- shared helpers (also imported by the tests themselves) ---------------------------------------
def weights(vocab: int, hidden: int, seed: int) -> torch.Tensor:
    """The same float32 ``[V, H]`` matrix on every rank (seeded generator, no global state)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, hidden, generator=gen) / hidden**0.5


def hidden_states(rows: int, hidden: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, hidden, generator=gen) * 4


def max_abs_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max()) if y.numel() else 0.0


def ulp_floor(ref: torch.Tensor, dtype: torch.dtype, ulps: int = 4) -> float:
    """``ulps`` units in the last place of ``dtype`` at the largest reference magnitude.

    The head's output is rounded to ``dtype``: one rounding step at magnitude ``|y|`` is
    at most ``eps * |y|``. A single-device error can be far smaller than that on a
    lucky input (even zero), while a column-split GEMM on CPU BLAS takes another kernel
    path (other blocking, other tail handling) and may round a few of the H-term dot
    products the other way. Four such steps at the largest magnitude is the slack that
    keeps ``err_tp <= 2 * err_single`` from failing on noise, and it is still far below
    any real layout bug (a wrong column is off by O(|y|), not by ulps).
    """
    return ulps * torch.finfo(dtype).eps * float(ref.abs().max()) if ref.numel() else 0.0


def stable_topk_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k ids under trtvocab's tie rule: value descending, then token id ascending.

    Same as ``torch.sort(logits, descending=True, stable=True).indices[:, :k]``, but sorts
    only the candidates at or above the k-th value (a full sort of 30k columns per row
    costs more than the rest of a parity case).
    """
    kth = torch.topk(logits, k, dim=1).values[:, -1:]
    rows = []
    for row, bound in zip(logits, kth, strict=True):
        cand = torch.nonzero(row >= bound)[:, 0]  # ascending ids
        order = torch.sort(row[cand], descending=True, stable=True).indices[:k]
        rows.append(cand[order])
    return torch.stack(rows)


def catch(fn: Callable[[], Any]) -> tuple[str, str]:
    """Run ``fn``; return ``(error type name, message)``, or ``("ok", "")``."""
    try:
        fn()
    except TrtVocabError as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def _record(case: str, y: torch.Tensor, y1: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "case": case,
        "shape": list(y.shape),
        "err_tp": max_abs_err(y, ref),
        "err_single": max_abs_err(y1, ref),
        "floor": ulp_floor(ref, dtype),
        "argmax_equal": bool(torch.equal(y.argmax(1), y1.argmax(1))) if y.numel() else True,
        "topk_equal": bool(torch.equal(stable_topk_ids(y, TOPK), stable_topk_ids(y1, TOPK))) if y.numel() else True,
        "bitwise": bool(torch.equal(y, y1)),
    }


# ---- test_tp_parity ---------------------------------------------------------------------------------
def subgroups(world: int) -> dict[int, Any]:
    """``{tp: group of ranks [0, tp)}`` for tp in 2..world (every rank must create every group).

    One launch of ``world`` processes then tests every tp: ranks ``>= tp`` sit a phase out.
    """
    groups: dict[int, Any] = {}
    for tp in range(2, world + 1):
        groups[tp] = dist.new_group(list(range(tp))) if tp < world else None  # None: the default group
    return groups


def parity_cases(rank: int, world: int, seed: int) -> list[dict[str, Any]]:
    """TP head vs single-device head vs float64 reference, for tp = 1 (world 1) or every tp in 2..world."""
    groups = subgroups(world)
    tps = [1] if world == 1 else [tp for tp in groups if rank < tp]
    out: list[dict[str, Any]] = []
    for vocab in VOCABS:
        w32 = weights(vocab, HIDDEN, seed + vocab)
        x32 = hidden_states(ROWS, HIDDEN, seed)
        for dtype in (torch.float32, torch.bfloat16):
            x = x32.to(dtype)
            single = LMHead(vocab, HIDDEN, dtype=dtype)  # mapping=None: replicated
            single.load_weights({"lm_head.weight": w32})
            y1 = single(x)
            ref = x.double() @ single.weights.weight.double().t()
            for tp in tps:
                group = groups.get(tp)
                mapping = Mapping(world_size=tp, rank=rank, tp_size=tp)
                for layout in ("uneven", "padded"):
                    tag = f"tp={tp} V={vocab} {str(dtype)[6:]} {layout}"
                    head = LMHead(vocab, HIDDEN, dtype=dtype, mapping=mapping, vocab_layout=layout, pad_to=64,
                                  process_group=group)
                    head.load_weights({"lm_head.weight": w32})  # the head slices its own rows
                    out.append(_record(f"{tag} gathered", head(x), y1, ref, dtype))
                    local = LMHead(vocab, HIDDEN, dtype=dtype, mapping=mapping, vocab_layout=layout, pad_to=64,
                                   gather_output=False, process_group=group)
                    # already-sliced rows load too
                    local.load_weights({"weight": w32[local.vocab_start : local.vocab_end]})
                    s, e = local.vocab_start, local.vocab_end
                    y = local(x)
                    rec = _record(f"{tag} local [{s},{e})", y, y1[:, s:e], ref[:, s:e], dtype)
                    rec["local_shape_ok"] = list(y.shape) == [ROWS, e - s]
                    out.append(rec)
        for tp in tps:
            out.extend(_attention_dp(rank, tp, groups.get(tp), vocab, w32, seed))
    if world >= 4:
        out.extend(_two_groups_of_two(rank, world, seed))
    return out


def _attention_dp(rank: int, tp: int, group: Any, vocab: int, w32: torch.Tensor, seed: int) -> list[dict[str, Any]]:
    """Every rank brings its own, different number of rows (rank 1: none)."""
    single = LMHead(vocab, HIDDEN, dtype=torch.float32)
    single.load_weights({"weight": w32})
    counts = ADP_ROWS[:tp]
    mine = hidden_states(counts[rank], HIDDEN, seed + 100 + rank)
    ref = mine.double() @ w32.double().t()
    # the single-device head (no attention DP) refuses an empty batch: nothing to compare then
    y1 = single(mine) if counts[rank] else torch.empty(0, vocab)
    out = []
    for lm_head_tp in (False, True):
        mapping = Mapping(world_size=tp, rank=rank, tp_size=tp, enable_attention_dp=True,
                          enable_lm_head_tp_in_adp=lm_head_tp)
        head = LMHead(vocab, HIDDEN, dtype=torch.float32, mapping=mapping, process_group=group)
        head.load_weights({"weight": w32})
        y = head(mine)
        rec = _record(f"tp={tp} V={vocab} ADP lm_head_tp={lm_head_tp} rows={counts[rank]}", y, y1, ref,
                      torch.float32)
        rec["is_split"] = head.is_split
        rec["expect_split"] = lm_head_tp and tp > 1
        rec["rows_ok"] = y.shape[0] == counts[rank]
        # Through the LogitsProcessor too: an idle rank (no rows, no seq_lens) passes [0, H]
        # through and still takes part in the collectives.
        lp = LogitsProcessor()(mine, head, seq_lens=[counts[rank]] if counts[rank] else None)
        rec["processor_ok"] = lp.shape == (min(counts[rank], 1), vocab) and (
            counts[rank] == 0 or torch.allclose(lp, y[-1:].float(), rtol=1e-5, atol=1e-5))  # 1-row GEMM
        out.append(rec)
    return out


def _two_groups_of_two(rank: int, world: int, seed: int) -> list[dict[str, Any]]:
    """Ranks 0-3 as world 4 = two TP groups of 2: each group gathers only its own ranks' columns."""
    tp_group = [rank - rank % 2, rank - rank % 2 + 1] if rank < 4 else [0, 1]
    group = D.new_tp_group(tp_group, 4, 2)  # every rank takes part in creating the groups
    if rank >= 4:
        return []
    mapping = Mapping(world_size=4, rank=rank, tp_size=2)
    assert mapping.tp_group == tp_group
    vocab = VOCABS[1]
    w32 = weights(vocab, HIDDEN, seed)
    # Different hidden states per group: a gather that crossed groups would mix them up.
    x = hidden_states(ROWS, HIDDEN, seed + 1000 + rank // 2)
    single = LMHead(vocab, HIDDEN, dtype=torch.float32)
    single.load_weights({"weight": w32})
    head = LMHead(vocab, HIDDEN, dtype=torch.float32, mapping=mapping, process_group=group)
    head.load_weights({"weight": w32})
    ref = x.double() @ w32.double().t()
    return [_record(f"world=4 tp=2 group {mapping.tp_group}", head(x), single(x), ref, torch.float32)]


# ---- test_logits_processor ----------------------------------------------------------------------------
def logits_processor_tp(rank: int, world: int, seed: int) -> dict[str, Any]:
    """A split head inside the LogitsProcessor returns what the replicated one does."""
    vocab, hidden = 1000, 32
    w32 = weights(vocab, hidden, seed)
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, 9, (5,), generator=gen)
    states = torch.randn(int(seq_lens.sum()), hidden, generator=gen)
    single = LMHead(vocab, hidden, dtype=torch.float32)
    single.load_weights({"weight": w32})
    head = LMHead(vocab, hidden, dtype=torch.float32, mapping=Mapping(world_size=world, rank=rank, tp_size=world),
                  vocab_layout="padded", pad_to=16)
    head.load_weights({"weight": w32})
    proc = LogitsProcessor()
    out = {}
    for name, kwargs in {"last": {"seq_lens": seq_lens}, "none": {},
                         "context": {"seq_lens": seq_lens, "return_context_logits": True}}.items():
        got, want = proc(states, head, **kwargs), proc(states, single, **kwargs)
        ref = proc(states.double(), _Float64Head(w32), **kwargs)
        out[name] = {"shape": list(got.shape), "want_shape": list(want.shape), "dtype": str(got.dtype),
                     "err_tp": max_abs_err(got, ref), "err_single": max_abs_err(want, ref),
                     "floor": ulp_floor(ref, torch.float32)}
    return out


class _Float64Head(torch.nn.Module):
    """The float64 reference as a head, so the LogitsProcessor selects its rows the same way."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = w.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double() @ self.w.t()


# ---- test_bad_input -----------------------------------------------------------------------------------
def bad_input_cases(rank: int, world: int, checkpoints: dict[str, str]) -> list[dict[str, Any]]:
    """Every rank runs every case; the typed error (or "ok") of each is recorded by case name.

    A case named ``... (rank 1)`` gives the bad input to rank 1 only, the others a good
    one; ``... (all)`` gives it to every rank. After a failed handshake the ranks have
    left it in step, so the next case uses the same group. Expectations live in
    test_bad_input.py.
    """
    vocab, hidden = 100, 16
    mapping = Mapping(world_size=world, rank=rank, tp_size=world)

    def head(**kw: Any) -> LMHead:
        h = LMHead(kw.pop("vocab", vocab), kw.pop("hidden", hidden), dtype=torch.float32,
                   mapping=kw.pop("mapping", mapping), **kw)
        h.load_weights({"weight": weights(h.vocab_size, h.hidden_size, 0)})
        return h

    good = head()
    proc = LogitsProcessor()
    x = hidden_states(6, hidden, 1)
    logits = good.local_logits(x)

    def on(bad_ranks: str, bad: Any, fine: Any) -> Any:
        return bad if bad_ranks == "all" or rank == 1 else fine

    cases: dict[str, Callable[[], Any]] = {
        "seq_lens sum != T (all)": lambda: proc(x, good, [2, 3]),
        "seq_lens sum != T (rank 1)": lambda: proc(x, good, on("1", [2, 3], [3, 3])),
        "zero length (all)": lambda: proc(x, good, [0, 6]),
        "zero length (rank 1)": lambda: proc(x, good, on("1", [0, 6], [3, 3])),
        "negative length (rank 1)": lambda: proc(x, good, on("1", [-1, 7], [3, 3])),
        "float seq_lens (rank 1)": lambda: proc(x, good, on("1", torch.tensor([3.0, 3.0]), [3, 3])),
        "wrong hidden size (all)": lambda: good(hidden_states(2, hidden + 1, 2)),
        "wrong hidden size (rank 1)": lambda: good(hidden_states(2, on("1", hidden + 1, hidden), 2)),
        "wrong dtype (rank 1)": lambda: good(on("1", x.to(torch.bfloat16), x)),
        "3-D hidden (rank 1)": lambda: good(on("1", x[None], x)),
        "empty batch (all)": lambda: good(x[:0]),
        "empty batch (rank 1)": lambda: good(on("1", x[:0], x)),
        "empty batch, processor (rank 1)": lambda: proc(on("1", x[:0], x), good),
        "different row counts (rank 1)": lambda: good(on("1", x[:2], x)),
        "sampling k > V (rank 1)": lambda: sampling.topk(logits, good, on("1", vocab + 1, 3)),
        "sampling NaN (rank 1)": lambda: sampling.greedy(on("1", torch.full_like(logits, float("nan")), logits),
                                                         good),
        "sampling id out of range (rank 1)": lambda: sampling.logprobs(logits, good,
                                                                       torch.full((6,), on("1", vocab, 0))),
        "sampling wrong width (rank 1)": lambda: sampling.greedy(on("1", logits[:, :-1], logits), good),
        "sampling min_p > 1 (rank 1)": lambda: sampling.min_p_mask(logits, good, on("1", 1.5, 0.1)),
        "sampling top_p = 0 (rank 1)": lambda: sampling.top_p_mask(logits, good, on("1", 0.0, 0.9)),
        "sampling different k (rank 1)": lambda: sampling.topk(logits, good, on("1", 4, 3)),
        "sampling different rows (rank 1)": lambda: sampling.greedy(on("1", logits[:2], logits), good),
        # heads built differently on one rank: the handshake sees it before data moves
        "different vocab (rank 1)": lambda: on("1", head(vocab=vocab + 1), good)(x),
        "different hidden (rank 1)": lambda: (lambda h: h(hidden_states(6, h.hidden_size, 1)))(
            on("1", head(hidden=hidden * 2), good)),
        "different layout (rank 1)": lambda: on("1", head(vocab_layout="padded", pad_to=8), good)(x),
        "different pad_to (rank 1)": lambda: head(vocab_layout="padded", pad_to=on("1", 4, 8))(x),
        "different gather_output (rank 1)": lambda: on("1", head(gather_output=False), good)(x),
        # tp 4 on rank 1 while the group has `world` ranks: world_size 4 is only its mapping's belief
        "different tp (rank 1)": lambda: on("1", head(mapping=Mapping(world_size=4, rank=rank, tp_size=4)),
                                            good)(x),
        "missing tensor (all)": lambda: LMHead.from_checkpoint(checkpoints["missing"], mapping=mapping),
        "shape vs config.json (all)": lambda: LMHead.from_checkpoint(checkpoints["wrong_shape"], mapping=mapping),
        "untied, no lm_head (all)": lambda: LMHead.from_checkpoint(checkpoints["untied"], mapping=mapping),
    }
    records = [{"case": name, "rank": rank, **dict(zip(("type", "msg"), catch(call), strict=True))}
               for name, call in cases.items()]
    # The group still works after all of that.
    records.append({"case": "healthy after", "rank": rank, "type": "ok" if good(x).shape == (6, vocab) else "bad",
                    "msg": ""})
    return records


def bad_input_and_load_cases(rank: int, world: int, checkpoints: dict[str, str], load: dict[str, Any]
                             ) -> dict[str, Any]:
    """:func:`bad_input_cases`, then the load failures of tests/parallel/test_bad_input.py, in one launch:
    none of them kills a rank (each raises a typed error on every rank and leaves the group in step).

    ``load``: ``{"replicated": path, "per_rank": [path of rank r]}``. Each load case records its
    error's type, the names of the types it is an instance of, its message, and how long the call
    took on this rank (from the bad input to the raise).
    """
    import time

    def timed(fn: Callable[[], Any]) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            fn()
            kind, types, msg = "ok", ["ok"], ""
        except TrtVocabError as exc:
            kind, types, msg = type(exc).__name__, [c.__name__ for c in type(exc).__mro__], str(exc)
        return {"type": kind, "types": types, "msg": msg, "seconds": time.perf_counter() - started}

    cases = bad_input_cases(rank, world, checkpoints)
    loads = {f"replicated {module}": timed(lambda m=module: load_replicated_next_to_split(rank, world,
                                                                                          load["replicated"], m))
             for module in ("head", "embedding")}
    loads["one rank's copy truncated"] = timed(lambda: load_then_forward(rank, world, load["per_rank"]))
    loads["healthy after"] = timed(lambda: load_then_forward(rank, world, [load["replicated"]] * world))
    return {"cases": cases, "loads": loads}


def raise_bad_seq_lens_on(rank: int, world: int, bad_rank: int) -> None:
    """Let the typed errors escape to ``run_ranks`` (RankFailures.errors is checked)."""
    vocab, hidden = 50, 8
    head = LMHead(vocab, hidden, dtype=torch.float32, mapping=Mapping(world_size=world, rank=rank, tp_size=world))
    head.load_weights({"weight": weights(vocab, hidden, 0)})
    x = hidden_states(4, hidden, 0)
    LogitsProcessor()(x, head, [1, 2] if rank == bad_rank else [2, 2])


# ---- test_sampling ------------------------------------------------------------------------------------
def _constructed_logits(kind: str, rows: int, vocab: int, gen: torch.Generator, shards: list[Any]) -> torch.Tensor:
    """Gathered ``[rows, V]`` logits with the ties and extremes a sampler must get right."""
    if kind == "random":
        return torch.randn(rows, vocab, generator=gen) * 3
    if kind == "bf16":  # 8 mantissa bits: natural ties among the top values
        return (torch.randn(rows, vocab, generator=gen) * 3).to(torch.bfloat16)
    if kind == "ints":  # five distinct values over the whole vocab: ties everywhere, across shards
        return torch.randint(0, 5, (rows, vocab), generator=gen).float()
    if kind == "edges":
        g = torch.randn(rows, vocab, generator=gen)
        g[0] = 0.0  # all equal: argmax 0, top-k = ids 0..k-1
        g[1] = float("-inf")  # all -inf: argmax 0, logsumexp -inf
        # the max tied on the last id of every shard (and the first of the next): lowest id wins
        g[2] = torch.randn(vocab, generator=gen)
        for s in shards:
            if s.size:
                g[2, s.end - 1] = 10.0
                g[2, s.start] = 10.0
        g[3] = float("-inf")  # a single finite token at the very end of the vocab
        g[3, vocab - 1] = 1.0
        # only the last shard holds finite values; earlier ones are -inf ties
        g[4] = float("-inf")
        last = [s for s in shards if s.size][-1]
        g[4, last.start : last.end] = torch.randn(last.size, generator=gen)
        return g
    raise ValueError(kind)


def _local_view(gathered: torch.Tensor, head: LMHead, padded_input: bool, garbage: float) -> torch.Tensor:
    """This rank's logits as a head hands them out: ``[B, size]`` or ``[B, width]`` with padding."""
    s = head.shard
    local = gathered[:, s.start : s.end]
    if padded_input and s.padding:
        local = torch.cat([local, local.new_full((local.shape[0], s.padding), garbage)], dim=1)
    return local.contiguous()


def _close_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference where both are finite; ``inf`` if their inf/nan patterns differ."""
    a, b = a.double(), b.double()
    same = (torch.isnan(a) == torch.isnan(b)) & (torch.isposinf(a) == torch.isposinf(b)) & \
        (torch.isneginf(a) == torch.isneginf(b))
    if not bool(same.all()):
        return float("inf")
    finite = torch.isfinite(a) & torch.isfinite(b)
    return float((a - b)[finite].abs().max()) if bool(finite.any()) else 0.0


def sampling_cases(rank: int, world: int, seed: int) -> list[dict[str, Any]]:
    """Distributed sampling vs the same ops on the gathered logits: tp 1 (world 1) or every tp in 2..world."""
    groups = subgroups(world)
    if world == 1:
        return _sampling_cases_tp(0, 1, None, seed)
    return [rec for tp, group in groups.items() if rank < tp for rec in _sampling_cases_tp(rank, tp, group, seed)]


def _sampling_cases_tp(rank: int, world: int, group: Any, seed: int) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    mapping = Mapping(world_size=world, rank=rank, tp_size=world)
    # V 100 padded to 64 * tp: trailing ranks own no column at all (tp 3, 4)
    layouts = [(1000, "uneven", 64), (1000, "padded", 7), (100, "uneven", 64), (100, "padded", 64)]
    for vocab, layout, pad_to in layouts:
        head = LMHead(vocab, 4, dtype=torch.float32, mapping=mapping, vocab_layout=layout, pad_to=pad_to,
                      process_group=group)
        for n, kind in enumerate(("random", "bf16", "ints", "edges")):
            gen = torch.Generator().manual_seed(seed + n)  # same logits on every rank
            g = _constructed_logits(kind, 6, vocab, gen, head.shards)
            # padding given as -inf (what local_logits writes) or as +inf garbage: never used
            local = _local_view(g, head, padded_input=n % 2 == 0, garbage=float("inf") if n == 2 else -1e30)
            tag = f"tp={world} V={vocab} {layout}/{pad_to} {kind} shard=[{head.vocab_start},{head.vocab_end})"
            records.extend(_compare_all(tag, local, g, head, seed + n))
    # through the head itself: local_logits (padding -inf) vs the gathered forward
    for layout in ("uneven", "padded"):
        vocab, hidden = 30011, 32
        head = LMHead(vocab, hidden, dtype=torch.bfloat16, mapping=mapping, vocab_layout=layout, process_group=group)
        head.load_weights({"weight": weights(vocab, hidden, seed)})
        x = hidden_states(5, hidden, seed).to(torch.bfloat16)
        records.extend(_compare_all(f"tp={world} head forward {layout}", head.local_logits(x), head(x), head, seed))
    return records


def _compare_all(tag: str, local: torch.Tensor, g: torch.Tensor, head: LMHead, seed: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    vocab = g.shape[1]
    s, e = head.vocab_start, head.vocab_end
    g32 = g.float()
    # A row that allows no token (all -inf) has no right answer: greedy raises on every rank;
    # every other row gets torch.argmax of the gathered logits.
    allowed = ~torch.isneginf(g.float()).all(dim=1)
    out.append({"case": f"{tag} greedy", "exact": bool(torch.equal(sampling.greedy(local[allowed], head),
                                                                    g[allowed].argmax(1)))})
    if not bool(allowed.all()):
        kind, message = catch(lambda: sampling.greedy(local, head))
        out.append({"case": f"{tag} greedy on a row with no allowed token",
                    "exact": kind == "InputError" and "allow no token" in message})
    for k in sorted({1, 5, 37, vocab}):
        if k > vocab:
            continue
        values, ids = sampling.topk(local, head, k)
        want_values, want_ids = torch.topk(g, k)
        stable = stable_topk_ids(g, k)
        # torch.topk's ids must agree wherever no tie makes the order a free choice
        ordered = torch.sort(g32, dim=1).values
        wv = want_values.float().contiguous()
        counts = torch.searchsorted(ordered, wv, right=True) - torch.searchsorted(ordered, wv)
        distinct = counts == 1
        out.append({
            "case": f"{tag} topk k={k}",
            "exact": bool(torch.equal(values, want_values)) and bool(torch.equal(ids, stable))
            and values.dtype == g.dtype and ids.dtype == torch.int64,
            "torch_ids_where_distinct": bool(torch.equal(ids[distinct], want_ids[distinct])),
        })
    lse = sampling.logsumexp(local, head)
    out.append({"case": f"{tag} logsumexp", "err": _close_err(lse, torch.logsumexp(g32, 1)), "exact": None})
    lsm = sampling.log_softmax(local, head)
    want_lsm = torch.log_softmax(g32, 1)
    out.append({"case": f"{tag} log_softmax", "err": _close_err(lsm, want_lsm[:, s:e]), "exact": None,
                "shape_ok": list(lsm.shape) == [g.shape[0], e - s]})
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (g.shape[0], 3), generator=gen)
    ids[:, 0] = vocab - 1  # the last id: owned by the last non-empty shard
    lp = sampling.logprobs(local, head, ids)
    out.append({"case": f"{tag} logprobs [B, 3]", "err": _close_err(lp, want_lsm.gather(1, ids)), "exact": None})
    lp1 = sampling.logprobs(local, head, ids[:, 1])
    out.append({"case": f"{tag} logprobs [B]", "err": _close_err(lp1, want_lsm.gather(1, ids[:, 1:2])[:, 0]),
                "exact": None})
    for min_p in (0.0, 0.3, 1.0, torch.linspace(0, 1, g.shape[0])):
        keep = sampling.min_p_mask(local, head, min_p)
        thr = min_p.reshape(-1, 1) if isinstance(min_p, torch.Tensor) else min_p
        want = torch.exp(g32 - g32.amax(1, keepdim=True)) >= thr
        filtered = sampling.apply_min_p(local, head, min_p)
        want_filtered = g.masked_fill(~want, float("-inf"))[:, s:e]
        label = "per-row" if isinstance(min_p, torch.Tensor) else min_p
        out.append({"case": f"{tag} min_p={label}",
                    "exact": bool(torch.equal(keep, want[:, s:e]))
                    and bool(torch.equal(filtered, want_filtered))})
    # top-p on the gathered logits, written out plainly in float64: stable sort (value desc,
    # id asc), softmax over everything, keep a token while the mass before it is below p.
    # A float32 implementation can only differ where that mass is within rounding of p
    # (e.g. 1000 equal logits at p = 0.3): such tokens are the only ones allowed to differ.
    order = torch.sort(g32, dim=1, descending=True, stable=True).indices
    probs = torch.softmax(g32.double(), dim=1).gather(1, order)
    before = torch.cumsum(probs, dim=1) - probs
    for top_p in (0.3, 0.9, 0.999, torch.linspace(0.05, 0.95, g.shape[0])):
        thr = top_p.reshape(-1, 1).double() if isinstance(top_p, torch.Tensor) else top_p
        keep_sorted = before < thr
        keep_sorted[:, 0] = True
        want = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)[:, s:e]
        near = torch.zeros_like(keep_sorted).scatter(1, order, (before - thr).abs() < 1e-5)[:, s:e]
        # With the handshake on every call (not only when the call's signature changes), a
        # public call makes exactly one, before the cut's fixed rounds (one gather each).
        head.handshake_every_call = True
        with _counting(D.Handshake, "exchange") as handshakes, _counting(reductions, "gather_stack") as rounds:
            keep = sampling.top_p_mask(local, head, top_p)
        head.handshake_every_call = False
        filtered = sampling.apply_top_p(local, head, top_p)
        label = "per-row" if isinstance(top_p, torch.Tensor) else top_p
        out.append({"case": f"{tag} top_p={label}",
                    "exact": bool(((keep == want) | near).all())
                    and bool(torch.equal(filtered, g[:, s:e].masked_fill(~keep, float("-inf"))))
                    and int((keep != want).sum()) <= int(near.sum()),
                    # one handshake per public call, then the cut's rounds
                    "handshakes": len(handshakes), "rounds": len(rounds), "split": head.is_split})
    return out


@contextlib.contextmanager
def _counting(owner: Any, name: str) -> Iterator[list[int]]:
    """Count the calls of ``owner.name`` (a function or method) while the block runs."""
    real = getattr(owner, name)
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield calls
    finally:
        setattr(owner, name, real)


def exit_hard(rank: int, world: int, stamp_dir: str | None = None) -> None:
    """Die without reporting anything (as an OOM kill would): the launcher must notice. With
    ``stamp_dir``, first write ``time.monotonic()`` (system-wide on Linux) to ``stamp_dir/rank<r>``."""
    import os
    import time

    if stamp_dir is not None:
        if rank == 0:
            # Rank 0 hosts the group's TCP store: it leaves last, or a peer still finishing
            # init_process_group loses the store and raises instead of dying.
            until = time.monotonic() + 60
            while time.monotonic() < until and not all(
                    os.path.exists(os.path.join(stamp_dir, f"rank{r}")) for r in range(1, world)):
                time.sleep(0.02)
        with open(os.path.join(stamp_dir, f"rank{rank}"), "w") as fh:
            fh.write(repr(time.monotonic()))
    os._exit(3)


def load_then_forward(rank: int, world: int, paths: list[str]) -> None:
    """from_checkpoint on every rank (rank r reads paths[r]), then one forward."""
    head = LMHead.from_checkpoint(paths[rank], mapping=Mapping(world_size=world, rank=rank, tp_size=world),
                                  dtype=torch.float32)
    head(torch.zeros(1, head.hidden_size))


def load_replicated_next_to_split(rank: int, world: int, path: str, module: str) -> None:
    """Rank 0 is built replicated (attention DP without LM-head TP), the others split; then one call."""
    from trtvocab import VocabParallelEmbedding

    mapping = Mapping(world_size=world, rank=rank, tp_size=world, enable_attention_dp=rank == 0)
    if module == "head":
        head = LMHead.from_checkpoint(path, mapping=mapping, dtype=torch.float32)
        head(torch.zeros(1, head.hidden_size))
    else:
        emb = VocabParallelEmbedding.from_checkpoint(path, mapping=mapping, dtype=torch.float32,
                                                     tensor_name="lm_head.weight")
        emb(torch.zeros(1, dtype=torch.int64))


def what_a_rank_sees(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    """This rank's view of the caller's state: the named environment variables, its current
    directory."""
    import os

    return {"env": {n: os.environ.get(n) for n in names}, "cwd": os.getcwd()}
