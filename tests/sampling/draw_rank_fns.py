"""Per-rank bodies of the seeded-sampling and bitmask tests (spawned processes import this module)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.parallel.rank_fns import catch
from trtvocab import LMHead, Mapping
from trtvocab.errors import TrtVocabError
from trtvocab.parallel import distributed as D
from trtvocab.sampling import SamplingParams, apply_token_bitmask, sample

VOCAB = 1009
ROWS = 8
SPLITS = [(1, "uneven"), (2, "uneven"), (3, "uneven"), (5, "uneven"), (4, "padded")]


def gathered_logits(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def row_params() -> list[SamplingParams]:
    """One row per filter combination; every row seeded (rows 6 and 7 share a seed on purpose)."""
    return [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_k=50, seed=2),
        SamplingParams(temperature=1.3, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0, min_p=0.05, seed=4),
        SamplingParams(temperature=0.9, top_k=200, top_p=0.8, min_p=0.02, seed=5),
        SamplingParams(temperature=0.0, seed=6),  # greedy
        SamplingParams(temperature=2.0, top_k=1, seed=7),  # top-1: greedy too
        SamplingParams(temperature=2.0, seed=7),
    ]


def random_bitmask(seed: int, words: int) -> torch.Tensor:
    """An xgrammar-layout mask allowing about a third of the ids (row 0: only ids 3 and 1000)."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.rand(ROWS, words * 32, generator=gen) < 0.33
    bits[0] = False
    bits[0, 3] = True
    if words * 32 > 1000:
        bits[0, 1000] = True
    packed = (bits.view(ROWS, words, 32).to(torch.int64) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _local(g: torch.Tensor, head: LMHead) -> torch.Tensor:
    s = head.shard
    out = torch.full((g.shape[0], s.width), float("-inf"))
    out[:, : s.size] = g[:, s.start : s.end]
    return out


def draw_cases(rank: int, world: int, seed: int) -> list[dict[str, Any]]:
    """For every (tp, layout) of SPLITS on ranks [0, tp): seeded ids, masked ids, the masked logits."""
    groups = {tp: (dist.new_group(list(range(tp))) if 1 < tp < world else None) for tp in range(2, world + 1)}
    g = gathered_logits(seed)
    out: list[dict[str, Any]] = []
    for tp, layout in SPLITS:
        if rank >= tp:
            continue
        mapping = Mapping(world_size=tp, rank=rank, tp_size=tp) if tp > 1 else None
        head = LMHead(VOCAB, 4, dtype=torch.float32, mapping=mapping, vocab_layout=layout, pad_to=16,
                      process_group=groups.get(tp))
        local = _local(g, head)
        ids = sample(local, head, row_params(), step=3)
        ids_next_step = sample(local, head, row_params(), step=4)
        limited = sample(local, head, row_params(), step=3, vocab_limit=500)
        masked: dict[int, Any] = {}
        for words in ((VOCAB + 31) // 32, 20):  # the full vocab, and a mask narrower than V (640 ids)
            bitmask = random_bitmask(seed + words, words)
            mine = apply_token_bitmask(local.clone(), bitmask, head)
            full = D.all_gather_columns(mine[:, : head.shard.size].contiguous(), [s.size for s in head.shards],
                                        head.process_group) if head.is_split else mine[:, : head.shard.size]
            masked[words] = {"logits": full.numpy(), "ids": sample(mine, head, row_params(), step=3).tolist(),
                             "greedy_ok": _catch_greedy(mine, head),
                             "padding_ok": bool(torch.isneginf(mine[:, head.shard.size :]).all())}
        out.append({"case": f"tp={tp} {layout}", "ids": ids.tolist(), "ids_next_step": ids_next_step.tolist(),
                    "limited": limited.tolist(), "masked": masked})
    return out


def _catch_greedy(local: torch.Tensor, head: LMHead) -> list[int] | str:
    from trtvocab.sampling import greedy

    try:
        return greedy(local, head).tolist()
    except TrtVocabError as exc:
        return f"{type(exc).__name__}: {exc}"


def bad_sample_cases(rank: int, world: int) -> dict[str, tuple[str, str]]:
    """Rank 1 passes a bad argument; every rank reports what it raised."""
    head = LMHead(VOCAB, 4, dtype=torch.float32, mapping=Mapping(world_size=world, rank=rank, tp_size=world))
    local = _local(gathered_logits(0), head)
    good = row_params()
    bad = rank == 1
    out: dict[str, tuple[str, str]] = {}

    out["params count"] = catch(lambda: sample(local, head, good[:3] if bad else good))
    out["params type"] = catch(lambda: sample(local, head, {"temperature": 1.0} if bad else good))  # type: ignore
    out["step"] = catch(lambda: sample(local, head, good, step=-1 if bad else 0))
    out["vocab_limit"] = catch(lambda: sample(local, head, good, vocab_limit=0 if bad else None))
    out["different params"] = catch(lambda: sample(local, head, [SamplingParams(seed=9)] * ROWS if bad else good))
    out["bitmask dtype"] = catch(lambda: apply_token_bitmask(
        local.clone(), random_bitmask(0, 32).to(torch.int64 if bad else torch.int32), head))
    out["bitmask rows"] = catch(lambda: apply_token_bitmask(local.clone(), random_bitmask(0, 32)[: 3 if bad else ROWS],
                                                            head))
    nothing = torch.zeros(ROWS, 32, dtype=torch.int32)
    out["nothing allowed"] = catch(lambda: sample(apply_token_bitmask(local.clone(), nothing, head), head, good))
    out["healthy after"] = catch(lambda: sample(local, head, good))
    return out


def deterministic_cases(rank: int, world: int, seed: int) -> list[dict[str, Any]]:
    """A deterministic head at every (tp, layout) of SPLITS: the gathered logits of a batch and of
    rows alone or in other batches, logsumexp, log-softmax and seeded samples (numpy, rank 0's)."""
    from trtvocab.sampling import log_softmax, logprobs, logsumexp

    groups = {tp: (dist.new_group(list(range(tp))) if 1 < tp < world else None) for tp in range(2, world + 1)}
    gen = torch.Generator().manual_seed(seed)
    hidden = 64
    w = torch.randn(VOCAB, hidden, generator=gen) * 0.3
    x = torch.randn(9, hidden, generator=gen)
    out: list[dict[str, Any]] = []
    for dtype, output_dtype in ((torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.float32)):
        for tp, layout in SPLITS:
            if rank >= tp:
                continue
            mapping = Mapping(world_size=tp, rank=rank, tp_size=tp) if tp > 1 else None
            head = LMHead(VOCAB, hidden, dtype=dtype, mapping=mapping, vocab_layout=layout, pad_to=16,
                          process_group=groups.get(tp), deterministic=True, output_dtype=output_dtype)
            head.load_weights({"weight": w.to(dtype)})
            xd = x.to(dtype)
            batch = head(xd)
            alone = [head(xd[i : i + 1]) for i in range(3)]
            mixed = head(xd[[4, 0, 8]])  # row 0 in another batch, another position
            local = head.local_logits(xd).float()
            lse = logsumexp(local, head)
            lsm = log_softmax(local, head)
            lsm_full = D.all_gather_columns(lsm.contiguous(), [s.size for s in head.shards], head.process_group) \
                if head.is_split else lsm
            picks = logprobs(local, head, torch.tensor([[0, 500, VOCAB - 1]] * 9))
            ids = sample(local[:ROWS], head, row_params(), step=1)
            out.append({
                "case": f"{dtype} out={output_dtype} tp={tp} {layout}", "dtype": str(batch.dtype),
                "batch": batch.float().numpy(),
                "alone_ok": all(torch.equal(a[0], batch[i]) for i, a in enumerate(alone)),
                "mixed_ok": bool(torch.equal(mixed[1], batch[0])) and bool(torch.equal(mixed[0], batch[4])),
                "lse": lse.numpy(), "picks": picks.numpy(), "lsm_sum": torch.exp(lsm_full.double()).sum(1).numpy(),
                "ids": ids.tolist(),
            })
    return out


# Temperatures from the smallest positive float32 (and below it) up to just under GREEDY_BELOW,
# and the filters a row may carry with them (min-p a subnormal too): every one draws the argmax.
TINY_TEMPERATURES = [1e-46, 1e-45, 3e-45, 1e-44, 1e-42, 1e-40, 1e-39, 1.1754942e-38, 1e-38, 2e-38, 1e-37, 1e-36,
                     1e-35, 1e-33, 1e-30, 1e-25, 1e-20, 1e-15, 1e-10, 1e-8, 1e-6, 9.99e-6]
TINY_FILTERS: list[dict[str, Any]] = [{}, {"top_p": 0.9}, {"top_k": 5}, {"min_p": 1e-40}, {"min_p": 0.1},
                                      {"top_k": 50, "top_p": 0.5, "min_p": 1e-44}]


def tiny_temperature_cases(rank: int, world: int, seed: int) -> dict[str, Any]:
    """``sample`` (materialized) and ``chunked.stream_sample`` at every tiny temperature, against greedy."""
    from trtvocab.sampling import chunked, greedy

    gen = torch.Generator().manual_seed(seed)
    hidden_size = 16
    mapping = Mapping(world_size=world, rank=rank, tp_size=world) if world > 1 else None
    head = LMHead(VOCAB, hidden_size, dtype=torch.float32, mapping=mapping, gather_output=False)
    head.load_weights({"weight": torch.randn(VOCAB, hidden_size, generator=gen)})
    x = torch.randn(ROWS, hidden_size, generator=gen) * 3  # logits of |x| ~ 10: x / 1e-38 overflows
    local = head.local_logits(x)
    want = greedy(local, head).tolist()
    wrong = []
    for t in TINY_TEMPERATURES:
        for extra in TINY_FILTERS:
            params = [SamplingParams(temperature=t, seed=r, **extra) for r in range(ROWS)]
            got = {"materialized": sample(local.clone(), head, params, step=3).tolist(),
                   "chunked": chunked.stream_sample(x, head, params, step=3, chunk=97).tolist()}
            wrong += [f"T={t:g} {extra} {path}: {ids}" for path, ids in got.items() if ids != want]
    return {"greedy": want, "wrong": wrong}


def seed_mismatch_cases(rank: int, world: int) -> dict[str, tuple[str, str]]:
    """Rank 1's seed (or step) differs from rank 0's by one, at 2**60 where float64 cannot tell
    them apart: every rank must raise RankMismatchError (materialized, decode and chunked)."""
    from trtvocab.sampling import chunked, decode

    gen = torch.Generator().manual_seed(0)
    head = LMHead(VOCAB, 4, dtype=torch.float32, mapping=Mapping(world_size=world, rank=rank, tp_size=world))
    head.load_weights({"weight": torch.randn(VOCAB, 4, generator=gen)})
    x = torch.randn(ROWS, 4, generator=gen)
    local = head.local_logits(x)
    seed = 2**60 + (1 if rank == 1 else 0)
    params = [SamplingParams(temperature=1.0, seed=seed)] * ROWS
    same = [SamplingParams(temperature=1.0, seed=2**60)] * ROWS
    out: dict[str, tuple[str, str]] = {}
    out["sample seed"] = catch(lambda: sample(local, head, params))
    out["decode seed"] = catch(lambda: decode(x, head, params))
    out["chunked seed"] = catch(lambda: chunked.stream_sample(x, head, params, chunk=101))
    out["sample step"] = catch(lambda: sample(local, head, same, step=seed))
    out["chunked step"] = catch(lambda: chunked.stream_sample(x, head, same, step=seed, chunk=101))
    out["healthy after"] = catch(lambda: sample(local, head, same, step=2**60))
    return out


def group_cases(rank: int, world: int) -> dict[str, Any]:
    """One launch for the tp > 1 cases besides ``draw_cases``: tiny temperatures, seeds float64 cannot
    tell apart, bad arguments (each caught on every rank, so one group serves them all)."""
    return {"tiny": tiny_temperature_cases(rank, world, 12), "seeds": seed_mismatch_cases(rank, world),
            "bad": bad_sample_cases(rank, world)}
