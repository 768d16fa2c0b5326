"""Vocabulary shard math. Every other module asks this one where a rank's columns are.

Two layouts of a vocabulary of ``V`` columns over ``tp`` ranks::

    uneven (default), V = 10, tp = 3:      padded, V = 10, tp = 3, pad_to = 2:
                                            (V padded to 12 = multiple of pad_to * tp)
    rank 0 | 0 1 2 3 |                      rank 0 | 0 1 2 3 |
    rank 1 | 4 5 6   |                      rank 1 | 4 5 6 7 |
    rank 2 | 7 8 9   |                      rank 2 | 8 9 p p |   p = padding column

    start(r) = (V // tp) * r + min(V % tp, r)     width w = V_padded // tp
    sizes differ by at most one, first ranks       rank r owns [r*w, min((r+1)*w, V))
    larger; nothing to pad                          padding weights are zero, padding
                                                    logits are -inf and trimmed on gather

Ownership is exclusive in both: every token id has exactly one owning rank, and gathered columns
are token ids. :class:`VocabPlacement`: a rank's shard, its peers' and its group (what a sampler reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from trtvocab.errors import ConfigError
from trtvocab.parallel.distributed import HandshakeState

VocabLayout = Literal["uneven", "padded"]
LAYOUTS: tuple[str, ...] = ("uneven", "padded")


def _check(total: int, tp_size: int) -> None:
    if not isinstance(total, int) or total < 1:
        raise ConfigError(f"vocab size must be a positive int, got {total!r}")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tp_size must be a positive int, got {tp_size!r}")


def calc_shard(total: int, tp_size: int, rank: int) -> int:
    """Start offset of ``rank``'s shard in the uneven split; ``rank == tp_size`` gives ``total``."""
    _check(total, tp_size)
    if not 0 <= rank <= tp_size:
        raise ConfigError(f"rank must be in [0, {tp_size}], got {rank}")
    return (total // tp_size) * rank + min(total % tp_size, rank)


def shard_sizes(total: int, tp_size: int) -> list[int]:
    """Sizes of the uneven shards: they differ by at most one, first ranks larger."""
    return [calc_shard(total, tp_size, r + 1) - calc_shard(total, tp_size, r) for r in range(tp_size)]


def padded_vocab_size(total: int, tp_size: int, pad_to: int = 64) -> int:
    """``total`` rounded up to a multiple of ``pad_to * tp_size``."""
    _check(total, tp_size)
    if not isinstance(pad_to, int) or pad_to < 1:
        raise ConfigError(f"pad_to must be a positive int, got {pad_to!r}")
    multiple = pad_to * tp_size
    return -(-total // multiple) * multiple


@dataclass(frozen=True)
class VocabShard:
    """The columns ``[start, end)`` that one rank owns, inside a buffer of ``width`` columns.

    ``width`` equals ``size`` in the uneven layout; in the padded layout it is the
    common shard width and ``width - size`` trailing columns are padding.
    """

    vocab_size: int
    tp_size: int
    rank: int
    start: int
    end: int
    width: int
    layout: VocabLayout

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def padding(self) -> int:
        return self.width - self.size


def vocab_shard(
    vocab_size: int, tp_size: int, rank: int, layout: VocabLayout = "uneven", pad_to: int = 64
) -> VocabShard:
    """The shard of ``rank`` in the given layout."""
    if layout not in LAYOUTS:
        raise ConfigError(f"vocab_layout must be one of {LAYOUTS}, got {layout!r}")
    _check(vocab_size, tp_size)
    if not 0 <= rank < tp_size:
        raise ConfigError(f"rank must be in [0, {tp_size}), got {rank}")
    if layout == "uneven":
        start = calc_shard(vocab_size, tp_size, rank)
        end = calc_shard(vocab_size, tp_size, rank + 1)
        return VocabShard(vocab_size, tp_size, rank, start, end, end - start, "uneven")
    width = padded_vocab_size(vocab_size, tp_size, pad_to) // tp_size
    start = min(rank * width, vocab_size)
    end = min((rank + 1) * width, vocab_size)
    return VocabShard(vocab_size, tp_size, rank, start, end, width, "padded")


def all_shards(
    vocab_size: int, tp_size: int, layout: VocabLayout = "uneven", pad_to: int = 64
) -> list[VocabShard]:
    return [vocab_shard(vocab_size, tp_size, r, layout, pad_to) for r in range(tp_size)]


def owner_of(token_id: int, vocab_size: int, tp_size: int, layout: VocabLayout = "uneven", pad_to: int = 64) -> int:
    """The rank owning ``token_id``."""
    if not 0 <= token_id < vocab_size:
        raise ConfigError(f"token id must be in [0, {vocab_size}), got {token_id}")
    for shard in all_shards(vocab_size, tp_size, layout, pad_to):
        if shard.start <= token_id < shard.end:
            return shard.rank
    raise AssertionError("unreachable: shards cover the vocabulary")


@dataclass(frozen=True)
class VocabPlacement:
    """One rank's place in a vocab split, what ``trtvocab.sampling`` takes instead of a head: this
    rank's :class:`VocabShard`, every rank's (``shards``), the padded layout's ``pad_to``, whether the
    vocabulary is split, the TP ``process_group`` (None: the default group), the ``device`` of the
    logits, and the cross-rank bookkeeping of the calls made on it (``handshake_state``, a
    :class:`~trtvocab.parallel.distributed.HandshakeState`; ``handshake_every_call``: no cached agreement).

    Build one with :func:`vocab_placement`; ``LMHead.placement`` is its own (sharing its handshake state).
    """

    shard: VocabShard
    shards: tuple[VocabShard, ...]
    pad_to: int
    is_split: bool
    process_group: Any = None
    device: Any = "cpu"
    handshake_state: HandshakeState = field(default_factory=HandshakeState)
    handshake_every_call: bool = False

    @property
    def vocab_size(self) -> int:
        return self.shard.vocab_size

    @property
    def tp_size(self) -> int:
        return self.shard.tp_size

    @property
    def tp_rank(self) -> int:
        return self.shard.rank

    @property
    def vocab_start(self) -> int:
        return self.shard.start

    @property
    def vocab_end(self) -> int:
        return self.shard.end

    @property
    def vocab_layout(self) -> VocabLayout:
        return self.shard.layout

    @property
    def layout_code(self) -> int:
        """The layout as one handshake integer: 0 = uneven, else the padded layout's pad_to."""
        return 0 if self.vocab_layout == "uneven" else self.pad_to

    @staticmethod
    def of(owner: Any) -> VocabPlacement:
        """``owner`` itself when it is a placement, else its ``placement`` (an ``LMHead`` or embedding)."""
        if isinstance(owner, VocabPlacement):
            return owner
        placement = getattr(owner, "placement", None)
        if not isinstance(placement, VocabPlacement):
            raise ConfigError(f"sampling: head must be an LMHead (or another module with a vocab placement) or a "
                              f"VocabPlacement, got {type(owner).__name__}")
        return placement


class Placed(Protocol):
    """Anything with a :class:`VocabPlacement` (``LMHead``, ``VocabParallelEmbedding``)."""

    @property
    def placement(self) -> VocabPlacement: ...


Placement = VocabPlacement | Placed  # what a sampling function accepts as its ``head``


def vocab_placement(vocab_size: int, tp_size: int, rank: int, layout: VocabLayout = "uneven", pad_to: int = 64, *,
                    process_group: Any = None, device: Any = "cpu",
                    handshake_every_call: bool = False) -> VocabPlacement:
    """The placement of ``rank`` in the given split (``tp_size`` 1: the whole vocabulary, not split),
    with a fresh handshake state: keep the object for every call of a decode loop."""
    shard = vocab_shard(vocab_size, tp_size, rank, layout, pad_to)  # validates every argument
    return VocabPlacement(shard, tuple(all_shards(vocab_size, tp_size, layout, pad_to)), pad_to, tp_size > 1,
                          process_group, device, HandshakeState(), handshake_every_call)
