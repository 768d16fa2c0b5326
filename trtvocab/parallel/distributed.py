"""Collectives the head needs, on gloo (CPU) and NCCL (GPU) alike.

gloo's all_gather rejects tensors of unequal shapes (and may abort the process),
so every uneven exchange here pads to the largest piece and trims afterwards.
Every exchange is preceded by a :class:`Handshake` (the protocol is described
there, once): a rank with bad input makes *all* ranks raise before any data
moves, instead of leaving the others blocked in a collective.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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


# The head groups made so far, per default group: {world group: {lm_head_tp_size: {first rank: group}}}.
_HEAD_GROUPS: dict[Any, dict[int, dict[int, Any]]] = {}


def lm_head_group(mapping: Any) -> ProcessGroup:
    """The process group of ``mapping``'s head group (the ranks of its ``lm_head_tp_group``), None when
    it is the whole world (the default group).

    Every head group of the world is made on the first call for an ``lm_head_tp_size`` (``new_group`` is
    collective over the world: every rank must call this, in the same order, as it builds its head) and kept
    for later calls under the same default group, so the head and the embedding of a model share one group
    and a tied pair's collectives meet the same ranks.
    """
    size, world = mapping.lm_head_tp_size, mapping.world_size
    if size == world:
        return None
    if not is_initialized():
        raise DistributedError(f"a head split over groups of {size} of {world} ranks needs torch.distributed to be "
                               "initialized (use trtvocab.parallel.launch.run_ranks or torchrun)")
    if dist.get_world_size() != world:
        raise DistributedError(f"Mapping.world_size is {world}, but the default process group has "
                               f"{dist.get_world_size()} ranks")
    key = dist.group.WORLD
    if key not in _HEAD_GROUPS:
        _HEAD_GROUPS.clear()  # a new default group: the old groups are gone with the old one
        _HEAD_GROUPS[key] = {}
    made = _HEAD_GROUPS[key]
    if size not in made:
        made[size] = {first: dist.new_group(list(range(first, first + size))) for first in range(0, world, size)}
    return made[size][mapping.rank - mapping.lm_head_tp_rank]


@dataclass(frozen=True)
class Field:
    """One value every rank contributes to a :class:`Handshake`.

    ``choices``: a categorical value (dtype, layout, weight format), exchanged as its index
    in ``choices`` (a tuple, or an enum class: its members in order) and shown by name in errors.
    ``per_rank``: a value ranks may differ in (a row count); it is returned instead of checked.
    ``per_call``: a value that changes from call to call (a digest of a decode step's arguments):
    checked on every call, but not part of the signature an :class:`Agreement` caches.
    """

    name: str
    choices: tuple[Any, ...] | type[enum.Enum] | None = None
    per_rank: bool = False
    per_call: bool = False  # compared on every call, but not part of the cached signature (see Agreement)

    def __post_init__(self) -> None:
        if self.choices is not None and not isinstance(self.choices, tuple):
            object.__setattr__(self, "choices", tuple(self.choices))  # an enum class: its members, in order

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
            codes = self.codes(values)
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


    def codes(self, values: Mapping[str, Any]) -> list[int]:
        """Every field's integer code of this rank's ``values`` (keys the fields do not name are ignored)."""
        return [f.encode(values[f.name]) for f in self.fields]

    def digests(self, values: Mapping[str, Any]) -> tuple[int, int]:
        """``(signature, call digest)`` of this rank's values: the first over the fields an
        :class:`Agreement` caches, the second over the ``per_call`` ones (63-bit, signed-safe)."""
        cached = [f.encode(values[f.name]) for f in self.fields if not (f.per_rank or f.per_call)]
        per_call = [f.encode(values[f.name]) for f in self.fields if f.per_call]
        return _digest([self.what, *cached]), _digest(per_call)


def tensor_digest(value: torch.Tensor | None) -> int:
    """A non-negative 63-bit digest of a tensor's dtype, shape and bytes (0 for None): what the
    ranks compare for an argument that must be equal everywhere but is too long for a handshake
    row (sampling's ``[B]`` top-p, the embedding's ids). Equal tensors give equal digests."""
    if value is None:
        return 0
    t = value.detach().cpu().contiguous()
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.dtype}:{list(t.shape)}:".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return int.from_bytes(h.digest(), "little") >> 1


def _digest(items: Sequence[Any]) -> int:
    h = hashlib.blake2b(repr(list(items)).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


# ---- paying for the handshake once ---------------------------------------------------------
# Status words of the header that rides on a steady-state call's first data collective.
_OK, _FAILED, _CHANGED = 0, 1, 2
_HEADER = 3  # status, signature, call digest
AGREEMENT_HEADER_BYTES = _HEADER * 8  # what a steady call's verdict adds to its first data collective


@dataclass
class Agreement:
    """What a group's ranks agreed on for one kind of call, so that later calls skip the handshake.

    The protocol (a decode loop calls the same operation with the same shapes every step):

    * first call, or any call after a change: the full :class:`Handshake`, then the data;
      the call's first data collective records its payload size here;
    * later calls: no handshake. The first data collective carries a header
      ``[status, signature, call digest]`` in front of the payload (one all_gather moves
      both). ``status`` is OK, FAILED (this rank's input was bad: it sends zeros of the
      agreed size, then raises its error) or CHANGED (its signature -- shapes, dtypes,
      flags -- differs from the agreed one: it sends zeros). After the gather every rank
      reads the same headers: any FAILED -> every other rank raises :class:`PeerRankError`;
      any CHANGED -> every rank runs the full handshake now (which names a real mismatch
      on every rank) and then moves the data plainly; differing call digests (per-call
      arguments such as top_p values) -> :class:`RankMismatchError` on every rank.

    So a rank's bad input still makes every rank raise within one collective, and an
    unchanged decode step costs no collective beyond its data. Ranks keep their
    agreements in step because they make the same calls in the same order (as they must
    for any collective). ``base_seed`` / ``calls``: a value agreed once (rank 0's fresh
    seed) and a call counter, from which a sampler derives each call's fresh seed without
    exchanging it.
    """

    signature: int | None = None
    payload_bytes: int | None = None
    base_seed: int = 0
    calls: int = 0

    def reset(self) -> None:
        self.signature = self.payload_bytes = None


@dataclass
class Pending:
    """A call's verdict waiting to ride on its first data collective (see :class:`Agreement`).

    ``steady``: the call skipped the handshake (the header rides); otherwise the handshake ran
    and the first collective only records its payload size."""

    handshake: Handshake
    agreement: Agreement
    values: Mapping[str, Any]
    signature: int
    call_digest: int
    steady: bool
    group: ProcessGroup
    device: torch.device | str
    world: int | None
    what: str
    check: Callable[[dict[str, list[Any]]], None] | None = None


def open_call(
    handshake: Handshake,
    agreement: Agreement | None,
    values: Mapping[str, Any] | None,
    error: BaseException | None,
    group: ProcessGroup,
    device: torch.device | str = "cpu",
    *,
    world: int | None = None,
    what: str | None = None,
    key: Sequence[int] = (),
    check: Callable[[dict[str, list[Any]]], None] | None = None,
) -> tuple[dict[str, list[Any]], Pending | None]:
    """Start a call under ``agreement``: ``(per-rank fields, pending verdict)``.

    ``agreement`` None (caching off) or nothing agreed yet: the full :meth:`Handshake.exchange`
    runs now (per-rank fields returned). Otherwise nothing is exchanged now; the returned
    :class:`Pending` must be handed to the call's first data collective (:func:`gather_verdict`).
    A rank with ``error`` in a steady call sends its FAILED header (zeros of the agreed payload
    size, the shape every peer's first collective has) and raises ``error`` here.
    """
    what = what or handshake.what
    signature, call_digest = handshake.digests(values) if error is None and values is not None else (0, 0)
    signature = _digest([signature, *key]) if key else signature
    if agreement is None or agreement.signature is None or agreement.payload_bytes is None:
        out = handshake.exchange(values, error, group, device, world=world, what=what)
        if check is not None:
            check(out)
        if agreement is None:
            return out, None
        agreement.signature, agreement.payload_bytes = signature, None
        return out, Pending(handshake, agreement, values or {}, signature, call_digest, False, group, device, world,
                            what, check)
    agreement.calls += 1
    pending = Pending(handshake, agreement, values or {}, signature, call_digest, True, group, device, world, what,
                      check)
    if error is not None:
        _steady_gather(pending, None, _FAILED)
        raise error
    return {}, pending


def gather_verdict(pending: Pending | None, t: torch.Tensor, world: int, group: ProcessGroup) -> list[torch.Tensor]:
    """``all_gather`` of ``t`` (the same shape on every rank): every rank's piece, in rank order.

    ``pending`` is the call's verdict from :func:`open_call` when this is the call's first data
    collective (None otherwise): it records the payload size, or rides on the gather as a header
    and settles the call's verdict on every rank before the pieces are returned.
    """
    if pending is not None and pending.steady:
        nbytes = t.numel() * t.element_size()
        status = _OK if pending.signature == pending.agreement.signature else _CHANGED
        if status == _OK and nbytes != pending.agreement.payload_bytes:
            status = _CHANGED  # a shape the signature does not capture changed: renegotiate, never mis-read
        pieces = _steady_gather(pending, t if status == _OK else None, status)
        if pieces is not None:
            return [p.view(t.dtype).reshape(t.shape) for p in pieces]
        # Some rank changed its call: agree again (a real mismatch raises on every rank), then move the data.
        pending.agreement.reset()
        out = pending.handshake.exchange(pending.values, None, pending.group, pending.device, world=pending.world,
                                         what=pending.what)
        if pending.check is not None:
            pending.check(out)
        pending.agreement.signature = pending.signature
    if pending is not None:
        pending.agreement.payload_bytes = t.numel() * t.element_size()
    pieces = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(pieces, t.contiguous(), group=group)
    return pieces


@dataclass
class HandshakeState:
    """A module's handshake bookkeeping across calls (declared on the module, never on its ``__dict__``).

    ``agreements``: one :class:`Agreement` per kind of call (``"LMHead.forward"``,
    ``"sampling.top_k"``, ...). A call's own verdict is no part of it: :func:`open_call` returns
    the :class:`Pending`, and the caller hands it to the call's first data collective.
    """

    agreements: dict[str, Agreement] = field(default_factory=dict)

    def agreement(self, what: str) -> Agreement:
        """The :class:`Agreement` for calls of kind ``what`` (created on first use)."""
        return self.agreements.setdefault(what, Agreement())


def agreement_of(owner: Any, what: str) -> Agreement | None:
    """``owner``'s :class:`Agreement` for calls of kind ``what``, kept in its declared
    ``owner.handshake_state`` (:class:`HandshakeState`); None when ``owner.handshake_every_call``
    is set: then every call runs the full handshake."""
    if owner.handshake_every_call:
        return None
    return owner.handshake_state.agreement(what)


def _steady_gather(pending: Pending, t: torch.Tensor | None, status: int) -> list[torch.Tensor] | None:
    """One all_gather of ``[header | payload bytes]``; raise or return the payloads (uint8), or None
    when some rank's signature changed (the caller renegotiates)."""
    nbytes = pending.agreement.payload_bytes
    assert nbytes is not None
    words = (nbytes + 7) // 8
    device = t.device if t is not None else pending.device
    buf = torch.zeros(_HEADER + words, dtype=torch.int64, device=device)
    buf[:_HEADER] = torch.tensor([status, pending.signature, pending.call_digest], dtype=torch.int64)
    if t is not None:
        buf[_HEADER:].view(torch.uint8)[:nbytes] = t.contiguous().reshape(-1).view(torch.uint8)
    world = group_size(pending.group)
    pieces = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(pieces, buf, group=pending.group)
    headers = torch.stack([p[:_HEADER] for p in pieces]).cpu()
    if status == _FAILED:
        return None  # the caller raises its own error
    failed = [r for r in range(world) if int(headers[r, 0]) == _FAILED]
    if failed:
        raise PeerRankError(f"{pending.what}: rank(s) {failed} of the group rejected their input; see their error")
    if any(int(headers[r, 0]) == _CHANGED for r in range(world)):
        return None
    if len(set(headers[:, 1].tolist())) > 1:
        raise RankMismatchError(f"{pending.what}: ranks are making different calls (signatures "
                                f"{headers[:, 1].tolist()}); every rank must call the same operation")
    if len(set(headers[:, 2].tolist())) > 1:
        names = [f.name for f in pending.handshake.fields if f.per_call]
        raise RankMismatchError(f"{pending.what}: ranks disagree on {', '.join(names)} "
                                f"(digests {headers[:, 2].tolist()}, rank i -> value i)")
    return [p[_HEADER:].view(torch.uint8)[:nbytes] for p in pieces]


def all_gather_columns(local: torch.Tensor, widths: Sequence[int], group: ProcessGroup,
                       pending: Pending | None = None) -> torch.Tensor:
    """Concatenate ``[N, widths[r]]`` pieces of every rank along the last dim (pad + trim).
    ``pending``: the call's verdict, when this is its first data collective (:func:`gather_verdict`)."""
    world = len(widths)
    if world == 1:
        return local
    width = max(widths)
    if local.shape[-1] < width:
        local = torch.nn.functional.pad(local, (0, width - local.shape[-1]))
    pieces = gather_verdict(pending, local.contiguous(), world, group)
    return torch.cat([p[..., :w] for p, w in zip(pieces, widths, strict=True)], dim=-1)


def all_gather_columns_overlapped(produce: Callable[[int, int], torch.Tensor], rows: int, widths: Sequence[int],
                                  bounds: Sequence[tuple[int, int]], group: ProcessGroup, pending: Pending | None,
                                  *, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """:func:`all_gather_columns` of a ``[rows, widths[me]]`` piece made one column chunk at a time, each chunk's
    all-gather running while the next chunk is made: ``[rows, sum(widths)]``, bitwise the one-collective gather of
    the same columns.

    ``bounds``: the chunks ``[(a, b)]`` of columns ``[0, max(widths))``, the same on every rank (a rank owning
    fewer columns sends padding there, trimmed here). ``produce(a, b)``: this rank's ``[rows, b - a]`` columns
    (contiguous; what lies past its width is never read). The first chunk's gather is synchronous and carries the
    call's verdict (:func:`gather_verdict`): no other collective starts before every rank knows the call is
    agreed (a rank whose shapes changed must not meet chunks of another size). Each later chunk's gather is
    asynchronous (``async_op=True``) and placed once done, while the next chunk is produced.
    """
    world = len(widths)
    starts = [0]
    for w in widths:
        starts.append(starts[-1] + w)
    out = torch.empty((rows, starts[-1]), dtype=dtype, device=device)

    def place(a: int, b: int, pieces: Sequence[torch.Tensor]) -> None:
        for r, piece in enumerate(pieces):
            n = min(b, widths[r]) - a
            if n > 0:
                out[:, starts[r] + a: starts[r] + a + n] = piece[:, :n]

    inflight: list[tuple[int, int, list[torch.Tensor], Any, torch.Tensor]] = []
    for j, (a, b) in enumerate(bounds):
        piece = produce(a, b)
        if j == 0:
            place(a, b, gather_verdict(pending, piece, world, group))
            continue
        received = [torch.empty_like(piece) for _ in range(world)]
        inflight.append((a, b, received, dist.all_gather(received, piece, group=group, async_op=True), piece))
        while len(inflight) > 1 and inflight[0][3].is_completed():  # place what arrived, waiting for none
            a0, b0, got, work, _ = inflight.pop(0)
            work.wait()
            place(a0, b0, got)
    for a, b, got, work, _ in inflight:
        work.wait()
        place(a, b, got)
    return out


def gather_columns(local: torch.Tensor, widths: Sequence[int], group: ProcessGroup, pending: Pending | None = None,
                   *, dst: int | None = None, chunk_rows: int | None = None,
                   order: torch.Tensor | None = None) -> torch.Tensor | None:
    """Every rank's ``[N, widths[r]]`` piece laid end to end along the last dim, ``[N, sum(widths)]``
    (``order``: then those columns, ``[N, len(order)]``), written into one output allocated once.

    ``dst`` None: on every rank (all_gather); ``dst = g``: on group rank ``g`` only (gather), None on the
    others. ``chunk_rows = R``: R rows at a time, through send / receive buffers of ``R`` rows allocated
    once and reused, so that besides the output the transient memory is ``(world + 1) * R * max(widths)``
    elements (None: all N rows in one collective, ``(world + 1) * N * max(widths)``). Pieces are padded to
    the widest (gloo needs equal shapes) and trimmed. ``pending``: the call's verdict riding on the first
    all_gather (:func:`gather_verdict`); a gather to one rank takes none (its caller ran the handshake).
    The bytes are moved, never computed: the result is bitwise :func:`all_gather_columns`'s.
    """
    world = len(widths)
    if world == 1:
        return local if order is None else local[:, order]
    assert dst is None or pending is None, "a gather to one rank carries no verdict (only rank dst would read it)"
    n, width = local.shape[0], max(widths)
    step = n if chunk_rows is None else max(1, min(chunk_rows, n))
    receives = dst is None or group_rank(group) == dst
    edges = [0]
    for w in widths:
        edges.append(edges[-1] + w)
    out = local.new_empty((n, edges[-1] if order is None else order.numel())) if receives else None
    send = local.new_zeros((step, width))
    recv = [torch.empty_like(send) for _ in range(world)] if receives else []
    root = None if dst is None else (dst if group is None else dist.get_global_rank(group, dst))
    for lo in range(0, max(n, 1), max(step, 1)):
        hi = min(n, lo + step)
        buf = send[: hi - lo]
        buf[:, : local.shape[1]].copy_(local[lo:hi])
        if root is not None:
            dist.gather(buf, [p[: hi - lo] for p in recv] if receives else None, dst=root, group=group)
            pieces = [p[: hi - lo] for p in recv]
        elif lo == 0 and pending is not None:
            pieces = gather_verdict(pending, buf, world, group)
        else:
            pieces = [p[: hi - lo] for p in recv]
            dist.all_gather(pieces, buf, group=group)
        if out is None:
            continue
        if order is None:
            for k, piece in enumerate(pieces):
                out[lo:hi, edges[k]: edges[k + 1]] = piece[:, : widths[k]]
        else:
            out[lo:hi] = torch.cat([p[:, :w] for p, w in zip(pieces, widths, strict=True)], dim=-1)[:, order]
    return out


GatherMode = bool | str  # a head's gather_output: True, False or "rank0" (trtvocab.lm_head.GATHER_MODES)


def gather_by_mode(local: torch.Tensor, widths: Sequence[int], group: ProcessGroup, pending: Pending | None = None,
                   *, gather_output: GatherMode = True, chunk_rows: int | None = None,
                   order: torch.Tensor | None = None) -> torch.Tensor | None:
    """A split head's logits by its gather mode, from this rank's ``[N, widths[me]]`` piece: the one home of
    the choice that ``LMHead.forward`` and an artifact's per-rank head (``trtvocab.backends.gathered``) make.

    ``gather_output`` False: ``local`` itself; True: ``[N, sum(widths)]`` on every rank (one all-gather,
    :func:`all_gather_columns`, or with ``chunk_rows`` :func:`gather_columns`); ``"rank0"``: the same on group
    rank 0 only, None on the others (:func:`gather_columns` with ``dst=0``). ``order``: then those columns
    (token order). ``pending``: the call's verdict riding on its all-gather (None for ``"rank0"``: the caller
    ran the handshake). Validated by the caller (``trtvocab.lm_head.gather_error``)."""
    if gather_output is False:
        return local
    if gather_output is True and chunk_rows is None:
        full = all_gather_columns(local, widths, group, pending)
        return full if order is None else full[:, order]
    return gather_columns(local, widths, group, pending, dst=0 if gather_output == "rank0" else None,
                          chunk_rows=chunk_rows, order=order)


def broadcast_from(tensor: torch.Tensor, group: ProcessGroup, src: int = 0) -> torch.Tensor:
    """``tensor`` (the same shape and dtype on every rank) overwritten in place with group rank ``src``'s."""
    if group_size(group) > 1:
        dist.broadcast(tensor, src=src if group is None else dist.get_global_rank(group, src), group=group)
    return tensor


def all_to_all_rows_chunked(local: torch.Tensor, rows: Sequence[int], widths: Sequence[int], group: ProcessGroup,
                            chunk_rows: int) -> torch.Tensor:
    """:func:`all_to_all_rows` of ``local`` (``[sum(rows), my width]``: every rank's rows, this rank's
    columns), ``chunk_rows`` rows of every rank's block at a time into one ``[rows[me], sum(widths)]``
    output; the send / receive buffers (``world * chunk_rows * max(widths)`` elements each) are
    allocated once. Bitwise the unchunked exchange (bytes moved, never computed)."""
    world = len(rows)
    me = group_rank(group)
    if world == 1:
        return local
    height, width = max(rows), max(widths)
    step = max(1, min(chunk_rows, height))
    starts = [0]
    for r in rows:
        starts.append(starts[-1] + r)
    edges = [0]
    for w in widths:
        edges.append(edges[-1] + w)
    out = local.new_empty((rows[me], edges[-1]))
    send = local.new_zeros((world, step, width))
    recv = torch.empty_like(send)
    for lo in range(0, max(height, 1), step):
        hi = min(height, lo + step)
        for j in range(world):
            take = max(0, min(rows[j], hi) - lo)
            send[j, :take, : local.shape[1]] = local[starts[j] + lo: starts[j] + lo + take]
        dist.all_to_all_single(recv, send, group=group)
        mine = max(0, min(rows[me], hi) - lo)
        for k in range(world):
            out[lo: lo + mine, edges[k]: edges[k + 1]] = recv[k, :mine, : widths[k]]
    return out


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
            "(use trtvocab.parallel.launch.run_ranks or torchrun)"
        )
