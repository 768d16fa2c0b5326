"""The added-vocabulary layout: base ids and added ids (an adapter's new tokens), each split on its own.

The base segment ``[0, V)`` and the added segment ``[V, V + A)`` are each padded (or split unevenly) over
the ranks by :mod:`trtvocab.parallel.sharding`, and each rank lays its two pieces end to end, so adding
tokens never moves a base shard (vLLM's former extra-vocabulary layout). V = 10, A = 3, tp = 2, pad_to 2::

    rank 0 | 0 1 2 3 4 5 | 10 11 |
    rank 1 | 6 7 8 9 p p | 12 p  |       p = padding column (-inf logits, zero rows)
    gathered  0 1 2 3 4 5 10 11 6 7 8 9 p p 12 p
    sharded_to_full_mapping  0 1 2 3 4 5 8 9 10 11 6 7 14 12 13 15

Gathered (rank pieces end to end) logits are put in token-id order by ``logits[:, mapping[:V + A]]``:
``mapping[i]`` is the gathered column of token ``i``; the padding columns follow. A test checks the
drawing against these functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from trtvocab.errors import ConfigError
from trtvocab.parallel.sharding import VocabLayout, VocabShard, vocab_shard


@dataclass(frozen=True)
class AddedVocabShard:
    """One rank's two pieces: ``base`` (ids ``[base.start, base.end)``) then ``added`` (ids
    ``base_vocab + [added.start, added.end)``), each ``width`` wide including its padding."""

    base: VocabShard
    added: VocabShard | None

    @property
    def base_vocab(self) -> int:
        return self.base.vocab_size

    @property
    def width(self) -> int:
        return self.base.width + (self.added.width if self.added is not None else 0)

    def columns(self) -> list[int]:
        """The token id of each local column, ``-1`` for padding."""
        out = list(range(self.base.start, self.base.end)) + [-1] * self.base.padding
        if self.added is not None:
            out += [self.base_vocab + i for i in range(self.added.start, self.added.end)] + [-1] * self.added.padding
        return out

    def local_column(self, token_id: int) -> int | None:
        """Where ``token_id`` sits in this rank's columns (None: another rank's, or outside)."""
        if self.base.start <= token_id < self.base.end:
            return token_id - self.base.start
        if self.added is not None and self.added.start <= token_id - self.base_vocab < self.added.end:
            return self.base.width + token_id - self.base_vocab - self.added.start
        return None


def added_vocab_shards(base_vocab: int, added_vocab: int, tp_size: int, layout: VocabLayout = "padded",
                       pad_to: int = 64) -> list[AddedVocabShard]:
    """Every rank's pieces; ``added_vocab`` 0 is the plain layout (no added piece). An added segment
    smaller than ``tp_size`` is padded (``"padded"``) or refused (``"uneven"``: a rank would own nothing)."""
    if isinstance(added_vocab, bool) or not isinstance(added_vocab, int) or added_vocab < 0:
        raise ConfigError(f"added_vocab must be an int >= 0, got {added_vocab!r}")
    if layout == "uneven" and 0 < added_vocab < tp_size:
        raise ConfigError(f"uneven layout: {added_vocab} added ids cannot be split over {tp_size} ranks "
                          "(use the padded layout)")
    out = []
    for rank in range(tp_size):
        base = vocab_shard(base_vocab, tp_size, rank, layout, pad_to)
        added = vocab_shard(added_vocab, tp_size, rank, layout, pad_to) if added_vocab else None
        out.append(AddedVocabShard(base, added))
    return out


def sharded_to_full_mapping(shards: list[AddedVocabShard]) -> list[int]:
    """For gathered logits (rank pieces end to end): the gathered column of each token id in order
    (``base_vocab + added`` entries), then the padding columns in gathered order."""
    tokens: dict[int, int] = {}
    padding: list[int] = []
    offset = 0
    for shard in shards:
        for i, token in enumerate(shard.columns()):
            if token < 0:
                padding.append(offset + i)
            else:
                tokens[token] = offset + i
        offset += shard.width
    return [tokens[t] for t in range(len(tokens))] + padding


__all__ = ["AddedVocabShard", "added_vocab_shards", "sharded_to_full_mapping"]
