"""Per-rank bodies of the embedding tests (spawned processes import this module by name)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from tests.parallel.rank_fns import catch, subgroups
from trtvocab import LMHead, Mapping, QuantAlgo, QuantConfig
from trtvocab.embedding import VocabParallelEmbedding, resident_bytes, tie_weights
from trtvocab.parallel import distributed as D
from trtvocab.quant import fp8

HIDDEN = 24
PRIME_V = 1009
# (tp, layout): uneven at 2, 3, 5; padded at 4 (pad_to 16: 1009 -> 1024, rank 3 ends in padding)
SPLITS = [(2, "uneven"), (3, "uneven"), (5, "uneven"), (4, "padded")]


def table(vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(vocab, HIDDEN, generator=torch.Generator().manual_seed(seed))


def sample_ids(vocab: int, seed: int) -> torch.Tensor:
    """Random ids plus every kind of outsider: -1, -7, V, V + 5, and the edges 0 and V - 1."""
    gen = torch.Generator().manual_seed(seed)
    rand = torch.randint(0, vocab, (5, 7), generator=gen)
    rand[0, :6] = torch.tensor([-1, vocab, vocab + 5, 0, vocab - 1, -7])
    return rand


def reference(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``F.embedding`` of the full table, zero rows where the id is outside [0, V)."""
    inside = (ids >= 0) & (ids < w.shape[0])
    out = F.embedding(torch.where(inside, ids, torch.zeros_like(ids)), w)
    return out.masked_fill(~inside[..., None], 0)


@contextlib.contextmanager
def recording_reduces() -> Iterator[list[torch.dtype]]:
    """The dtypes of every all-reduce issued through trtvocab.parallel.distributed while the block runs."""
    real = D.all_reduce
    seen: list[torch.dtype] = []

    def record(tensor: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
        seen.append(tensor.dtype)
        return real(tensor, op, group)

    D.all_reduce = record
    try:
        yield seen
    finally:
        D.all_reduce = real


def parity_cases(rank: int, world: int, seed: int) -> list[dict[str, Any]]:
    """Every (tp, layout) of SPLITS on ranks [0, tp): dense bf16 / fp32 and FP8 per-tensor / per-row."""
    groups = subgroups(world)
    out: list[dict[str, Any]] = []
    for vocab in (PRIME_V, 49152):
        w32 = table(vocab, seed + vocab)
        ids = sample_ids(vocab, seed)
        q_t, s_t = fp8.quantize_fp8(w32)
        q_r, s_r = fp8.quantize_fp8(w32, per_row=True)
        variants = [
            ("bf16", torch.bfloat16, None, {"weight": w32.bfloat16()}, reference(w32.bfloat16(), ids)),
            ("fp32", torch.float32, None, {"weight": w32}, reference(w32, ids)),
            ("fp8", torch.bfloat16, QuantConfig(quant_algo=QuantAlgo.FP8, activation="none"),
             {"weight": q_t, "weight_scale": s_t}, reference(fp8.dequantize_fp8(q_t, s_t), ids).bfloat16()),
            ("fp8-row", torch.bfloat16,
             QuantConfig(quant_algo=QuantAlgo.FP8, activation="none", granularity="per_row"),
             {"weight": q_r, "weight_scale": s_r.reshape(-1)},
             reference(fp8.dequantize_fp8(q_r, s_r), ids).bfloat16()),
        ]
        for tp, layout in SPLITS:
            if vocab == 49152 and tp not in (3, 4):  # the big vocab: one uneven and the padded case
                continue
            if rank >= tp:
                continue
            mapping = Mapping(world_size=tp, rank=rank, tp_size=tp)
            for name, dtype, qc, tensors, want in variants:
                emb = VocabParallelEmbedding(vocab, HIDDEN, dtype=dtype, mapping=mapping, vocab_layout=layout,
                                             pad_to=16, process_group=groups[tp], quant_config=qc)
                emb.load_weights(tensors)
                with recording_reduces() as crossed:
                    got = emb(ids)
                out.append({"case": f"tp={tp} {layout} V={vocab} {name}", "bitwise": bool(torch.equal(got, want)),
                            "shape": list(got.shape), "crossed": [str(d) for d in crossed],
                            "bytes_per_element": emb.weights.weight.element_size()})
    return out


def tied_cases(rank: int, world: int, seed: int) -> dict[str, Any]:
    """tp = world, uneven: one buffer for both ends; logits and rows right. Hugging Face's
    direction: the embedding holds the loaded table, the head is fresh and takes it."""
    vocab = PRIME_V
    w = table(vocab, seed).bfloat16()
    mapping = Mapping(world_size=world, rank=rank, tp_size=world)
    emb = VocabParallelEmbedding(vocab, HIDDEN, dtype=torch.bfloat16, mapping=mapping)
    emb.load_weights({"weight": w})
    head = LMHead(vocab, HIDDEN, dtype=torch.bfloat16, mapping=mapping)
    before = resident_bytes(emb, head)
    tie_weights(emb, head)
    ids = sample_ids(vocab, seed)
    rows = emb(ids)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    logits = head(x)
    want_logits = (x.float() @ w.float().t())
    return {
        "same_storage": emb.weights.weight.data_ptr() == head.weights.weight.data_ptr(),
        "pair_bytes": resident_bytes(emb, head), "head_bytes": head.resident_bytes(), "before": before,
        "rows_ok": bool(torch.equal(rows, reference(w, ids))),
        "logits_err": float((logits.float() - want_logits).abs().max()),
        "argmax_ok": bool(torch.equal(logits.argmax(-1), want_logits.argmax(-1))),
    }


def bad_input_cases(rank: int, world: int) -> dict[str, tuple[str, str]]:
    """One rank (1) goes wrong in each way; every rank reports what it raised."""
    vocab = 101
    w = table(vocab, 3)
    mapping = Mapping(world_size=world, rank=rank, tp_size=world)

    def make(**kw: Any) -> VocabParallelEmbedding:
        emb = VocabParallelEmbedding(kw.pop("vocab", vocab), HIDDEN, dtype=torch.float32, mapping=mapping, **kw)
        emb.load_weights({"weight": table(emb.vocab_size, 3)})
        return emb

    good = make()
    ids = torch.tensor([1, 50, 100, -1])
    bad_one = rank == 1
    out: dict[str, tuple[str, str]] = {}
    out["float ids"] = catch(lambda: good(ids.float() if bad_one else ids))
    out["bool ids"] = catch(lambda: good(ids.bool() if bad_one else ids))
    out["ids on another device"] = catch(lambda: good(ids.to("meta") if bad_one else ids))
    out["not a tensor"] = catch(lambda: good([1, 2, 3, 4] if bad_one else ids))  # type: ignore[arg-type]
    out["different id count"] = catch(lambda: good(ids[:3] if bad_one else ids))
    # the same count, different ids (rank 0 [1, 40], rank 1 [1, 41], the rest [1, 40])
    out["different ids"] = catch(lambda: good(torch.tensor([1, 41] if bad_one else [1, 40])))
    out["different ids, same bag"] = catch(lambda: good(torch.tensor([40, 1] if bad_one else [1, 40])))
    out["different vocab"] = catch(lambda: make(vocab=vocab + 1 if bad_one else vocab)(ids))
    out["different layout"] = catch(lambda: make(vocab_layout="padded" if bad_one else "uneven")(ids))
    out["different reduce_output"] = catch(lambda: make(reduce_output=not bad_one)(ids))
    out["wrong table shape"] = catch(lambda: VocabParallelEmbedding(
        vocab, HIDDEN, mapping=mapping).load_weights({"weight": w[:, :-1] if bad_one else w}))
    out["healthy after"] = catch(lambda: good(ids))
    return out


def attention_dp_cases(rank: int, world: int, seed: int) -> dict[str, Any]:
    """Each rank looks up its own ids (rank 1: none): split with LM-head TP, replicated without."""
    vocab = PRIME_V
    w = table(vocab, seed)
    counts = [3, 0, 5, 2, 4][:world]
    mine = torch.randint(-2, vocab + 3, (counts[rank],), generator=torch.Generator().manual_seed(seed + rank))
    out: dict[str, Any] = {}
    for lm_head_tp in (False, True):
        mapping = Mapping(world_size=world, rank=rank, tp_size=world, enable_attention_dp=True,
                          enable_lm_head_tp_in_adp=lm_head_tp)
        emb = VocabParallelEmbedding(vocab, HIDDEN, dtype=torch.float32, mapping=mapping)
        emb.load_weights({"weight": w})
        got = emb(mine)
        out[f"lm_head_tp={lm_head_tp}"] = {"split": emb.is_split, "ok": bool(torch.equal(got, reference(w, mine)))}
    return out


def different_ids_cases(rank: int, world: int) -> dict[str, Any]:
    """Rank r looks up [1, 40 + r]: every rank must raise (not return another rank's row W[40 + r])."""
    vocab = 101
    w = table(vocab, 3)
    out: dict[str, Any] = {}
    for adp in (False, True):
        mapping = Mapping(world_size=world, rank=rank, tp_size=world, enable_attention_dp=adp,
                          enable_lm_head_tp_in_adp=adp)
        emb = VocabParallelEmbedding(vocab, HIDDEN, dtype=torch.float32, mapping=mapping)
        emb.load_weights({"weight": w})
        mine = torch.tensor([1, 40 + rank])
        result = catch(lambda emb=emb, mine=mine: emb(mine))
        ok = result == ("ok", "") and bool(torch.equal(emb(mine), reference(w, mine)))
        out[f"adp={adp}"] = {"result": result, "rows_ok": ok}
    return out


def healthy_cases(rank: int, world: int, seed: int) -> dict[str, Any]:
    """One launch for every case that raises nothing: parity (tp 2..world), tying and attention DP at tp = world."""
    return {"parity": parity_cases(rank, world, seed), "tied": tied_cases(rank, world, seed + 3),
            "attention_dp": attention_dp_cases(rank, world, seed + 5)}


def refusal_cases(rank: int, world: int) -> dict[str, Any]:
    """One launch for the bad inputs: each case is caught on every rank and the group stays usable."""
    return {"bad_input": bad_input_cases(rank, world), "different_ids": different_ids_cases(rank, world)}
