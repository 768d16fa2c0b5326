"""Per-rank bodies of tests/sampling/test_chunked_head.py (spawned ranks import this module by name)."""

from __future__ import annotations

from typing import Any

import torch

from tests.parallel.rank_fns import catch, subgroups
from trtvocab import LMHead, Mapping, QuantAlgo, QuantConfig, sampling
from trtvocab.sampling import SamplingParams, chunked
from trtvocab.weights import quantized

VOCAB = 3001  # prime: no tp divides it
HIDDEN = 512
ROWS = 6
TOPK = 10
QUANT_ROWS_PER_CHUNK = 100  # the quantized heads' GEMM rows (CHUNK_ELEMENTS patched), so shards span tiles
FORMATS = ("bf16", "fp32", "bf16->fp32", "bf16 deterministic", "FP8 W8A8-dyn", "NVFP4 W4A4", "NVFP4 W4A16")
SPLITS = ((1, "uneven"), (3, "uneven"), (3, "padded"))


def row_params() -> list[SamplingParams]:
    """Temperature, top-k and min-p (streamed and on candidates), greedy, seeded."""
    return [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_k=50, seed=2),
        SamplingParams(temperature=1.0, min_p=0.05, seed=4),
        SamplingParams(temperature=0.9, top_k=200, min_p=0.02, seed=5),
        SamplingParams(temperature=0.0, seed=6),  # greedy
        SamplingParams(temperature=2.0, top_k=1, seed=7),
    ]


def top_p_params() -> list[SamplingParams]:
    """Top-p rows: alone, after top-k, with min-p, two long nuclei (T = 5 and 8: past the first
    candidates where the budget is small, so they are streamed again) and a greedy row (top-p ignored)."""
    return [
        SamplingParams(temperature=1.0, top_p=0.9, seed=8),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.5, seed=9),
        SamplingParams(temperature=1.0, top_p=0.95, min_p=0.05, seed=10),
        SamplingParams(temperature=5.0, top_p=0.99, seed=11),
        SamplingParams(temperature=0.0, top_p=0.5, seed=12),
        SamplingParams(temperature=8.0, top_p=0.995, seed=13),  # a second long nucleus
    ]


def quant_tensors(algo: QuantAlgo, vocab: int, hidden: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Valid checkpoint tensors (as benchmarks/quantized_head.py's random_tensors): no NaN codes."""
    if algo is QuantAlgo.FP8:
        codes = torch.randint(0, 256, (vocab, hidden), dtype=torch.uint8, generator=gen)
        codes[(codes & 0x7F) == 0x7F] = 0
        return {"weight": codes.view(torch.float8_e4m3fn), "weight_scale": torch.tensor(2e-4)}
    packed = torch.randint(0, 256, (vocab, hidden // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0x30, 0x60, (vocab, hidden // 16), dtype=torch.uint8, generator=gen)
    return {"weight": packed, "weight_scale": scales.view(torch.float8_e4m3fn), "weight_scale_2": torch.tensor(3e-5)}


def make_head(fmt: str, mapping: Mapping | None, layout: str, group: Any, seed: int = 0,
              vocab: int = VOCAB, **kw: Any) -> LMHead:
    gen = torch.Generator().manual_seed(seed)
    common = dict(mapping=mapping, vocab_layout=layout, pad_to=16, process_group=group, gather_output=False, **kw)
    if fmt.startswith(("FP8", "NVFP4")):
        algo = QuantAlgo.FP8 if fmt.startswith("FP8") else QuantAlgo.NVFP4
        activation = {"FP8 W8A8-dyn": "dynamic", "FP8 W8A16": "none", "NVFP4 W4A4": "static",
                      "NVFP4 W4A16": "none"}[fmt]
        head = LMHead(vocab, HIDDEN, dtype=torch.bfloat16, quant_config=QuantConfig(quant_algo=algo,
                                                                                     activation=activation), **common)
        tensors = quant_tensors(algo, vocab, HIDDEN, gen)
        if activation == "static":
            tensors["input_scale"] = torch.tensor(4.0 / (6 * 448))
        head.load_weights(tensors)
        return head
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    head = LMHead(vocab, HIDDEN, dtype=dtype, output_dtype=torch.float32 if fmt == "bf16->fp32" else None,
                  deterministic="deterministic" in fmt, **common)
    head.load_weights({"weight": (torch.randn(vocab, HIDDEN, generator=gen) / HIDDEN**0.5).to(dtype)})
    return head


def equality_cases(rank: int, world: int, seed: int) -> list[dict[str, Any]]:
    """For every format and (tp, layout) this launch can run: chunked vs materialized, per chunk size."""
    quantized.CHUNK_ELEMENTS = HIDDEN * QUANT_ROWS_PER_CHUNK
    groups = subgroups(world) if world > 1 else {}
    splits = [(tp, layout) for tp, layout in SPLITS if tp == world]
    x32 = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 2
    token_ids = torch.tensor([[0, 1, VOCAB - 1], [999, 1000, 2001], [7, 2000, 3000]] * 2)
    out: list[dict[str, Any]] = []
    for fmt in FORMATS:
        for tp, layout in splits:
            mapping = Mapping(world_size=tp, rank=rank, tp_size=tp) if tp > 1 else None
            head = make_head(fmt, mapping, layout, groups.get(tp))
            x = x32.to(head.dtype)
            local = head.local_logits(x)
            want_greedy = sampling.greedy(local, head)
            want_v, want_i = sampling.topk(local, head, TOPK)
            want_lse = sampling.logsumexp(local, head)
            want_lp = sampling.logprobs(local, head, token_ids)
            want_ids = sampling.sample(local, head, row_params(), step=3)
            want_limited = sampling.sample(local, head, row_params(), step=3, vocab_limit=2000)
            want_top_p = sampling.sample(local, head, top_p_params(), step=3)
            size = head.shard.size
            for chunk in (1, 7, max(1, size), 10**9):
                rec: dict[str, Any] = {"case": f"{fmt} tp={tp} {layout} chunk={chunk}", "fmt": fmt,
                                       "deterministic": head.deterministic}
                rec["greedy"] = bool(torch.equal(chunked.stream_greedy(x, head, chunk=chunk), want_greedy))
                v, i = chunked.stream_topk(x, head, TOPK, chunk=chunk)
                rec["topk"] = bool(torch.equal(v, want_v) and torch.equal(i, want_i) and v.dtype == want_v.dtype)
                lse = chunked.stream_logsumexp(x, head, chunk=chunk)
                lp = chunked.stream_logprobs(x, head, token_ids, chunk=chunk)
                rec["lse_materialized"] = bool(torch.equal(lse, want_lse))
                rec["logprobs_materialized"] = bool(torch.equal(lp, want_lp))
                rec["lse_err"] = float((lse - want_lse).abs().max())
                rec["logprobs_err"] = float((lp - want_lp).abs().max())
                drawn = chunked.stream_sample(x, head, row_params(), step=3, chunk=chunk)
                rec["sample"] = drawn.tolist() == want_ids.tolist()
                top_p = chunked.stream_sample(x, head, top_p_params(), step=3, chunk=chunk)
                rec["sample_top_p"] = top_p.tolist() == want_top_p.tolist()
                if chunk == 7:  # the variant once per head (chunk 1 and 7 stream the same tiles)
                    limited = chunked.stream_sample(x, head, row_params(), step=3, vocab_limit=2000, chunk=chunk)
                    rec["sample_limited"] = limited.tolist() == want_limited.tolist()
                rec["ids"] = want_ids.tolist()
                out.append(rec)
    return out


def bitmask_of(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """An xgrammar-layout ``int32 [rows, ceil(V / 32)]`` mask allowing about 3 tokens in 4."""
    words = (vocab + 31) // 32
    bits = torch.rand(rows, words, 32, generator=torch.Generator().manual_seed(seed)) < 0.75
    packed = (bits.to(torch.int64) << torch.arange(32, dtype=torch.int64)).sum(-1)
    return ((packed + 2**31) % 2**32 - 2**31).to(torch.int32)  # the same 32 bits, as int32


def decode_cases(rank: int, world: int, seed: int) -> list[dict[str, Any]]:
    """``sampling.decode`` on a head whose budget the batch exceeds (it streams) vs the same head
    with the default budget (it materializes): the same ids, steps 0..2 (the second and third are
    steady: the cached handshake), greedy, seeded, top-p, a vocab_limit and a bitmask; and
    ``column_logits`` of the whole shard against ``local_logits``."""
    quantized.CHUNK_ELEMENTS = HIDDEN * QUANT_ROWS_PER_CHUNK
    groups = subgroups(world) if world > 1 else {}
    splits = [(tp, layout) for tp, layout in SPLITS if tp == world]
    x32 = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(seed + 1)) * 2
    bitmask = bitmask_of(ROWS, VOCAB, seed)
    out: list[dict[str, Any]] = []
    greedy = [SamplingParams(temperature=0.0)] * ROWS
    for fmt in FORMATS:
        for tp, layout in splits:
            mapping = Mapping(world_size=tp, rank=rank, tp_size=tp) if tp > 1 else None
            whole = make_head(fmt, mapping, layout, groups.get(tp))
            small = make_head(fmt, mapping, layout, groups.get(tp), logits_budget_bytes=ROWS * 4 * 300)
            x = x32.to(whole.dtype)
            owned = whole.local_logits(x)[:, : whole.shard.size]
            rec: dict[str, Any] = {"case": f"{fmt} tp={tp} {layout}",
                                   "column_logits": bool(torch.equal(whole.column_logits(x), owned)),
                                   "streams": [sampling.streams(whole, ROWS), sampling.streams(small, ROWS)]}
            got, want = [], []
            for step, (params, limit, mask) in enumerate([(greedy, None, None), (row_params(), 2000, bitmask),
                                                          (top_p_params(), None, bitmask)]):
                want.append(sampling.decode(x, whole, params, step=step, vocab_limit=limit, bitmask=mask).tolist())
                got.append(sampling.decode(x, small, params, step=step, vocab_limit=limit, bitmask=mask).tolist())
            for step in (3, 4):  # steady: the same signature as the step before
                want.append(sampling.decode(x, whole, top_p_params(), step=step, bitmask=bitmask).tolist())
                got.append(sampling.decode(x, small, top_p_params(), step=step, bitmask=bitmask).tolist())
            rec["equal"] = got == want
            rec["ids"] = want
            out.append(rec)
    return out


def bad_input_cases(rank: int, world: int) -> dict[str, tuple[str, str]]:
    """One rank passes bad input; every rank reports what it raised (then a good call works)."""
    head = make_head("fp32", Mapping(world_size=world, rank=rank, tp_size=world), "uneven", None, vocab=1009)
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1))
    nan = x.clone()
    nan[2, 5] = float("nan")
    out: dict[str, tuple[str, str]] = {}

    out["nan hidden"] = catch(lambda: chunked.stream_greedy(nan if rank == 1 else x, head))
    out["wrong shape"] = catch(lambda: chunked.stream_topk(x[:, :-1] if rank == 2 else x, head, 5))
    out["wrong rows"] = catch(lambda: chunked.stream_logsumexp(x[:3] if rank == 0 else x, head))
    out["bad k"] = catch(lambda: chunked.stream_topk(x, head, 0 if rank == 1 else 5))
    out["bad chunk"] = catch(lambda: chunked.stream_greedy(x, head, chunk=0 if rank == 2 else None))
    out["bad token ids"] = catch(
        lambda: chunked.stream_logprobs(x, head, torch.tensor([0, 1, 2, 3, 4, 1009 if rank else 5])))
    out["top_p"] = catch(lambda: chunked.stream_sample(x, head, SamplingParams(top_p=0.9, seed=1)))  # supported
    out["different params"] = catch(lambda: chunked.stream_sample(x, head, SamplingParams(seed=rank)))
    out["healthy after"] = catch(lambda: chunked.stream_sample(x, head, SamplingParams(seed=1, top_k=5)))
    # sampling.decode streaming (6 rows exceed the budget, 1 row does not), after steady steps
    small = make_head("fp32", Mapping(world_size=world, rank=rank, tp_size=world), "uneven", None, vocab=1009,
                      logits_budget_bytes=2048)
    params = SamplingParams(temperature=0.7, seed=2)
    out["decode steady"] = catch(lambda: [sampling.decode(x, small, params, step=s).tolist() for s in range(3)])
    out["decode nan hidden"] = catch(lambda: sampling.decode(nan if rank == 1 else x, small, params, step=3))
    out["decode wrong rows"] = catch(lambda: sampling.decode(x[:3] if rank == 0 else x, small, params, step=4))
    out["decode materialized rank"] = catch(lambda: sampling.decode(x[:1] if rank == 2 else x, small, params))
    out["decode healthy after"] = catch(lambda: sampling.decode(x, small, params, step=5).tolist())
    return out


def long_nucleus_cases(rank: int, world: int, budget: int = 64 * 1024, tp: int | None = None) -> dict[str, Any] | None:
    """A head whose budget holds fewer top-p candidates than a flat row's nucleus: those rows are
    streamed again and drawn by the materialized sampler; the ids still equal the materialized path's.

    At ``tp`` < ``world`` the head is split over ranks ``[0, tp)`` (every rank creates the groups;
    the others sit the case out and return None)."""
    groups = subgroups(world) if world > 1 else {}
    tp = world if tp is None else tp
    if rank >= tp:
        return None
    world = tp
    out: dict[str, Any] = {}
    taken: list[int] = []
    original = chunked._long_nuclei

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        taken.append(len(args[2]))
        return original(*args, **kwargs)

    chunked._long_nuclei = counting
    try:
        for fmt, layout in (("bf16", "uneven"), ("FP8 W8A8-dyn", "padded"), ("fp32", "uneven")):
            mapping = Mapping(world_size=world, rank=rank, tp_size=world) if world > 1 else None
            head = make_head(fmt, mapping, layout, groups.get(world), logits_budget_bytes=budget)
            x = (torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(3)) * 2).to(head.dtype)
            params = top_p_params()
            want = sampling.sample(head.local_logits(x), head, params, step=5)
            before = len(taken)
            got = chunked.stream_sample(x, head, params, step=5)
            out[fmt] = {"equal": got.tolist() == want.tolist(), "long rows": sum(taken[before:]),
                        "ids": got.tolist()}
    finally:
        chunked._long_nuclei = original
    return out


def all_cases(rank: int, world: int, seed: int, nucleus_splits: list[tuple[int, int]]) -> dict[str, Any]:
    """Every multi-rank case of tests/sampling/test_chunked_head.py in one launch of ``world`` ranks (none of
    them kills a rank; the bad-input cases last, as they end with a healthy call):
    ``{"equality": ..., "long nucleus": {(tp, budget): ...}, "bad input": ...}``."""
    return {"equality": equality_cases(rank, world, seed), "decode": decode_cases(rank, world, seed),
            "long nucleus": {(tp, budget): long_nucleus_cases(rank, world, budget, tp=tp)
                             for tp, budget in nucleus_splits},
            "bad input": bad_input_cases(rank, world)}
