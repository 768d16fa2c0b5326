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

import torch

from trtvocab.errors import ConfigError
from trtvocab.parallel.distributed import HandshakeState

VocabLayout = Literal["uneven", "padded"]
# How every handshake names the layout field, whose value is :attr:`VocabPlacement.layout_code`.
LAYOUT_FIELD = "vocab layout (0 = uneven, else pad_to)"
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
    # The optional second segment (an adapter's added ids, trtvocab.parallel.added_vocab): this rank's
    # piece of ``[0, A)`` (token ids ``V + i``), laid after the base piece's ``shard.width`` columns, and
    # every rank's. None: one segment, local column ``c`` is token id ``vocab_start + c``.
    added: VocabShard | None = None
    added_shards: tuple[VocabShard, ...] = ()

    @property
    def vocab_size(self) -> int:
        """The token ids the placement covers: ``V``, or ``V + A`` with a second segment."""
        return self.shard.vocab_size + (self.added.vocab_size if self.added is not None else 0)

    @property
    def owned(self) -> int:
        """This rank's owned columns (both pieces, padding excluded): the width of ``own(local_logits)``."""
        return self.shard.size + (self.added.size if self.added is not None else 0)

    @property
    def local_width(self) -> int:
        """This rank's local columns, padding included (what ``local_logits`` returns)."""
        return self.shard.width + (self.added.width if self.added is not None else 0)

    def column_ids(self, n: int, device: Any) -> Any:
        """int64 ``[n]``: the token id of each of the first ``n`` owned columns (ascending): the one
        place "owned column -> token id" is computed for a whole block."""
        if self.added is None:
            return torch.arange(self.shard.start, self.shard.start + n, device=device)
        first = self.shard.vocab_size + self.added.start
        return torch.cat([torch.arange(self.shard.start, self.shard.end, device=device),
                          torch.arange(first, first + self.added.size, device=device)])[:n]

    def token_ids(self, cols: Any) -> Any:
        """Token ids of owned-column indices ``cols`` (an int64 tensor of any shape)."""
        if self.added is None:
            return cols + self.shard.start
        return torch.where(cols < self.shard.size, cols + self.shard.start,
                           cols - self.shard.size + self.shard.vocab_size + self.added.start)

    def owned_columns(self, token_ids: Any) -> tuple[Any, Any]:
        """``(owned column, mine)`` of token ids (int64 tensor): where each id sits among this rank's
        owned columns, and whether this rank owns it (the column is clamped into range where not)."""
        local = token_ids - self.shard.start
        mine = (local >= 0) & (local < self.shard.size)
        if self.added is not None:
            second = token_ids - (self.shard.vocab_size + self.added.start)
            in_added = (second >= 0) & (second < self.added.size)
            local = torch.where(in_added, second + self.shard.size, local)
            mine = mine | in_added
        return local.clamp(0, max(self.owned - 1, 0)), mine

    def local_token_ids(self, device: Any) -> Any:
        """int64 ``[local_width]``: the token id of each local column, ``-1`` for padding."""
        base = torch.full((self.shard.width,), -1, dtype=torch.int64, device=device)
        base[: self.shard.size] = torch.arange(self.shard.start, self.shard.end, device=device)
        if self.added is None:
            return base
        extra = torch.full((self.added.width,), -1, dtype=torch.int64, device=device)
        first = self.shard.vocab_size + self.added.start
        extra[: self.added.size] = torch.arange(first, first + self.added.size, device=device)
        return torch.cat([base, extra])

    def owned_ranges(self) -> list[tuple[tuple[int, int], ...]]:
        """Every rank's owned token-id ranges ``[start, end)``, in rank order (one or two per rank)."""
        if self.added is None:
            return [((s.start, s.end),) for s in self.shards]
        v = self.shard.vocab_size
        return [((s.start, s.end), (v + a.start, v + a.end)) for s, a in zip(self.shards, self.added_shards,
                                                                             strict=True)]

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
        """The layout as one handshake integer (the :data:`LAYOUT_FIELD`): 0 = uneven, else the padded
        layout's pad_to."""
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
