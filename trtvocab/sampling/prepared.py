"""The prepared decode step: everything converted once, then ``hidden -> ids`` with no host read.

:class:`DecodeStep` is built once per batch composition: it validates every argument, agrees on them with
the other ranks (one handshake) and holds them as device tensors of fixed shape (per-row knobs, seeds,
logit bias / allowed ids / bad words / stop ids as padded index tensors, the step counter). A call is a
pipeline of fixed-shape operations whose only cross-rank traffic is fixed-size functional all_gathers::

    hidden ─ pad to the bucket ─ head.local_logits ─ bitmask ─ status (NaN / +inf rows)
      ─ bans, bias, penalties ─ temperature ─ top-k ─ top-p ─ min-p ─ typical-p
      ─ race (the status rides along) ─ logprobs ─ advance (step, counts, history)

Every branch is decided by the params (the host knows them); a check that must stay sets a bit of a
per-row status that :meth:`DecodeStep.read` raises with the ids. The per-call draws (``sample``,
``decode_output``) run the same pipeline (:meth:`DecodeStep.for_rows`). docs/generate.md, "The prepared
step".
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from trtvocab.errors import ConfigError, InputError
from trtvocab.parallel import distributed as D
from trtvocab.parallel.sharding import Placement, VocabPlacement
from trtvocab.sampling import noise, treesum
from trtvocab.sampling.args import (
    ENTROPY_BITS,
    Logprobs,
    SamplerOutput,
    collective_plan,
    draw_args_error,
    params_tensor,
    state_error,
)
from trtvocab.sampling.bitmask import allowed_columns, allowed_ids
from trtvocab.sampling.params import LOGPROBS_MODES, SamplingParams
from trtvocab.sampling.reductions import (
    NO_ID,
    first_max,
    handshake,
    local_topk,
    own,
    owned_ranges,
    pick_owned,
    prefix_keep,
    sum_exp_and_picks,
)
from trtvocab.sampling.state import TokenState

# Status bits of a row (DecodeStep.read raises on any).
HIDDEN_NONFINITE = 1
LOGITS_NAN = 2
LOGITS_POSINF = 4
NO_TOKEN = 8
RANKS_DISAGREE = 16
INPUT_REFUSED = 32
_STATUS_TEXT = {HIDDEN_NONFINITE: "hidden rows are not finite (NaN / inf)",
                LOGITS_NAN: "the logits hold NaN",
                LOGITS_POSINF: "the logits hold +inf (an overflow: huge hidden states, scales or adapters)",
                NO_TOKEN: "no token is allowed (every logit is -inf after the bitmask / vocab_limit / filters)",
                RANKS_DISAGREE: "the ranks passed different bitmasks",
                INPUT_REFUSED: "a rank refused its input to this step (that rank's error names it)"}


_COMPILED: dict[tuple[Any, ...], Any] = {}  # DecodeStep.compile's cores: from hidden / logits, one graph or not
_WARM: weakref.WeakSet[Any] = weakref.WeakSet()  # heads whose kernels a step has loaded (eager, before any trace)


def bucket(rows: int) -> int:
    """The padded batch of ``rows`` rows: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(0, rows - 1).bit_length()


def _gather(t: torch.Tensor, place: VocabPlacement, pending: D.Pending | None = None) -> torch.Tensor:
    """``[tp, *t.shape]``: every rank's ``t`` (fixed shape), a functional all_gather ``torch.compile`` traces.
    ``pending``: a per-call draw's verdict (``reductions.handshake``), when this is the call's first gather."""
    if not place.is_split:
        return t[None]
    if pending is not None:
        return torch.stack(D.gather_verdict(pending, t, place.tp_size, place.process_group))
    from torch.distributed import _functional_collectives as fc

    group = place.process_group if place.process_group is not None else torch.distributed.group.WORLD
    out = fc.all_gather_single(t.contiguous(), 0, group)
    return out.view(place.tp_size, *t.shape)


def _order_by_value_then_id(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    by_id = torch.argsort(ids, dim=1, stable=True)
    by_value = torch.argsort(values.gather(1, by_id), dim=1, descending=True, stable=True)
    return by_id.gather(1, by_value)


def _merged_topk(x: torch.Tensor, place: VocabPlacement, k: int,
                 gather: Callable[[torch.Tensor, VocabPlacement], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The global top-``k`` ``(values [B, k], ids [B, k])`` of every rank's owned columns ``x``, value
    descending then id ascending: ``reductions.merged_topk`` with the step's ``gather``
    (:meth:`DecodeStep._step_gather`)."""
    if not place.is_split:
        vals, cols = local_topk(x, k)
        return vals, place.token_ids(cols)
    rows = x.shape[0]
    k_local = min(k, x.shape[1])
    vals = torch.full((rows, k), float("-inf"), dtype=torch.float32, device=x.device)
    ids = torch.full((rows, k), NO_ID, dtype=torch.int64, device=x.device)
    if k_local:
        v, c = local_topk(x, k_local)
        vals = torch.cat([v.to(torch.float32), vals[:, k_local:]], dim=1)
        ids = torch.cat([place.token_ids(c), ids[:, k_local:]], dim=1)
    packed = torch.stack([vals.view(torch.int32).to(torch.int64), ids], dim=-1)
    pieces = gather(packed, place)  # [tp, B, k, 2]
    all_v = pieces[..., 0].to(torch.int32).view(torch.float32).permute(1, 0, 2).reshape(rows, -1)
    all_i = pieces[..., 1].permute(1, 0, 2).reshape(rows, -1)
    order = _order_by_value_then_id(all_v, all_i)[:, :k]
    return all_v.gather(1, order).to(x.dtype), all_i.gather(1, order)


def _lse(x: torch.Tensor, place: VocabPlacement, token_ids: torch.Tensor | None,
         gather: Callable[[torch.Tensor, VocabPlacement], torch.Tensor],
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The vocab tree's ``(max, logsumexp, picks)`` (``reductions.sum_exp_and_picks``: the same nodes and
    merge, so the same bits) with the step's gather on a split placement."""
    if not place.is_split:
        return sum_exp_and_picks(x, place, token_ids)
    x = x.to(torch.float32)
    picked = None
    if token_ids is not None:
        picked = pick_owned(x, token_ids, place, torch.zeros(token_ids.shape, dtype=torch.float32, device=x.device))
    if place.added is None:
        return treesum.tree_logsumexp(x, place.vocab_start, place.vocab_size, place.tp_size, place.process_group,
                                      owned_ranges(place), extra=picked, gather=lambda t: gather(t, place))
    (a, _), (c, _) = place.owned_ranges()[place.tp_rank]  # two segments: each piece's nodes of the one tree
    nodes = treesum.range_nodes(x[:, : place.shard.size], a) + treesum.range_nodes(x[:, place.shard.size :], c)
    return treesum.merge_ranges(nodes, place.vocab_size, place.tp_size, place.process_group, place.owned_ranges(),
                                like=x, extra=picked, gather=lambda t: gather(t, place))


def _padded(lists: list[list[int]], width: int | None = None, fill: int = -1) -> torch.Tensor:
    width = max([len(v) for v in lists] + [0]) if width is None else width
    return torch.tensor([list(v) + [fill] * (width - len(v)) for v in lists], dtype=torch.int64).reshape(
        len(lists), width)


class DecodeStep:
    """One decode step of a batch, prepared once: ``ids = step_fn(hidden)`` with no host read.

    Args:
        head: an ``LMHead`` (``step_fn(hidden)`` runs its ``local_logits``) or a
            :class:`~trtvocab.parallel.sharding.VocabPlacement` (then call :meth:`draw` with this rank's
            logits, as an artifact's backend computes them).
        params: one :class:`SamplingParams` for every row, or one per row (the rows of the batch).
        rows: the batch's rows (default: ``len(params)``, the state's rows, or the first call's batch).
        state: the batch's :class:`TokenState` (penalties, bad words, min tokens read it). The step
            advances its counts on the device; :meth:`read` appends the ids to its host lists. Without
            one, the ids the step drew since it was built count for ``min_tokens`` and ``bad_words``.
        bitmask_width: the words of xgrammar's ``int32 [B, W]`` bitmask a call passes (None: no bitmask).
        start_step: the decode step of the first call (part of the noise key: ``decode(..., step=s)``).
        vocab_limit: ids at or past it are never drawn (as for :func:`~trtvocab.sampling.sample`).

    ``step_fn.last_output`` is the last call's :class:`SamplerOutput` (device tensors, the real rows);
    :meth:`read` returns the ids as a list and raises what the step found (:data:`HIDDEN_NONFINITE` ...).
    """

    def __init__(self, head: Placement, params: SamplingParams | list[SamplingParams], *,
                 state: TokenState | None = None, bitmask_width: int | None = None, start_step: int = 0,
                 vocab_limit: int | None = None, rows: int | None = None) -> None:
        self.head = None if isinstance(head, VocabPlacement) else head
        place = VocabPlacement.of(head)
        self.place = place
        self.advances = True
        self.last_output: SamplerOutput | None = None
        self._last: torch.Tensor | None = None
        self._verdict: D.Pending | None = None  # a per-call draw's verdict (draw_once), for its first gather
        self._runner: Any = _eager
        self._args = (params, state, bitmask_width, start_step, vocab_limit)
        if rows is None:
            rows = len(params) if isinstance(params, list | tuple) else (state.rows if isinstance(state, TokenState)
                                                                         else None)
        self.rows = rows
        if rows is not None:
            self._build(rows)

    def _build(self, rows: int) -> None:
        """Validate, agree (one handshake on a split head) and prepare for ``rows`` rows (once)."""
        params, state, bitmask_width, start_step, vocab_limit = self._args
        place = self.place
        self.rows = rows
        self.padded_rows = bucket(rows)
        device = torch.device(place.device) if not isinstance(place.device, torch.device) else place.device
        self.device = device
        error, per_row = draw_args_error(params, rows, start_step, vocab_limit, place.vocab_size, "DecodeStep")
        if error is None:
            error = state_error(state, rows, place, "DecodeStep")
        if error is None and bitmask_width is not None and (
                isinstance(bitmask_width, bool) or not isinstance(bitmask_width, int) or bitmask_width < 0):
            error = InputError(f"DecodeStep: bitmask_width must be an int >= 0 or None, got {bitmask_width!r}")
        digest = params_tensor(per_row, start_step, vocab_limit) if error is None else None
        plan = collective_plan(per_row, place.vocab_size) if error is None else 0
        fresh = int(torch.randint(0, 2**62, (1,)).item())  # a CPU generator: no device value
        probe = torch.empty(rows, 0, device=device)
        fresh = handshake(place, probe, error, "decode", extra=plan + 16 * (bitmask_width or 0), argument=digest,
                          proposal=fresh, cache=False).proposal
        self.per_row = per_row
        self.vocab_limit = vocab_limit
        self.bitmask_width = bitmask_width
        self.state = state
        self.seeds = [fresh + r if p.seed is None else p.seed for r, p in enumerate(per_row)]
        self._prepare(per_row, state, start_step)
        if self.head is not None and self.head not in _WARM:  # eager, once a head: what it loads on first use
            with torch.inference_mode():
                self.head.local_logits(torch.zeros(1, self.head.hidden_size, dtype=self.head.dtype, device=device))
                treesum.range_nodes(torch.zeros(1, 2, device=device), 0)  # the tree kernel's exp check
            _WARM.add(self.head)

    @classmethod
    def for_rows(cls, head: Placement, per_row: list[SamplingParams], seeds: list[int], step: int,
                 vocab_limit: int | None, state: TokenState | None) -> DecodeStep:
        """The step of one per-call draw (``sampling.sample`` / ``decode_output``), whose arguments the
        caller validated and agreed on already: no handshake, no bucket padding, and the state is read,
        not advanced (the caller appends the ids)."""
        self = cls.__new__(cls)
        self.head = None if isinstance(head, VocabPlacement) else head
        self.place = VocabPlacement.of(head)
        self.advances = False
        self.last_output, self._last, self._runner, self._verdict = None, None, _eager, None
        self.rows = self.padded_rows = len(per_row)
        self.device = torch.device(self.place.device) if not isinstance(self.place.device, torch.device) \
            else self.place.device
        self.per_row, self.vocab_limit, self.bitmask_width, self.state = per_row, vocab_limit, None, state
        self.seeds = seeds
        self._prepare(per_row, state, step)
        return self

    def draw_once(self, owned_logits: torch.Tensor, what: str, pending: D.Pending | None = None) -> SamplerOutput:
        """:meth:`draw` for a per-call draw: the output, and a row left with no token raised at once
        (``what``: the caller's name in the message). ``pending``: the call's verdict from the caller's
        handshake (``reductions.handshake``), carried by the step's first gather (:meth:`_step_gather`)."""
        self._verdict = pending
        try:
            self._finish(self._core_logits(owned_logits, None))
        finally:
            self._verdict = None
        assert self._last is not None and self.last_output is not None
        empty = (self._last[self.rows : 2 * self.rows] & NO_TOKEN) != 0
        if bool(empty.any()):  # every rank has the same gathered values: every rank raises
            raise InputError(f"{what}: row(s) {empty.nonzero()[:, 0].tolist()} allow no token (every logit is -inf "
                             "after the bitmask / vocab_limit / filters)")
        return self.last_output

    # ---- preparation (host, once) -------------------------------------------------------------
    def _prepare(self, per_row: list[SamplingParams], state: TokenState | None, start_step: int) -> None:
        b, pb, dev = self.rows, self.padded_rows, self.device
        pad = pb - b
        greedy_pad = SamplingParams(temperature=0.0)
        rows = per_row + [greedy_pad] * pad
        self.sampled_any = any(not p.greedy for p in per_row)
        self.all_greedy = not self.sampled_any

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=dev)
        self.temps = f32([p.temperature for p in rows])[:, None]
        self.greedy = torch.tensor([p.greedy for p in rows], dtype=torch.bool, device=dev)[:, None]
        self.top_k_max = min(max([0 if p.greedy else p.top_k for p in per_row] + [0]), self.place.vocab_size)
        self.top_k = torch.tensor([0 if p.greedy else p.top_k for p in rows], dtype=torch.int64, device=dev)
        self.top_p = f32([p.top_p for p in rows])
        self.min_p = f32([p.min_p for p in rows])
        self.typical_p = f32([p.typical_p for p in rows])
        self.top_p_on = any(p.top_p < 1 and not p.greedy for p in per_row)
        self.min_p_on = any(p.min_p > 0 and not p.greedy for p in per_row)
        self.typical_on = any(p.typical_p < 1 and not p.greedy for p in per_row)
        seeds = self.seeds + [0] * pad
        self.seed_keys = torch.tensor([noise._signed(noise.mix_int(s + noise._GAMMA)) for s in seeds],
                                      dtype=torch.int64, device=dev)[:, None]
        self.step_t = torch.full((), start_step, dtype=torch.int64, device=dev)
        self.refused_t = torch.zeros((), dtype=torch.int64, device=dev)  # INPUT_REFUSED: this rank's input refused
        self._refusal: InputError | None = None
        self.next_step = start_step  # the host's count: the step the next read() returns
        # the logits processors (column-local): static entries, and what the state makes dynamic
        self.processes = any(p.processes for p in per_row)
        self.penalizes = state is not None and any(p.penalizes for p in per_row)
        self.restricted = torch.tensor([p.allowed_token_ids is not None for p in rows], dtype=torch.bool, device=dev)
        self.any_allowed = any(p.allowed_token_ids is not None for p in per_row)
        self.allowed = _padded([list(p.allowed_token_ids or ()) for p in rows]).to(dev)
        single = [[w[-1] for w in p.bad_words if len(w) == 1] for p in rows]
        self.static_bans = _padded(single).to(dev)
        multi = [[w for w in p.bad_words if len(w) > 1] for p in rows]
        self.history_len = max([len(w) - 1 for ws in multi for w in ws] + [0])
        words = max([len(ws) for ws in multi] + [0])
        L = self.history_len
        # a prefix right-aligned in the window of the last L ids; -2 where the word is shorter (matches anything)
        prefix = [[[-2] * (L - len(w) + 1) + list(w[:-1]) for w in ws] + [[-3] * L] * (words - len(ws))
                  for ws in multi]
        self.word_prefix = torch.tensor(prefix, dtype=torch.int64).reshape(pb, words, L).to(dev)
        self.word_last = _padded([[w[-1] for w in ws] for ws in multi], words).to(dev)
        self.word_len = _padded([[len(w) - 1 for w in ws] for ws in multi], words, fill=L + 1).to(dev)
        eos = state.eos_token_ids if state is not None else ()
        stops = [list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos)) if p.min_tokens else [] for p in rows]
        self.stop_ids = _padded(stops).to(dev)
        self.min_tokens = torch.tensor([p.min_tokens for p in rows], dtype=torch.int64, device=dev)
        outputs = state.output if state is not None else [[] for _ in per_row]
        outputs = [list(o) for o in outputs] + [[] for _ in range(pad)]
        self.generated = torch.tensor([len(o) for o in outputs], dtype=torch.int64, device=dev)
        self.history = torch.tensor([([-1] * L + o)[len(o):] if L else [] for o in outputs],
                                    dtype=torch.int64).reshape(pb, L).to(dev)
        bias = [sorted(p.logit_bias.items()) for p in rows]
        self.bias_ids = _padded([[i for i, _ in e] for e in bias]).to(dev)
        width = self.bias_ids.shape[1]
        self.bias_values = torch.tensor([[v for _, v in e] + [0.0] * (width - len(e)) for e in bias],
                                        dtype=torch.float32).reshape(pb, width).to(dev)
        self.any_bias = width > 0
        self.rep = f32([p.repetition_penalty for p in rows])[:, None]
        self.freq = f32([p.frequency_penalty for p in rows])[:, None]
        self.pres = f32([p.presence_penalty for p in rows])[:, None]
        self.counts = self.seen = None
        self.state_start = state.start if state is not None else 0
        if state is not None and not self.advances:
            self.counts, self.seen = state.output_counts.to(dev), state.prompt_seen.to(dev)
        elif state is not None:
            counts, seen = state.output_counts.to(dev), state.prompt_seen.to(dev)
            if pad:
                counts = torch.cat([counts, counts.new_zeros(pad, counts.shape[1])])
                seen = torch.cat([seen, seen.new_zeros(pad, seen.shape[1])])
                state.output_counts, state.prompt_seen = counts[:b], seen[:b]  # views: the step advances them
            self.counts, self.seen = counts, seen
        self.real = torch.arange(pb, device=dev) < b
        # returned logprobs
        self.want = [-1 if p.logprobs is None else p.logprobs for p in per_row] + [-1] * pad
        self.logprobs_n = max(self.want)
        self.is_raw = torch.tensor([p.logprobs_mode.startswith("raw") for p in rows], device=dev)[:, None]
        self.as_logits = torch.tensor([p.logprobs_mode.endswith("logits") for p in rows], device=dev)[:, None]
        self.want_t = torch.tensor(self.want, device=dev)
        assert all(p.logprobs_mode in LOGPROBS_MODES for p in per_row)
        n_owned = self.place.owned
        self.col_ids = self.place.column_ids(n_owned, dev)

    # ---- the step (device only) ---------------------------------------------------------------
    def __call__(self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """The next ids ``[B]`` (a device tensor) of the last hidden rows ``hidden [B, H]``; ``bitmask``:
        xgrammar's ``int32 [B, W]`` (``W`` = ``bitmask_width``). Reads nothing from the device."""
        head = self.head
        if head is None:
            raise ConfigError("DecodeStep: built on a VocabPlacement: call draw(local_logits) with this rank's logits")
        if self.rows is None and isinstance(hidden, torch.Tensor) and hidden.dim() == 2:
            self._build(hidden.shape[0])  # one SamplingParams, no state, no rows: the first call's batch
        error = None
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[0] != self.rows \
                or hidden.shape[1] != head.hidden_size or hidden.dtype != head.dtype:
            got = f"{hidden.dtype} {list(hidden.shape)}" if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            error = InputError(f"DecodeStep: hidden must be a {head.dtype} [{self.rows}, {head.hidden_size}] tensor "
                               f"(the head's dtype), got {got}")
        error = error or self._mask_error(bitmask)
        if self._refuse(error):
            hidden = torch.zeros(self.rows, head.hidden_size, dtype=head.dtype, device=self.device)
            bitmask = self._open_mask()
        return self._finish(self._runner(self, self._pad(hidden.to(self.device), 0.0), self._padded_mask(bitmask)))

    def _refuse(self, error: InputError | None) -> bool:
        """Whether this call runs on stand-in input: an input only this rank sees is wrong. Alone, raise it
        now; on a split head run the step on zeros with every row's ``INPUT_REFUSED`` bit set, so that the
        other ranks' collectives are met and every rank raises at :meth:`read` (this one with ``error``)."""
        if error is None and self._refusal is None:
            return False
        if error is not None and (self.rows is None or not self.place.is_split):
            raise error
        self.refused_t.fill_(0 if error is None else INPUT_REFUSED)  # a host write: no read
        self._refusal = error
        return error is not None

    def _open_mask(self) -> torch.Tensor | None:
        return None if self.bitmask_width is None else \
            torch.full((self.rows, self.bitmask_width), -1, dtype=torch.int32, device=self.device)

    def compile(self, backend: str = "inductor") -> DecodeStep:
        """Run the bucket's core compiled (``torch.compile``, one graph): the padded step, which reads
        nothing of the real row count, so every step of the same bucket, knobs and head shares one graph
        (a batch that shrinks or grows inside its bucket compiles nothing new). ``backend``: torch.compile's.
        Returns ``self``."""
        core = DecodeStep._core if self.head is not None else DecodeStep._core_logits
        key = (core.__name__, self.padded_rows, self._knobs(), backend)
        if key not in _COMPILED:
            # dynamo keeps its graphs per code object and stops at 8 of them: a code object of its own for each
            # bucket and knobs, so that no number of them ever reaches that limit.
            fn = types.FunctionType(core.__code__.replace(co_name=f"{core.__name__}_{len(_COMPILED)}"),
                                    core.__globals__, core.__name__, core.__defaults__, core.__closure__)
            _COMPILED[key] = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
        self._runner = _COMPILED[key]
        return self

    def _knobs(self) -> tuple[Any, ...]:
        """What the core's graph depends on beyond tensor shapes: the knobs the batch turns on, their widths."""
        return (self.top_k_max, self.logprobs_n, self.top_p_on, self.min_p_on, self.typical_on, self.sampled_any,
                self.processes, self.penalizes, self.any_allowed, self.any_bias, self.history_len, self.vocab_limit,
                self.bitmask_width, self.place.vocab_start, self.place.owned, self.place.local_width,
                self.place.tp_size, self.place.added is None, id(self.place.process_group), id(self.head))

    def _pad(self, x: torch.Tensor, value: float) -> torch.Tensor:
        if self.padded_rows == self.rows:
            return x
        return torch.cat([x, x.new_full((self.padded_rows - self.rows, x.shape[1]), value)])

    def _mask_error(self, bitmask: Any) -> InputError | None:
        if (bitmask is None) != (self.bitmask_width is None) or (bitmask is not None and (
                not isinstance(bitmask, torch.Tensor) or bitmask.dtype != torch.int32
                or tuple(bitmask.shape) != (self.rows, self.bitmask_width))):
            got = "None" if bitmask is None else f"{bitmask.dtype} {list(bitmask.shape)}" \
                if isinstance(bitmask, torch.Tensor) else type(bitmask).__name__
            want = "None" if self.bitmask_width is None else f"int32 [{self.rows}, {self.bitmask_width}]"
            return InputError(f"DecodeStep: bitmask must be {want} (bitmask_width of the step), got {got}")
        return None

    def _padded_mask(self, bitmask: torch.Tensor | None) -> torch.Tensor | None:
        if bitmask is None:
            return None
        mask = bitmask.to(self.device)
        if self.padded_rows == self.rows:
            return mask
        return torch.cat([mask, mask.new_full((self.padded_rows - self.rows, mask.shape[1]), -1)])

    def _core(self, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, Logprobs | None]:
        """The padded step from the hidden rows ``x [bucket, H]``: ``(ids, status, logprobs)`` of the bucket."""
        status = self.refused_t.expand(x.shape[0])
        if self.head.check_finite:  # False: the caller validated its inputs (LMHead.check_input's rule)
            status = status | torch.where(torch.isfinite(x).all(dim=1), 0, HIDDEN_NONFINITE)
        return self._pipeline(self.head.local_logits(x), mask, status)

    def _core_logits(self, logits: torch.Tensor,
                     mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, Logprobs | None]:
        """The padded step from this rank's logits ``[bucket, V_local]``."""
        return self._pipeline(logits, mask, self.refused_t.expand(logits.shape[0]))

    def _finish(self, out: tuple[torch.Tensor, torch.Tensor, Logprobs | None]) -> torch.Tensor:
        """Keep the real rows: ``last_output`` and what :meth:`read` copies; the ids ``[B]``."""
        chosen, status, lp = out
        b = self.rows
        self.last_output = SamplerOutput(chosen[:b], None if lp is None else
                                         Logprobs(lp.ids[:b], lp.values[:b], lp.ranks[:b]))
        ran = self.step_t - ((1 - _refused(status)) if self.advances else 1)  # the step it ran as
        self._last = torch.cat([chosen[:b], status[:b], ran.reshape(1)])
        return chosen[:b]

    def draw(self, local_logits: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """The step on this rank's logits ``[B, V_local]`` (a backend computed them): the ids ``[B]``."""
        p = self.place
        if self.rows is None and isinstance(local_logits, torch.Tensor) and local_logits.dim() == 2:
            self._build(local_logits.shape[0])
        error = None
        if not isinstance(local_logits, torch.Tensor) or local_logits.dim() != 2 \
                or local_logits.shape[0] != self.rows or local_logits.shape[1] not in (p.owned, p.local_width) \
                or not local_logits.dtype.is_floating_point:
            got = f"{local_logits.dtype} {list(local_logits.shape)}" if isinstance(local_logits, torch.Tensor) else \
                type(local_logits).__name__
            error = InputError(f"DecodeStep.draw: local_logits must be floating [{self.rows}, {p.owned}] (this "
                               f"rank's columns), got {got}")
        error = error or self._mask_error(bitmask)
        if self._refuse(error):
            local_logits = torch.zeros(self.rows, p.owned, dtype=torch.float32, device=self.device)
            bitmask = self._open_mask()
        runner = self._runner if self.head is None and self._runner is not _eager else DecodeStep._core_logits
        return self._finish(runner(self, self._pad(local_logits, 0.0), self._padded_mask(bitmask)))

    def _pipeline(self, logits: torch.Tensor, mask: torch.Tensor | None,
                  status: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Logprobs | None]:
        """The module docstring's pipeline on the bucket's rows: ``(ids, status, logprobs)``, all ``[bucket, ...]``."""
        place = self.place
        x = own(logits, place).to(torch.float32)
        if mask is not None:
            keep = allowed_columns(mask, place.vocab_start, x.shape[1], place.shard.size) if place.added is None \
                else allowed_ids(mask, self.col_ids)
            x = x.masked_fill(~keep, float("-inf"))
        top = x.amax(dim=1) if x.shape[1] else x.new_full((x.shape[0],), float("-inf"))
        status = status | torch.where(torch.isnan(top), LOGITS_NAN, 0) | torch.where(top == float("inf"),
                                                                                       LOGITS_POSINF, 0)
        ids = self.col_ids
        raw = x if self.vocab_limit is None else x.masked_fill(ids[None, :] >= self.vocab_limit, float("-inf"))
        x = self._process(x)
        scaled = self._scale(x)
        scaled = self._top_k(scaled)
        scaled = self._top_p(scaled)
        scaled = self._min_p(scaled)
        scaled = self._typical_p(scaled)
        digest = None
        if mask is not None and place.is_split:  # each row's bitmask, as one number the ranks compare
            weights = torch.arange(1, mask.shape[1] + 1, dtype=torch.int64, device=mask.device) * 0x9E3779B1
            digest = (mask.to(torch.int64) * weights).sum(dim=1)
        chosen, status = self._race(scaled, status, digest)
        chosen = torch.where(self.real, chosen, torch.zeros_like(chosen))  # padding rows: id 0, never read
        lp = self._logprobs(raw, scaled, chosen)
        self._advance(chosen, status)
        return chosen, status * self.real, lp

    def _process(self, x: torch.Tensor, lo: int = 0) -> torch.Tensor:
        """vLLM v1's steps 3-6 on fixed-shape index tensors: allowed token ids, bad words, min tokens, logit
        bias, then the repetition, frequency and presence penalties. ``x``: float32 owned columns ``lo ..
        lo + n`` (the whole shard, or a chunk the streamed path holds); each rank touches only its own ids."""
        if not self.processes:
            return x
        n = x.shape[1]
        rows = x.shape[0]

        def scatter(ids: torch.Tensor, value: torch.Tensor | float, base: torch.Tensor) -> torch.Tensor:
            """``base [B, n]`` with the block's columns of ``ids [B, m]`` (-1 / others: a spare column) set."""
            cols, mine = self.place.owned_columns(ids)
            cols = cols - lo
            col = torch.where((ids >= 0) & mine & (cols >= 0) & (cols < n), cols, n)
            wide = torch.cat([base, base.new_zeros(base.shape[0], 1)], dim=1)  # the spare column (n may be 0)
            src = value if isinstance(value, torch.Tensor) else torch.full(ids.shape, value, dtype=base.dtype,
                                                                          device=base.device)
            return wide.scatter(1, col, src)[:, :n]
        banned = torch.zeros(rows, n, dtype=torch.bool, device=x.device)
        if self.any_allowed:
            banned = scatter(self.allowed, False, self.restricted[:, None].expand(rows, n).clone())
        bans = [self.static_bans]
        if self.word_last.shape[1]:
            hit = ((self.history[:, None, :] == self.word_prefix) | (self.word_prefix == -2)).all(dim=2)
            hit = hit & (self.word_len <= self.generated[:, None])
            bans.append(torch.where(hit, self.word_last, -1))
        if self.stop_ids.shape[1]:
            early = (self.generated < self.min_tokens)[:, None]
            bans.append(torch.where(early, self.stop_ids, -1))
        ban_ids = torch.cat(bans, dim=1)
        if ban_ids.shape[1]:
            banned = scatter(ban_ids, True, banned)
        x = x.masked_fill(banned, float("-inf"))
        if self.any_bias:
            bias = scatter(self.bias_ids, self.bias_values, torch.zeros_like(x))
            has = scatter(self.bias_ids, True, torch.zeros_like(x, dtype=torch.bool))
            x = torch.where(has, x + bias, x)
        if self.penalizes:
            assert self.counts is not None and self.seen is not None
            if self.place.added is None:  # the state's columns are the owned ones
                counts, seen = self.counts[:, lo : lo + n], self.seen[:, lo : lo + n]
            else:  # a token-order state (every id): the block's ids' columns
                at = self.col_ids[lo : lo + n] - self.state_start
                counts, seen = self.counts.index_select(1, at), self.seen.index_select(1, at)
            seen = seen | (counts > 0)
            x = torch.where(seen & (self.rep != 1), torch.where(x > 0, x / self.rep, x * self.rep), x)
            x = torch.where(self.freq != 0, x - self.freq * counts.to(torch.float32), x)
            x = torch.where(self.pres != 0, x - self.pres * (counts > 0).to(torch.float32), x)
        return x

    def _scale(self, x: torch.Tensor, lo: int = 0) -> torch.Tensor:
        """Temperature (greedy rows keep their logits) and the vocab limit, on owned columns ``lo ..``."""
        if self.all_greedy:
            scaled = x
        else:
            divisor = torch.where(self.greedy, torch.ones_like(self.temps), self.temps)
            scaled = torch.where(self.greedy, x, x / divisor)
        if self.vocab_limit is not None:
            ids = self.col_ids[lo : lo + x.shape[1]]
            scaled = scaled.masked_fill(ids[None, :] >= self.vocab_limit, float("-inf"))
        return scaled

    def _race_scores(self, scaled: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The Gumbel race's float64 scores: ``x + g(seed, step, id)`` on sampled rows, ``x`` on greedy ones,
        ``-inf`` kept (``ids``: the columns' token ids, ``[n]`` or ``[B, n]``)."""
        if not self.sampled_any:
            return scaled
        keys = noise.mix_tensor(self.seed_keys ^ noise.mix_tensor(self.step_t + noise._signed(2 * noise._GAMMA)))
        score = scaled.to(torch.float64)
        score = torch.where(~self.greedy, score + noise.gumbel(keys, ids), score)
        return score.masked_fill(torch.isneginf(scaled), float("-inf"))  # -inf + noise stays excluded

    def _step_gather(self, t: torch.Tensor, place: VocabPlacement | None = None) -> torch.Tensor:
        """:func:`_gather` on the step's placement (``place``, when given, is it: the signature ``prefix_keep``
        and the vocab tree call). Which gather comes first depends on the rows' knobs (top-k, top-p, min-p,
        typical-p, the race), so the first one takes :meth:`draw_once`'s verdict, once."""
        pending = self._verdict
        if pending is not None:
            self._verdict = None
        return _gather(t, self.place, pending)

    def _top_k(self, scaled: torch.Tensor) -> torch.Tensor:
        k = self.top_k_max
        if k <= 0:
            return scaled
        values, top_ids = _merged_topk(scaled, self.place, k, self._step_gather)
        cut = torch.where(self.top_k > 0, (self.top_k.clamp(max=k) - 1), k - 1)[:, None]
        cut_v, cut_id = values.gather(1, cut), top_ids.gather(1, cut)
        keep = (scaled > cut_v) | ((scaled == cut_v) & (self.col_ids[None, :] <= cut_id))
        active = (self.top_k > 0)[:, None]
        return scaled.masked_fill(active & ~keep, float("-inf"))

    def _top_p(self, scaled: torch.Tensor) -> torch.Tensor:
        if not self.top_p_on:
            return scaled
        on = (self.top_p < 1) & ~self.greedy[:, 0]
        lse = _lse(scaled, self.place, None, self._step_gather)[1]
        keep = prefix_keep(scaled, torch.exp(scaled - lse[:, None]), self.top_p, self.place, self._step_gather)
        return scaled.masked_fill(on[:, None] & ~keep, float("-inf"))

    def _min_p(self, scaled: torch.Tensor) -> torch.Tensor:
        if not self.min_p_on:
            return scaled
        on = (self.min_p > 0) & ~self.greedy[:, 0]
        local = scaled.amax(dim=1) if scaled.shape[1] else scaled.new_full((scaled.shape[0],), float("-inf"))
        m = self._step_gather(local.to(torch.float32)).amax(dim=0)
        keep = torch.exp(scaled - m[:, None]) >= self.min_p[:, None]
        return scaled.masked_fill(on[:, None] & ~keep, float("-inf"))

    def _typical_p(self, scaled: torch.Tensor) -> torch.Tensor:
        if not self.typical_on:
            return scaled
        place = self.place
        on = (self.typical_p < 1) & ~self.greedy[:, 0]
        _, lse, _ = _lse(scaled, place, None, self._step_gather)
        logp = scaled - lse[:, None]
        probs = torch.exp(logp)  # the entropy's terms and the cut's masses
        term = torch.where(torch.isneginf(scaled), torch.zeros_like(logp), probs * logp)
        local = torch.round(term.to(torch.float64) * 2.0**ENTROPY_BITS).to(torch.int64).sum(dim=1)
        total = self._step_gather(local).sum(dim=0)
        h = (-(total.to(torch.float64) * 2.0**-ENTROPY_BITS)).to(torch.float32)
        key = torch.abs(-logp - h[:, None]).masked_fill(torch.isneginf(scaled), float("inf"))
        keep = prefix_keep(-key, probs, self.typical_p, place, self._step_gather, whole_ties=True)
        return scaled.masked_fill(on[:, None] & ~keep, float("-inf"))

    def _race(self, scaled: torch.Tensor, status: torch.Tensor,
              digest: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        place = self.place
        scores = self._race_scores(scaled, self.col_ids)
        rows = scores.shape[0]
        if scores.shape[1]:
            best, cols = first_max(scores)
            chosen = place.token_ids(cols)
        else:
            best = scores.new_full((rows,), float("-inf"))
            chosen = torch.full((rows,), NO_ID, dtype=torch.int64, device=scores.device)
        chosen = torch.where(torch.isneginf(best), torch.full_like(chosen, NO_ID), chosen)
        if place.is_split:
            columns = [best.to(torch.float64).view(torch.int64), chosen, status]
            packed = self._step_gather(torch.stack(columns + ([digest] if digest is not None else []), dim=-1))
            values, ids = packed[..., 0].view(torch.float64), packed[..., 1]  # [tp, B]
            best = values.max(dim=0).values
            chosen = torch.where(values == best, ids, torch.full_like(ids, NO_ID)).min(dim=0).values
            status = packed[0, :, 2]
            for r in range(1, place.tp_size):
                status = status | packed[r, :, 2]
            if digest is not None:
                differ = (packed[:, :, 3] != packed[:1, :, 3]).any(dim=0)
                # a refused rank ran on a stand-in bitmask: its refusal is the news, not the difference
                refused = (status & INPUT_REFUSED) != 0
                status = status | torch.where(differ & ~refused, RANKS_DISAGREE, 0)
        empty = torch.isneginf(best) | (chosen == NO_ID)
        status = status | torch.where(empty, NO_TOKEN, 0)
        return torch.where(empty, torch.zeros_like(chosen), chosen), status

    def _logprobs(self, raw: torch.Tensor, scaled: torch.Tensor, chosen: torch.Tensor) -> Logprobs | None:
        if self.logprobs_n < 0:
            return None
        place = self.place
        src = torch.where(self.is_raw, raw, scaled)
        logits = self.as_logits
        _, lse, picked = _lse(src, place, chosen[:, None], self._step_gather)
        assert picked is not None
        values = torch.where(logits, src, src - lse[:, None])
        sampled = torch.where(logits, picked, picked - lse[:, None])
        count = (values >= sampled).sum(dim=1)
        rank = self._step_gather(count).sum(dim=0)
        ids, out_v, out_r = chosen[:, None], sampled, rank[:, None]
        n = self.logprobs_n
        if n > 0:
            top_v, top_ids = _merged_topk(values, place, min(n, place.vocab_size), self._step_gather)
            width = top_ids.shape[1]
            slot = torch.arange(width, device=src.device)[None, :]
            inside = slot < self.want_t[:, None]
            ids = torch.cat([ids, torch.where(inside, top_ids, torch.full_like(top_ids, -1))], dim=1)
            out_v = torch.cat([out_v, top_v.to(torch.float32).masked_fill(~inside, float("-inf"))], dim=1)
            out_r = torch.cat([out_r, torch.where(inside, slot + 1, torch.zeros_like(slot))], dim=1)
        asking = (self.want_t >= 0)[:, None]
        return Logprobs(torch.where(asking, ids, torch.full_like(ids, -1)),
                        out_v.to(torch.float32).masked_fill(~asking, float("-inf")),
                        torch.where(asking, out_r.to(torch.int64), torch.zeros_like(out_r, dtype=torch.int64)))

    def _advance(self, chosen: torch.Tensor, status: torch.Tensor) -> None:
        """The step counter, and the generated counts, the history and the state's counts of the real rows
        whose status is clean (a refused row counts nothing), in place on the device."""
        if not self.advances:
            return
        # a call some rank refused is no step (alone it raises at once): the gathered status says so everywhere
        self.step_t.add_(1 - _refused(status))
        ok = self.real & (status == 0)
        self.generated.add_(ok.to(torch.int64))
        if self.history_len:
            self.history.copy_(torch.where(ok[:, None], torch.cat([self.history[:, 1:], chosen[:, None]], dim=1),
                                           self.history))
        if self.counts is not None:
            local = chosen - self.state_start
            mine = ok & (local >= 0) & (local < self.counts.shape[1])
            rows = torch.arange(self.counts.shape[0], device=chosen.device)
            self.counts.index_put_((rows, torch.where(mine, local, 0)), mine.to(self.counts.dtype), accumulate=True)

    # ---- the host side -----------------------------------------------------------------------------
    def read(self) -> list[int]:
        """The last step's ids as a list: one copy of ids, status and step to the host. Raises
        :class:`InputError` naming the rows and the step when the step found bad input (on every rank:
        the status travelled with the ids). Appends the ids to the state's host lists."""
        if self._last is None:
            raise InputError("DecodeStep.read: no step has run")
        values = self._last.tolist()
        b = self.rows
        ids, status, step = values[:b], values[b : 2 * b], values[2 * b]
        # a refused call is no step (the counter stayed): the next call runs as this one would have
        self.next_step = step if any(s & INPUT_REFUSED for s in status) else step + 1
        if self._refusal is not None:  # this rank's own input: its own words (the others name the bit)
            raise InputError(f"sampling.decode (step {step}): {self._refusal}")
        bad = [(r, s) for r, s in enumerate(status) if s]
        if bad:
            found = sorted({bit for _, s in bad for bit in _STATUS_TEXT if s & bit})
            what = "; ".join(f"row(s) {[r for r, s in bad if s & bit]}: {_STATUS_TEXT[bit]}" for bit in found)
            raise InputError(f"sampling.decode (step {step}): {what}")
        if self.state is not None:
            for r, i in enumerate(ids):
                self.state.output[r].append(int(i))
        self.next_step = step + 1
        return ids


def _refused(status: torch.Tensor) -> torch.Tensor:
    """0-d int64: 1 when a rank refused the call's input (a row of the gathered status has INPUT_REFUSED)."""
    return ((status & INPUT_REFUSED) != 0).any().to(torch.int64)


def _eager(step: DecodeStep, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 Logprobs | None]:
    return step._core(x, mask)


__all__ = ["HIDDEN_NONFINITE", "INPUT_REFUSED", "LOGITS_NAN", "LOGITS_POSINF", "NO_TOKEN", "RANKS_DISAGREE",
           "DecodeStep", "bucket"]
