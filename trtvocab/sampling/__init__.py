"""Sampling over a vocab-split head without gathering the ``[B, V]`` logits.

Every function takes one rank's logits (``head.local_logits(hidden)``, padding ``-inf``) and the
head or its placement, and returns what the same operation gives on the gathered logits; only
``O(B * k)`` numbers cross ranks, and every public call starts with one handshake.

* :mod:`~trtvocab.sampling.reductions`: greedy, top-k, logsumexp / log-softmax / logprobs,
  min-p and top-p masks;
* :mod:`~trtvocab.sampling.draw`: :func:`sample`, the seeded draw (:class:`SamplingParams`),
  one pipeline of named steps (:class:`~trtvocab.sampling.prepared.DecodeStep`'s, the column-local
  ones run chunk by chunk by the streamed path too; per-rank :class:`TokenState` for penalties), with
  noise keyed by token id (:mod:`~trtvocab.sampling.noise`); docs/sampling.md;
* :mod:`~trtvocab.sampling.bitmask`: :func:`apply_token_bitmask`, xgrammar's mask per shard;
  :mod:`~trtvocab.sampling.beam`: one beam-search step (the best ``2W`` continuations, merged);
* :mod:`~trtvocab.sampling.step`: :func:`decode`, one decode step from the hidden rows, streamed
  (:mod:`~trtvocab.sampling.chunked`) when its float32 logits exceed the head's budget
  (docs/architecture.md, "The vocab-chunked head"); a head with an added segment (adapters that add
  tokens): :mod:`~trtvocab.sampling.added_vocab` (docs/architecture.md, "Adapters that add tokens").
"""

from __future__ import annotations

from trtvocab.sampling import chunked
from trtvocab.sampling.args import Logprobs, SamplerOutput
from trtvocab.sampling.bitmask import apply_token_bitmask
from trtvocab.sampling.draw import prompt_logprobs, sample, sample_output
from trtvocab.sampling.params import SamplingParams
from trtvocab.sampling.prepared import DecodeStep
from trtvocab.sampling.reductions import (
    HANDSHAKE,
    apply_min_p,
    apply_top_p,
    greedy,
    log_softmax,
    logprobs,
    logsumexp,
    min_p_mask,
    top_p_mask,
    topk,
)
from trtvocab.sampling.state import TokenState
from trtvocab.sampling.step import decode, decode_output, streams

__all__ = [
    "HANDSHAKE",
    "DecodeStep",
    "Logprobs",
    "SamplerOutput",
    "SamplingParams",
    "TokenState",
    "apply_min_p",
    "apply_token_bitmask",
    "apply_top_p",
    "chunked",
    "decode",
    "decode_output",
    "greedy",
    "log_softmax",
    "logprobs",
    "logsumexp",
    "min_p_mask",
    "prompt_logprobs",
    "sample",
    "sample_output",
    "streams",
    "top_p_mask",
    "topk",
]
