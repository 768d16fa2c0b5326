"""The decode loop of one rank, its state passed explicitly (gpt-fast's shape): a :class:`Batch` of
left-padded rows advanced one token a step, the body run on this rank's block of them
(:class:`BodyRows`), the vocabulary ends (:class:`~trtvocab.pipeline.decode.VocabEnds`) drawing the
next ids. :func:`generate` runs it in this process at tp 1 or on ``spec.tp`` gloo ranks."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from trtvocab.base.formats import Runtime
from trtvocab.checkpoints.hf_loader import quiet_transformers
from trtvocab.errors import DistributedError
from trtvocab.parallel import distributed as D
from trtvocab.parallel.launch import run_ranks, usable_cores
from trtvocab.parallel.mapping import Mapping
from trtvocab.pipeline.decode import TorchEnds, VocabEnds, open_vocab_ends
from trtvocab.pipeline.generate.beams import decode_beams
from trtvocab.pipeline.generate.model import Body, LoadedModel, ModelFacts
from trtvocab.pipeline.generate.options import GenerateSpec
from trtvocab.pipeline.generate.report import GenerateReport, GenerateResult, Logprob, RankOutput, cut_at_stop
from trtvocab.sampling import Logprobs, SamplerOutput, SamplingParams, TokenState
from trtvocab.sampling.added_vocab import state_placement
from trtvocab.sampling.grammar import RowGrammars

# What the ranks agree on once their setup is done (protocol: trtvocab.parallel.distributed.Handshake):
# a rank whose setup failed stops the others; after every artifact-backend step: pipeline.decode.STEP_HANDSHAKE.
SETUP_HANDSHAKE = D.Handshake("generate", (D.Field("vocab_size"), D.Field("hidden_size"), D.Field("prompts")))


@dataclasses.dataclass
class Batch:
    """The loop's state: every prompt row left-padded to ``longest``, the mask holding every position the
    run can reach (its first ``length`` columns the positions so far; the last token is never fed back),
    the feed (the prompts, then one token a row), the rows still ``active``, what each row generated."""

    feed: torch.Tensor  # [B, longest], then [B, 1]: a finished row is fed padding (it stays in the batch)
    mask: torch.Tensor  # [B, longest + max_new_tokens]
    positions: torch.Tensor
    length: int
    padded: bool  # some row is shorter than the longest: the body needs the mask
    pad: int
    active: list[int]
    generated: list[list[int]]
    returned: list[list[list[Logprob]]]  # the logprobs asked for, per row and generated token
    step: int = 0
    one: torch.Tensor | None = None  # the [B, 1] feed after the prompts, refilled each step

    @classmethod
    def left_padded(cls, prompt_ids: tuple[tuple[int, ...], ...], pad: int, max_new_tokens: int) -> Batch:
        rows, longest = len(prompt_ids), max(len(p) for p in prompt_ids)
        feed = torch.full((rows, longest), pad, dtype=torch.int64)
        mask = torch.zeros((rows, longest + max_new_tokens), dtype=torch.int64)
        for b, p in enumerate(prompt_ids):
            feed[b, longest - len(p):] = torch.tensor(p, dtype=torch.int64)
            mask[b, longest - len(p):longest] = 1
        prompt_mask = mask[:, :longest]
        positions = (prompt_mask.cumsum(-1) - 1).masked_fill(prompt_mask == 0, 0)
        return cls(feed, mask, positions, longest, not bool(prompt_mask.all()), pad, list(range(rows)),
                   [[] for _ in range(rows)], [[] for _ in range(rows)])

    @property
    def rows(self) -> int:
        return len(self.generated)

    def advance(self, tokens: torch.Tensor, still: list[int]) -> None:
        """Feed ``tokens`` (one per active row) next, then keep only the rows ``still`` running."""
        if self.one is None:
            self.one = torch.empty((self.rows, 1), dtype=torch.int64)
        self.one.fill_(self.pad)
        self.one[self.active, 0] = tokens.to(torch.int64)
        self.feed, self.active, self.step = self.one, still, self.step + 1
        self.mask[:, self.length] = 1
        self.length += 1
        self.positions = self.positions[:, -1:] + 1


@dataclasses.dataclass(frozen=True)
class BodyRows:
    """Which rows' body this rank runs and which rows its head decodes: all of them; or under attention DP
    its own block ``[lo, hi)`` (``blocks``: every rank's), the last hidden rows then gathered from the
    ranks of its head's group, which decode those rows only. Without head groups that group is the
    world (every rank decodes every row); with them (``head_tp``: ``GenerateSpec.lm_head_tp`` < tp, the
    body ranks spread over the groups by ``rank_blocks``) each group decodes its own ranks' rows, as
    SGLang's ``enable_dp_lm_head`` and ``Mapping.enable_lm_head_tp_in_adp`` do, and :meth:`exchange`
    then hands every rank every row's id once a step (one all-gather over the world)."""

    adp: bool
    lo: int
    hi: int
    blocks: tuple[tuple[int, int], ...]
    hidden_size: int
    rank: int = 0
    head_tp: int = 0  # head groups of this many ranks (0: none, the head's group is the world)
    group: Any = None  # the process group of this rank's head group (None: the world)

    @classmethod
    def of(cls, spec: GenerateSpec, rank: int, hidden_size: int, group: Any = None) -> BodyRows:
        rows = len(spec.prompt_ids)
        if not (spec.attention_dp and spec.tp > 1):
            return cls(False, 0, rows, (), hidden_size)
        blocks = spec.blocks()
        lo, hi = blocks[rank]
        return cls(True, lo, hi, blocks, hidden_size, rank, spec.lm_head_tp if spec.head_groups else 0, group)

    def run(self, body: Body | None, ends: VocabEnds, batch: Batch) -> torch.Tensor | None:
        """The body's last hidden states of ``batch.feed`` (None: this rank runs no body)."""
        mask = batch.mask if batch.padded else None
        if not self.adp:  # every rank embeds (a split table: all-reduced) and runs every row
            assert body is not None
            return body(ends.embed(batch.feed), mask, batch.positions, batch.length)
        if self.hi == self.lo or body is None:
            return None  # no row of this rank's block: it only takes part in the vocab dimension
        lo, hi = self.lo, self.hi
        return body(ends.embed(batch.feed[lo:hi]), mask[lo:hi] if mask is not None else None,
                    batch.positions[lo:hi], batch.length)

    def _members(self, group: int) -> range:
        """The ranks of head group ``group`` (without head groups: the world)."""
        if not self.head_tp:
            return range(len(self.blocks))
        return range(group * self.head_tp, (group + 1) * self.head_tp)

    def _group_rows(self, rows: list[int], group: int) -> list[int]:
        spans = [self.blocks[r] for r in self._members(group)]
        return [b for b in rows if any(lo <= b < hi for lo, hi in spans)]

    def own(self, rows: list[int]) -> list[int]:
        """The rows of ``rows`` (global ids, sorted) this rank's head decodes: all of them, or with head
        groups those whose body a rank of its group runs."""
        if not self.head_tp:
            return rows
        return self._group_rows(rows, self.rank // self.head_tp)

    def last(self, hidden: torch.Tensor | None, rows: list[int]) -> torch.Tensor:
        """The last hidden row of each row in ``rows`` (global ids, sorted; :meth:`own`'s): left padding
        puts every prompt's last token in the last column. Attention DP: gathered from the ranks of the
        head's group that ran their body (each of them gets all of them, in row order)."""
        if not self.adp:
            assert hidden is not None
            return hidden[rows, -1, :]
        mine = [b - self.lo for b in rows if self.lo <= b < self.hi]
        local = hidden[mine, -1, :] if hidden is not None and mine else \
            torch.zeros((0, self.hidden_size), dtype=torch.float32)
        members = self._members(self.rank // self.head_tp if self.head_tp else 0)
        counts = [sum(1 for b in rows if self.blocks[r][0] <= b < self.blocks[r][1]) for r in members]
        return D.all_gather_rows(local.float().contiguous(), counts, self.group)

    def exchange(self, out: SamplerOutput | None, rows: list[int], params: list[SamplingParams]) -> SamplerOutput:
        """Head groups: every row's sampled id (and logprobs, where a row's params ask) from the group that
        decoded it, on every rank, in row order: one all-gather over the world, each group's first rank
        sending its group's rows as int64 ``[id, logprob ids, logprob value bits, logprob ranks]`` (the
        widths padded to the widest asked). ``out``: this rank's group's (None: its group had no row).
        A rank whose own draw differs from what its group's first rank sent raises DistributedError."""
        n, world = self.head_tp, len(self.blocks)
        per_group = [len(self._group_rows(rows, g)) for g in range(world // n)]
        counts = [per_group[r // n] if r % n == 0 else 0 for r in range(world)]
        width = max((p.logprobs + 1 for p in params if p.logprobs is not None), default=0)
        group = self.rank // n
        sent = torch.zeros((counts[self.rank], 1 + 3 * width), dtype=torch.int64)
        if counts[self.rank]:
            assert out is not None
            sent[:, 0] = out.token_ids.to(torch.int64)
            if width:
                sent[:, 1:] = _packed_logprobs(out.logprobs, counts[self.rank], width)
        table = D.all_gather_rows(sent, counts, None)
        start = sum(per_group[:group])
        if out is not None and not torch.equal(table[start:start + per_group[group], 0], out.token_ids.to(torch.int64)):
            raise DistributedError(f"generate: rank {self.rank} drew other token ids than its head group's first rank")
        logprobs = None
        if width:
            bits = table[:, 1 + width:1 + 2 * width].to(torch.int32).contiguous()
            logprobs = Logprobs(table[:, 1:1 + width].contiguous(), bits.view(torch.float32),
                                table[:, 1 + 2 * width:].contiguous())
        return SamplerOutput(table[:, 0].contiguous(), logprobs)


def _packed_logprobs(logprobs: Logprobs | None, rows: int, width: int) -> torch.Tensor:
    """``logprobs`` of ``rows`` rows as int64 ``[rows, 3 * width]``: ids, float32 value bits, ranks, each
    padded to ``width`` columns as :class:`Logprobs` pads a slot a row did not ask for (-1, -inf, 0)."""
    ids = torch.full((rows, width), -1, dtype=torch.int64)
    values = torch.full((rows, width), float("-inf"), dtype=torch.float32)
    ranks = torch.zeros((rows, width), dtype=torch.int64)
    if logprobs is not None:
        w = logprobs.ids.shape[1]
        if w > width:
            raise DistributedError(f"generate: a head group's logprobs are {w} wide, more than the {width} its "
                                   "rows ask for")
        ids[:, :w], values[:, :w], ranks[:, :w] = logprobs.ids, logprobs.values.float(), logprobs.ranks
    return torch.cat([ids, values.view(torch.int32).to(torch.int64), ranks], dim=1)


def _setup(spec: GenerateSpec, rank: int, tokenizer: Any, facts: ModelFacts) -> tuple[VocabEnds, Any]:
    """This rank's vocab ends and grammar matchers; at tp > 1 the ranks then meet once
    (:data:`SETUP_HANDSHAKE`), so a rank whose shard or backend failed to load stops the others."""
    split = spec.tp > 1
    mapping = _mapping(spec, rank) if split else None
    vocab_limit = len(tokenizer) if len(tokenizer) < facts.vocab_size else None
    error: Exception | None = None
    ends: Any = None
    grammar = None
    try:
        body = spec.blocks()[rank][0] < spec.blocks()[rank][1] if spec.attention_dp and split else None
        ends = open_vocab_ends(spec, rank, mapping, vocab_limit, body=body)
        if any(g is not None for g in spec.grammars):
            grammar = RowGrammars(spec.grammars, tokenizer, facts.vocab_size, set(facts.eos))
    except Exception as exc:
        if not split:
            raise
        error = exc
    if split:
        values = None if error is not None else {"vocab_size": ends.placement.vocab_size,
                                                 "hidden_size": ends.hidden_size, "prompts": len(spec.prompts)}
        SETUP_HANDSHAKE.exchange(values, error, None, world=spec.tp, what="generate (setup)")
    return ends, grammar


def _mapping(spec: GenerateSpec, rank: int) -> Mapping:
    """This rank's place at tp > 1. ``lm_head_tp``: the head (and its tied table) over groups of that many
    ranks (``distributed.lm_head_group``). The mapping carries no attention-DP flag: the loop hands each
    group its own rows itself (:class:`BodyRows`; the decode step and the streaming sampler serve a split
    head on the rows they are given, which ``LMHead``'s attention-DP forward, ``head(hidden)``, does not)."""
    return Mapping(world_size=spec.tp, rank=rank, tp_size=spec.tp, lm_head_tp_size=spec.lm_head_tp or None)


def _next_ids(spec: GenerateSpec, ends: VocabEnds, grammar: Any, state: TokenState | None, rows: BodyRows,
              batch: Batch, hidden: torch.Tensor | None) -> SamplerOutput:
    """The next id of every active row (the same on every rank), counted into ``state``. With head groups
    this rank's group draws its own rows only (their bitmask, state and adapter rows), then the ranks
    exchange the ids (:meth:`BodyRows.exchange`)."""
    active = batch.active
    mine = rows.own(active)
    out: SamplerOutput | None = None
    if mine:  # a head group none of whose rows is still running skips the head (all its ranks alike)
        bitmask = grammar.bitmask(mine) if grammar is not None and grammar.constrains(mine) else None
        if ends.adapter_ids is not None:
            ends.row_adapters = ends.adapter_ids[mine]
        rows_state = None if state is None else state if len(mine) == batch.rows else state.select(mine)
        out = ends.next_ids(rows.last(hidden, mine), [spec.params[b] for b in mine], batch.step, bitmask,
                            rows_state)
    if rows.head_tp:
        out = rows.exchange(out, active, [spec.params[b] for b in active])
    assert out is not None
    if state is not None:
        state.append_rows(active, out.token_ids.tolist())
    return out


def _still_running(spec: GenerateSpec, tokenizer: Any, grammar: Any, eos: frozenset[int], batch: Batch,
                   out: SamplerOutput) -> list[int]:
    """Record each active row's new token (and its logprobs); the rows that go on."""
    still = []
    for j, (b, tok) in enumerate(zip(batch.active, out.token_ids.tolist(), strict=True)):
        batch.generated[b].append(tok)
        p = spec.params[b]
        if out.logprobs is not None and p.logprobs is not None:
            batch.returned[b].append(out.logprobs.row(j, p.logprobs))
        done = (tok in eos and not p.ignore_eos) or tok in p.stop_token_ids \
            or len(batch.generated[b]) >= spec.max_new_tokens
        if spec.stop:
            done = cut_at_stop(tokenizer.decode(batch.generated[b], skip_special_tokens=True), spec.stop)[1] or done
        if grammar is not None:
            done = grammar.accept(b, tok) or done
        if not done:
            still.append(b)
    return still


def _decode(spec: GenerateSpec, model: Any, tokenizer: Any, rank: int, facts: ModelFacts | None = None) -> RankOutput:
    """The batching loop of one rank: embed, body, last rows, ``ends.next_ids``, until every row is done."""
    facts = facts or ModelFacts.of(model, tokenizer)
    ends, grammar = _setup(spec, rank, tokenizer, facts)
    if spec.beam_width > 1:
        return decode_beams(spec, model, ends, facts)
    batch = Batch.left_padded(spec.prompt_ids, facts.pad, spec.max_new_tokens)
    body = Body(model, spec.kv_cache, batch.mask.shape[1], spec.compile_step, spec.body_kernels) \
        if model is not None else None
    groups = spec.head_groups and spec.lm_head_tp > 1  # the head groups' process groups, made with the head
    rows = BodyRows.of(spec, rank, facts.hidden_size, D.lm_head_group(_mapping(spec, rank)) if groups else None)
    # Per-rank token counts of the ids this rank owns, only when a prompt's params read them.
    counted = state_placement(ends.head) if isinstance(ends, TorchEnds) else ends.placement  # token order
    state = TokenState.for_head(counted, spec.prompt_ids, set(facts.eos)) \
        if any(p.processes for p in spec.params) else None
    start = time.perf_counter()
    prefill_s = 0.0
    with torch.inference_mode():
        hidden = rows.run(body, ends, batch)
        prompt_lps = _prompt_logprobs(spec, ends, hidden, batch.length)
        head_rows = 0
        while batch.active:
            head_rows += len(rows.own(batch.active))
            out = _next_ids(spec, ends, grammar, state, rows, batch, hidden)
            if batch.step == 0:  # a first step that compiled the prepared step: that time is compile_s
                prefill_s = time.perf_counter() - start - ends.compile_s
            batch.advance(out.token_ids, _still_running(spec, tokenizer, grammar, facts.eos, batch, out))
            if batch.active:
                hidden = rows.run(body, ends, batch)
    compile_s = (body.compile_s if body is not None else 0.0) + ends.compile_s
    decode_s = time.perf_counter() - start - prefill_s - compile_s
    return RankOutput(batch.generated, batch.returned, prompt_lps, sorted(ends.ran_on), prefill_s, decode_s,
                      ends.deterministic, compile_s, head_rows)


def _prompt_logprobs(spec: GenerateSpec, ends: VocabEnds, hidden: torch.Tensor | None,
                     longest: int) -> list[list[list[Logprob] | None] | None]:
    """Per prompt: None, or (its params ask) ``[None, then per later prompt token its logprob and the
    top-N of the position before it]`` from the prefill's hidden rows (left-padded to ``longest``),
    all prompts' rows in one streamed call. Attention DP is refused for it (``GenerateOptions``)."""
    out: list[list[list[Logprob] | None] | None] = [None] * len(spec.prompt_ids)
    asked = [b for b, p in enumerate(spec.params) if p.prompt_logprobs is not None]
    if not asked:
        return out
    assert hidden is not None
    rows = [(b, longest - len(spec.prompt_ids[b]) + t) for b in asked for t in range(len(spec.prompt_ids[b]) - 1)]
    nexts = [spec.prompt_ids[b][t - (longest - len(spec.prompt_ids[b])) + 1] for b, t in rows]
    # Clamped to the vocabulary, as the returned logprobs are (a top-N past V is the whole vocabulary).
    n = min(max(spec.params[b].prompt_logprobs or 0 for b in asked), ends.placement.vocab_size)
    lp = ends.prompt_logprobs(hidden[[b for b, _ in rows], [t for _, t in rows]].float(),
                              torch.tensor(nexts, dtype=torch.int64), n) if rows else None
    per: dict[int, list[list[Logprob] | None]] = {b: [None] for b in asked}
    for j, (b, _) in enumerate(rows):
        assert lp is not None
        per[b].append(lp.row(j, min(spec.params[b].prompt_logprobs or 0, n)))
    for b, lists in per.items():
        out[b] = lists
    return out


# ---- running it ---------------------------------------------------------------------------------------
def generate(spec: GenerateSpec, loaded: LoadedModel) -> GenerateReport:
    """Run the decode loop of ``spec``: in this process at tp 1, on ``spec.tp`` gloo ranks otherwise."""
    outs = [_decode_reported(spec, loaded.model, loaded.tokenizer, rank=0)] if spec.tp == 1 else \
        _on_ranks(spec, loaded)
    out, out_rows = outs[0], [o.head_rows for o in outs] if spec.tp > 1 else []
    tok = loaded.tokenizer
    index = spec.sample_index or (None,) * len(spec.prompts)
    results = [GenerateResult(p, ids, cut_at_stop(tok.decode(ids, skip_special_tokens=True), spec.stop)[0],
                              lps if params.logprobs is not None else None, plps, i)
               for p, ids, lps, params, plps, i in zip(spec.prompts, out.token_ids, out.logprobs, spec.params,
                                                       out.prompt_logprobs, index, strict=True)]
    head = ", ".join(r.value for r in out.ran_on) if spec.artifact is not None else Runtime.TORCH.value
    labels = {g.label for g in spec.grammars if g is not None}
    grammar = None if not labels else labels.pop() if len(labels) == 1 and None not in spec.grammars else \
        "per-prompt grammars"
    return GenerateReport(results, spec.tp, head, sum(len(r) for r in out.token_ids), out.prefill_s, out.decode_s,
                          out.deterministic, grammar, spec.attention_dp, spec.body_ranks, out.compile_s,
                          spec.lm_head_tp if spec.head_groups else 0, tuple(out_rows))


def _on_ranks(spec: GenerateSpec, loaded: LoadedModel) -> list[RankOutput]:
    """The decode on ``spec.tp`` gloo ranks: every rank's output, rank 0's first (what ran and whether it
    was deterministic over all of them), checked against every other rank's ids."""
    # Attention DP: a rank that owns no prompt runs no body, so it is not sent the model
    # (the largest argument by far; unpickling it also imports transformers there).
    blocks = spec.blocks()
    facts = ModelFacts.of(loaded.model, loaded.tokenizer)
    models = [(loaded.model if lo < hi or not spec.attention_dp else None,) for lo, hi in blocks]
    outs = run_ranks(_rank_main, spec.tp, spec, loaded.tokenizer, facts, rank_args=models)
    out = outs[0]
    for r, other in enumerate(outs[1:], start=1):
        if other.token_ids != out.token_ids:  # the sampler promises the same ids everywhere
            raise DistributedError(f"generate: rank {r} produced other token ids than rank 0")
    out.ran_on = sorted({name for o in outs for name in o.ran_on})
    out.deterministic = all(o.deterministic for o in outs)
    return outs


def _rank_main(rank: int, world: int, spec: GenerateSpec, tokenizer: Any, facts: ModelFacts,
               model: Any) -> RankOutput:
    """One rank of a tp > 1 run (spawned by run_ranks: the model arrives in shared memory; None on an
    attention-DP rank that owns no prompt)."""
    quiet_transformers()
    if spec.attention_dp:  # a body rank gets its share of the cores for the body; a vocab-only rank, one
        # rank's share for its head slice (the slices are equal, so a step's head waits on the slowest)
        cores = usable_cores()
        lo, hi = spec.blocks()[rank]
        torch.set_num_threads(max(1, cores // (spec.body_ranks if lo < hi else spec.tp)))
    return _decode_reported(spec, model, tokenizer, rank=rank, facts=facts)


def _decode_reported(spec: GenerateSpec, model: Any, tokenizer: Any, rank: int,
                     facts: ModelFacts | None = None) -> RankOutput:
    """The decode a rank reports, after one untimed decode of the same run where ``spec.warmup`` asks."""
    if spec.warmup:
        _decode(spec, model, tokenizer, rank=rank, facts=facts)
    return _decode(spec, model, tokenizer, rank=rank, facts=facts)


__all__ = ["SETUP_HANDSHAKE", "Batch", "BodyRows", "generate"]
