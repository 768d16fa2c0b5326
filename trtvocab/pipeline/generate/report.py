"""What a ``generate`` run returns: :class:`GenerateReport` of :class:`GenerateResult` (one per prompt row),
and what one rank's decode hands back (:class:`RankOutput`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from trtvocab.base.formats import Runtime

# -inf logprobs (ids a filter removed, processed modes) print as this, as vLLM's OpenAI server does:
# JSON has no infinity.
LOGPROB_FLOOR = -9999.0
# One returned logprob: (token id, logprob, rank), best first per generated token.
Logprob = tuple[int, float, int]


@dataclasses.dataclass
class GenerateResult:
    """One prompt's answer: the generated ids only (an end-of-sequence id included) and their text;
    ``logprobs`` (when its params ask): per generated token, the top-N and the sampled token."""

    prompt: str
    token_ids: list[int]
    text: str
    logprobs: list[list[Logprob]] | None = None
    # Per prompt token (None for the first, as vLLM): its logprob and the top-N of its position.
    prompt_logprobs: list[list[Logprob] | None] | None = None
    index: int | None = None  # n > 1: which completion of its prompt


@dataclasses.dataclass
class GenerateReport:
    """What :func:`~trtvocab.pipeline.generate.generate` returns."""

    results: list[GenerateResult]
    tp: int
    head: str  # what computed the logits: "torch" (the model's head) or the artifact's runtime(s)
    new_tokens: int
    prefill_s: float
    decode_s: float  # after the prefill, the compile (compile_s) left out
    # What ran: every rank's head gave tp- and batch-invariant logits (a deterministic LMHead, or a
    # deterministic artifact's PyTorch fallback); not merely what was asked for.
    deterministic: bool
    grammar: str | None = None
    attention_dp: bool = False  # tp > 1: the body ran data-parallel (else every rank ran all of it)
    body_ranks: int = 0  # attention DP: how many ranks ran a body (each its own block of prompts)
    # compile_step: the seconds of the decode steps during which torch.compile compiled the body (rank 0's;
    # 0 when nothing compiled, as in a run after a warm-up). Not in prefill_s, decode_s or the rates.
    compile_s: float = 0.0
    # Attention DP with head groups: the head split over groups of this many ranks, each decoding its own
    # ranks' rows (0: the head over all tp ranks, every rank decoding every row).
    lm_head_tp: int = 0
    # tp > 1: per rank, the rows its head decoded, summed over the steps (every row at every rank without
    # head groups; with them, its own group's rows only).
    head_rows: tuple[int, ...] = ()

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens/s after the prefill (which gives each prompt its first token); None when none followed."""
        after = self.new_tokens - len(self.results)
        return after / self.decode_s if after > 0 and self.decode_s > 0 else None

    def as_json(self, tokenizer: Any = None) -> dict[str, Any]:
        """``{"results": [{"prompt", "token_ids", "text"[, "logprobs"]}, ...]}``: what ``trtvocab generate``
        prints as JSON; ``logprobs`` (DESIGN §9): per generated token a list of ``{"id", "token", "logprob",
        "rank"}``, best first (``token``: ``tokenizer.decode([id])``, or None without a tokenizer)."""
        def entries(step: list[Logprob]) -> list[dict[str, Any]]:
            return [{"id": i, "token": tokenizer.decode([i]) if tokenizer is not None else None,
                     "logprob": max(v, LOGPROB_FLOOR), "rank": k} for i, v, k in step]

        def entry(r: GenerateResult) -> dict[str, Any]:
            out: dict[str, Any] = {"prompt": r.prompt, "token_ids": r.token_ids, "text": r.text}
            if r.index is not None:
                out["index"] = r.index
            if r.logprobs is not None:
                out["logprobs"] = [entries(step) for step in r.logprobs]
            if r.prompt_logprobs is not None:
                out["prompt_logprobs"] = [None if step is None else entries(step) for step in r.prompt_logprobs]
            return out
        return {"results": [entry(r) for r in self.results]}


@dataclasses.dataclass
class RankOutput:
    """One rank's decode: per prompt row its ids, logprobs and prompt logprobs, what ran, and its times."""

    token_ids: list[list[int]]
    logprobs: list[list[list[Logprob]]]
    prompt_logprobs: list[list[list[Logprob] | None] | None]
    ran_on: list[Runtime]
    prefill_s: float
    decode_s: float
    deterministic: bool
    compile_s: float = 0.0
    head_rows: int = 0  # the rows its head decoded, summed over the steps (head groups: its group's only)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` cut before the first stop string it holds (vLLM leaves the stop string out), and whether it held one."""
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


__all__ = ["LOGPROB_FLOOR", "GenerateReport", "GenerateResult", "Logprob", "RankOutput", "cut_at_stop"]
