"""Per-rank bodies of tests/sampling/test_lora_added_vocab.py (spawned processes import this module by name).

One call loads a base checkpoint's embedding and head at one tp size and layout, attaches the adapters
(one adds tokens, one does not), and returns what each end computes for one batch of per-row adapters.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch

from trtvocab import LMHead, Mapping, VocabParallelEmbedding
from trtvocab.sampling import SamplingParams, decode


def added_case(rank: int, world: int, case: dict[str, Any], layout: str) -> dict[str, Any]:
    """``case``: ``base``, ``adapters`` (folders), ``ids [B, T]``, ``adapter_ids [B]``, ``hidden [B * T, H]``,
    ``probe_ids [1, n]`` (looked up without an adapter and with each adapter)."""
    mapping = Mapping(world_size=world, rank=rank, tp_size=world) if world > 1 else None
    kw: dict[str, Any] = {"mapping": mapping, "dtype": torch.float32, "vocab_layout": layout, "pad_to": 4}
    emb = VocabParallelEmbedding.from_checkpoint(case["base"], **kw)
    head = LMHead.from_checkpoint(case["base"], **kw)
    for folder in case["adapters"]:
        assert emb.load_adapter(folder, other_modules="ignore") == head.load_adapter(folder, other_modules="ignore")
    ids, per_seq = case["ids"], case["adapter_ids"]
    per_row = per_seq.repeat_interleave(ids.shape[1])
    hidden = case["hidden"]
    with head.use_adapters(per_row):
        greedy = decode(hidden, head, SamplingParams(temperature=0.0))  # gather-free
        gathered = decode(hidden, head, SamplingParams(temperature=0.0, logprobs=1))  # the token-order path
        drawn = decode(hidden, head, SamplingParams(temperature=1.5, top_p=0.95, seed=7), step=2)  # gathered
        raced = decode(hidden, head, SamplingParams(temperature=1.5, seed=7), step=2)  # gather-free
        raced_gathered = decode(hidden, head, SamplingParams(temperature=1.5, seed=7, logprobs=0), step=2)
    probe = case["probe_ids"]
    probes = [emb(probe, torch.tensor([k])) for k in range(-1, len(case["adapters"]))]
    return {"rows": emb(ids, per_seq), "logits": head(hidden, per_row), "local": head.local_logits(hidden, per_row),
            "columns": head.added_shards[head.tp_rank].columns(),
            "emb_columns": emb.added_shards[emb.tp_rank].columns(),
            "greedy": greedy, "gathered": gathered, "drawn": drawn, "raced": raced,
            "raced_gathered": raced_gathered, "probes": probes,
            "added_vocab": (emb.added_vocab, head.added_vocab),
            "adapter_bytes": head.adapter_bytes() + emb.adapter_bytes()}


def disagreeing_params(rank: int, world: int, folder: str) -> str:
    """A head with an added segment whose ranks bring different params (or rank 1 a bad vocab_limit): every
    rank raises before the gather instead of drawing different tokens."""
    head = LMHead(50, 16, dtype=torch.float32, mapping=Mapping(world_size=world, rank=rank, tp_size=world))
    head.load_weights({"weight": torch.ones(50, 16)})
    head.load_adapter(folder)
    hidden = torch.ones(2, 16)
    names = []
    for params, limit in ((SamplingParams(temperature=0.5 + rank, seed=1), None),
                          (SamplingParams(temperature=0.0), 10 if rank == 0 else 99)):
        try:
            with head.use_adapters(torch.tensor([0, -1])):
                decode(hidden, head, params, vocab_limit=limit)
            names.append("")
        except Exception as exc:
            names.append(type(exc).__name__)
    return " ".join(names)


KNOB_V, KNOB_H, KNOB_B = 50, 16, 6


def knob_params(v: int) -> list[tuple[str, Any, dict[str, Any]]]:
    """Every sampler knob, on per-row params (rows mixed), with the decode keyword arguments of the call."""
    added = [v, v + 2]
    mixed = [SamplingParams(temperature=0.9, top_k=4, seed=11), SamplingParams(temperature=0.0),
             SamplingParams(temperature=1.2, top_p=0.8, seed=12), SamplingParams(temperature=1.1, min_p=0.2, seed=13),
             SamplingParams(temperature=1.3, typical_p=0.7, seed=14), SamplingParams(temperature=0.7, seed=15)]
    bits = torch.full((KNOB_B, 2), -1, dtype=torch.int32)
    bits[:, 0] = 0x0F0F0F0F
    return [
        ("mixed filters", mixed, {}),
        ("top-k logprobs", SamplingParams(temperature=1.0, top_k=7, seed=3, logprobs=3), {}),
        ("greedy logprobs", SamplingParams(temperature=0.0, logprobs=5, logprobs_mode="processed_logprobs"), {}),
        ("raw logits mode", SamplingParams(temperature=0.8, seed=4, logprobs=2, logprobs_mode="raw_logits"), {}),
        ("penalties", SamplingParams(temperature=1.0, seed=5, repetition_penalty=1.7, frequency_penalty=0.5,
                                     presence_penalty=0.3, top_p=0.9), {"state": True}),
        ("bias and bans", SamplingParams(temperature=1.0, seed=6, logit_bias={v + 1: 3.0, 2: -5.0},
                                         bad_words=[[v + 3], [4]], min_tokens=3, stop_token_ids=[v]), {"state": True}),
        ("allowed ids", SamplingParams(temperature=2.0, seed=8, allowed_token_ids=[1, 7, *added], logprobs=2), {}),
        ("bitmask", SamplingParams(temperature=1.0, seed=9, top_k=10), {"bitmask": bits}),
        ("vocab limit", SamplingParams(temperature=1.0, seed=10, top_p=0.7, logprobs=1), {"vocab_limit": 30}),
    ]


def knobs_case(rank: int, world: int, layout: str, folder: str) -> dict[str, Any]:
    """Every knob of :func:`knob_params` on a head with an added segment: the sharded draw, the gathered
    token-order reference (``sampling.added_vocab.gathered_output``) and the streamed draw (``chunked``,
    8-column chunks), ids and logprobs, on this rank."""
    from trtvocab.sampling import TokenState, chunked
    from trtvocab.sampling.added_vocab import gathered_output, token_order_output, token_order_view
    from trtvocab.sampling.args import rows_params

    mapping = Mapping(world_size=world, rank=rank, tp_size=world) if world > 1 else None
    gen = torch.Generator().manual_seed(5)
    head = LMHead(KNOB_V, KNOB_H, dtype=torch.float32, mapping=mapping, vocab_layout=layout, pad_to=4)
    head.load_weights({"weight": torch.randn(KNOB_V, KNOB_H, generator=gen)})
    head.load_adapter(folder)
    hidden = torch.randn(KNOB_B, KNOB_H, generator=gen)
    picks = torch.tensor([0, -1, 0, 0, -1, 0])
    prompts = [[1, 2, KNOB_V + 1], [3, 3], [KNOB_V, 4], [5], [6, 7], [KNOB_V + 2]]
    out: dict[str, Any] = {}
    for name, params, kw in knob_params(KNOB_V):
        state = TokenState.for_head(token_order_view(head), prompts, eos_token_ids=[2]) if kw.get("state") else None
        if state is not None:
            state.append([KNOB_V + 1, 3, 2, KNOB_V, 9, 9])
        args = {k: v for k, v in kw.items() if k != "state"}
        per_row = rows_params(params, KNOB_B)
        with head.use_adapters(picks):
            gather, head.gather_output = head.gather_output, True
            try:  # the sharded path never gathers the logits: the head's column gather must not run
                with mock.patch("trtvocab.lm_head.D.all_gather_columns", side_effect=AssertionError("gathered")):
                    got = token_order_output(hidden, head, per_row, step=3, state=state, **args)
                    streamed = chunked.stream_output(hidden, head, per_row, step=3, state=state, chunk=8, **args)
            finally:
                head.gather_output = gather
            ref = gathered_output(hidden, head, per_row, step=3, state=state, **args)
        out[name] = (got, ref, streamed)
    return out
