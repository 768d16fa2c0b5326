"""Collectives the head needs, on gloo (CPU) and NCCL (GPU) alike.

gloo's all_gather rejects tensors of unequal shapes (and may abort the process),
so every uneven exchange here pads to the largest piece and trims afterwards.
Every exchange is preceded by a :class:`Handshake` (the protocol is described
there, once): a rank with bad input makes *all* ranks raise before any data
moves, instead of leaving the others blocked in a collective.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trtvocab.errors import DistributedError, PeerRankError, RankMismatchError

DEFAULT_TIMEOUT_S = 120.0
ProcessGroup = dist.ProcessGroup | None


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def default_backend(device: torch.device | str | None = None) -> str:
    """gloo for CPU tensors and, where CUDA exists, NCCL for CUDA tensors in the same group.

    A head may live on either device (CPU fallback heads on a GPU machine are normal),
    so a GPU machine gets the per-device pair rather than NCCL alone, which would reject
    the CPU tensors of the handshake and of CPU heads.
    """
    if device is not None and torch.device(device).type == "cpu":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the process group that ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR/PORT) describes.

    Returns ``(rank, world_size)``. Without those variables this is a one-rank world
    and no process group is created.
    """
    if is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = backend or default_backend()
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    return rank, world


def group_rank(group: ProcessGroup = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def group_size(group: ProcessGroup = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def new_tp_group(tp_group_ranks: Sequence[int], world_size: int, tp_size: int) -> ProcessGroup:
    """Create all TP groups (every rank must call this) and return the one holding this rank."""
    if tp_size == world_size:
        return None  # the default group is the TP group
    mine = None
    for first in range(0, world_size, tp_size):
        ranks = list(range(first, first + tp_size))
        group = dist.new_group(ranks)
        if ranks == list(tp_group_ranks):
            mine = group
    return mine


@dataclass(frozen=True)
class Field:
    """One value every rank contributes to a :class:`Handshake`.

    ``choices``: a categorical value (dtype, layout, weight format), exchanged as its index
    in ``choices`` and shown by name in errors. ``per_rank``: a value ranks may differ in
    (a row count); it is returned instead of checked.
    """

    name: str
    choices: tuple[Any, ...] | None = None
    per_rank: bool = False

    def encode(self, value: Any) -> int:
        if self.choices is None:
            return int(value)
        return self.choices.index(value) if value in self.choices else -1

    def decode(self, code: int) -> Any:
        if self.choices is None:
            return code
        return self.choices[code] if 0 <= code < len(self.choices) else "<unknown>"


@dataclass(frozen=True)
class Handshake:
    """A declared agreement that the ranks of a group reach before any data moves.

    Why: a collective that one rank never enters blocks the others until the timeout,
    and a collective over tensors of different shapes can abort the process (gloo) or
    move garbage. So every public operation on a split head first exchanges one
    fixed-shape int64 row per rank, ``[failed, *fields]``, with a single all_gather:

    * a rank whose own validation failed still takes part, with ``failed = 1``, and then
      raises its own error; every other rank raises :class:`PeerRankError` naming it;
    * fields that must match (vocab, hidden, tp, layout, dtype, format, operation, k, ...)
      are compared: a difference raises :class:`RankMismatchError` naming the field, with
      every rank's value, on every rank (all ranks see the same table);
    * ``per_rank`` fields (row counts under attention DP) are returned, so the caller
      needs no second collective to learn them.

    Every rank sees the same table, so every rank makes the same decision.
    """

    what: str
    fields: tuple[Field, ...]

    def exchange(
        self,
        values: Mapping[str, Any] | None,
        error: BaseException | None,
        group: ProcessGroup,
        device: torch.device | str = "cpu",
        *,
        world: int | None = None,
        what: str | None = None,
    ) -> dict[str, list[Any]]:
        """Exchange this rank's ``values`` (ignored when ``error`` is set); return the per-rank fields.

        ``world``: the group size the caller was built for; a group of another size raises
        :class:`RankMismatchError` on every rank.
        """
        what = what or self.what
        codes = [0] * len(self.fields)
        if error is None:
            assert values is not None, "values are required when the rank has no error"
            codes = [f.encode(values[f.name]) for f in self.fields]
        row = torch.tensor([0 if error is None else 1, *codes], dtype=torch.int64, device=device)
        pieces = [torch.empty_like(row) for _ in range(group_size(group))]
        dist.all_gather(pieces, row, group=group)
        table = torch.stack(pieces).cpu()
        if error is not None:
            raise error
        failed = [r for r in range(table.shape[0]) if int(table[r, 0]) != 0]
        if failed:
            raise PeerRankError(f"{what}: rank(s) {failed} of the group rejected their input; see their error")
        if world is not None and table.shape[0] != world:
            raise RankMismatchError(f"{what}: built for tp_size {world}, but its process group has "
                                    f"{table.shape[0]} ranks")
        out: dict[str, list[Any]] = {}
        for i, f in enumerate(self.fields):
            column = [f.decode(int(c)) for c in table[:, 1 + i].tolist()]
            if f.per_rank:
                out[f.name] = column
            elif len({int(c) for c in table[:, 1 + i].tolist()}) > 1:
                raise RankMismatchError(f"{what}: ranks disagree on {f.name}: {[str(v) for v in column]} "
                                        "(rank i -> value i)")
        return out


def all_gather_columns(local: torch.Tensor, widths: Sequence[int], group: ProcessGroup) -> torch.Tensor:
    """Concatenate ``[N, widths[r]]`` pieces of every rank along the last dim (pad + trim)."""
    world = len(widths)
    if world == 1:
        return local
    width = max(widths)
    if local.shape[-1] < width:
        local = torch.nn.functional.pad(local, (0, width - local.shape[-1]))
    pieces = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat([p[..., :w] for p, w in zip(pieces, widths, strict=True)], dim=-1)


def all_gather_rows(local: torch.Tensor, rows: Sequence[int], group: ProcessGroup) -> torch.Tensor:
    """Concatenate ``[rows[r], ...]`` pieces of every rank along dim 0 (pad + trim)."""
    world = len(rows)
    if world == 1:
        return local
    height = max(rows)
    if local.shape[0] < height:
        pad = local.new_zeros((height - local.shape[0], *local.shape[1:]))
        local = torch.cat([local, pad])
    pieces = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(pieces, rows, strict=True)])


def all_to_all_rows(
    blocks: Sequence[torch.Tensor], rows: Sequence[int], widths: Sequence[int], group: ProcessGroup
) -> torch.Tensor:
    """Send ``blocks[j]`` (``[rows[j], my width]``) to rank j; return ``[rows[me], sum(widths)]``.

    Used by attention DP with a split head: every rank computed its vocab columns
    for everybody's rows, and each rank takes back its own rows, all columns.
    Blocks are padded to ``[max(rows), max(widths)]`` so one equal-split
    ``all_to_all_single`` moves them.
    """
    world = len(rows)
    me = group_rank(group)
    if world == 1:
        return blocks[0]
    height, width = max(rows), max(widths)
    send = blocks[0].new_zeros((world, height, width))
    for j, block in enumerate(blocks):
        send[j, : block.shape[0], : block.shape[1]] = block
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat([recv[k, : rows[me], : widths[k]] for k in range(world)], dim=-1)


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: ProcessGroup) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def require_initialized(world: int) -> None:
    if world > 1 and not is_initialized():
        raise DistributedError(
            f"a head split over {world} ranks needs torch.distributed to be initialized "
            "(use trtvocab.launch.run_ranks or torchrun)"
        )
