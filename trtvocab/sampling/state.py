"""Per-rank sampler state of a batch: the counts of the ids this rank owns, nothing gathered.

Penalties need, per sequence, which ids the prompt holds and how often each id was generated;
bad words and min tokens need the generated ids themselves. Every rank already has each step's
sampled ids (the draw returns them everywhere), so each rank keeps the generated ids (a list,
``O(steps)``) and the counts of its **own** columns only (``[B, V_local]``): what the penalties
read is column-local, and nothing of it crosses ranks. docs/sampling.md, "What crosses ranks".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from trtvocab.errors import InputError
from trtvocab.parallel.sharding import Placement, VocabPlacement


class TokenState:
    """Prompt and output token counts of a batch's rows on one rank's columns ``[start, start + size)``.

    Args:
        prompts: each row's prompt ids (the repetition penalty counts them).
        start, size: this rank's owned global ids (``head.vocab_start``, ``head.shard.size``).
        eos_token_ids: the ids ``min_tokens`` bans (unless a row's ``ignore_eos``) with its stop ids.
    """

    def __init__(self, prompts: Sequence[Sequence[int]], *, start: int, size: int,
                 eos_token_ids: Iterable[int] = (), device: torch.device | str | None = None) -> None:
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist()
        rows = len(prompts)
        self.start, self.size = start, size
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.output: list[list[int]] = [[] for _ in range(rows)]
        self.prompt_seen = torch.zeros(rows, size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(rows, size, dtype=torch.int32, device=device)
        for r, prompt in enumerate(prompts):
            ids = [int(i) - start for i in prompt if start <= int(i) < start + size]
            self.prompt_seen[r, ids] = True

    @classmethod
    def for_head(cls, head: Placement, prompts: Sequence[Sequence[int]],
                 eos_token_ids: Iterable[int] = ()) -> TokenState:
        """The state of ``prompts`` on the owned columns of ``head`` (an ``LMHead`` or a
        :class:`~trtvocab.parallel.sharding.VocabPlacement`: vocab_start, shard.size, device)."""
        place = VocabPlacement.of(head)
        return cls(prompts, start=place.vocab_start, size=place.shard.size, eos_token_ids=eos_token_ids,
                   device=place.device)

    @classmethod
    def empty(cls, rows: int, start: int, size: int, device: torch.device) -> TokenState:
        """No prompt, nothing generated (what a call without a state sees)."""
        return cls([[] for _ in range(rows)], start=start, size=size, device=device)

    @property
    def rows(self) -> int:
        return len(self.output)

    def append(self, token_ids: torch.Tensor | Sequence[int]) -> None:
        """Count one step's sampled ids ``[B]`` (the same on every rank)."""
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else [int(i) for i in token_ids]
        if len(ids) != self.rows:
            raise InputError(f"TokenState.append: token_ids has {len(ids)} entries for {self.rows} rows")
        for r, i in enumerate(ids):
            self.output[r].append(i)
            if self.start <= i < self.start + self.size:
                self.output_counts[r, i - self.start] += 1

    def append_rows(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Count the sampled ids of some rows only (a decode loop whose finished rows left the batch)."""
        if len(rows) != len(token_ids):
            raise InputError(f"TokenState.append_rows: {len(token_ids)} ids for {len(rows)} rows")
        for r, i in zip(rows, token_ids, strict=True):
            self.output[r].append(int(i))
            if self.start <= int(i) < self.start + self.size:
                self.output_counts[r, int(i) - self.start] += 1

    def select(self, rows: list[int]) -> TokenState:
        """The state of a subset of the rows (copies; appending to it leaves this one unchanged)."""
        out = TokenState.__new__(TokenState)
        out.start, out.size, out.eos_token_ids = self.start, self.size, self.eos_token_ids
        out.output = [list(self.output[r]) for r in rows]
        index = torch.tensor(rows, dtype=torch.int64, device=self.prompt_seen.device)
        out.prompt_seen, out.output_counts = self.prompt_seen[index], self.output_counts[index]
        return out


__all__ = ["TokenState"]
