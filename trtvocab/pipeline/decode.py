"""The decode step's vocabulary ends: each rank's input embedding and head with its sampler, as
``trtvocab generate`` drives them (:class:`VocabEnds`, built once per run by :func:`open_vocab_ends`).

``TorchEnds`` runs the model's own head through the prepared step :class:`trtvocab.sampling.DecodeStep`
(kept while the batch composition holds; :func:`trtvocab.sampling.decode_output` where no prepared step
serves: logits over the head's budget, adapters); ``ArtifactEnds`` a built artifact's backend, the ranks
checking in after each step (:data:`STEP_HANDSHAKE`) before each draws with ``DecodeStep.draw``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from trtvocab.backends import open_backend
from trtvocab.base.dtypes import head_dtype
from trtvocab.base.family import HeadOps
from trtvocab.base.formats import Runtime
from trtvocab.checkpoints.checkpoint import open_checkpoint
from trtvocab.embedding import VocabParallelEmbedding, load_tied
from trtvocab.errors import ArtifactError, DistributedError
from trtvocab.lm_head import DEFAULT_LOGITS_BUDGET_BYTES
from trtvocab.parallel import distributed as D
from trtvocab.parallel.mapping import Mapping
from trtvocab.parallel.sharding import VocabPlacement
from trtvocab.sampling import (
    DecodeStep,
    Logprobs,
    SamplerOutput,
    SamplingParams,
    TokenState,
    apply_token_bitmask,
    chunked,
    decode_output,
    prompt_logprobs,
    sample_output,
    streams,
)
from trtvocab.weights.loader import open_head

# What the ranks agree on after every artifact-backend step (protocol:
# trtvocab.parallel.distributed.Handshake): a rank whose backend failed stops the others.
STEP_HANDSHAKE = D.Handshake("generate.head", (D.Field("rows"), D.Field("ran_on", tuple(Runtime), per_rank=True)))
# The fields of a run's spec that open_vocab_ends reads (generate's GenerateSpec has them all).
SPEC_FIELDS = ("model", "artifact", "tp", "deterministic", "gguf_blocks", "logits_budget_bytes", "attention_dp",
               "body_ranks", "loras", "lora_for", "compile_step", "kv_cache")


class VocabEnds:
    """This rank's vocabulary ends of the model, built once per run by :func:`open_vocab_ends`: the
    input embedding (``embed``) and the head with its sampler (``next_ids``), the same ids on every
    rank. :attr:`placement`: where this rank's columns are (what the sampler reads); :attr:`ran_on`:
    what computed the logits so far; :attr:`deterministic`: whether that head gives tp- and
    batch-invariant logits."""

    deterministic: bool = False

    def __init__(self, embedding: Any, placement: VocabPlacement, hidden_size: int, vocab_limit: int | None) -> None:
        self.embedding, self.placement, self.vocab_limit = embedding, placement, vocab_limit
        self.hidden_size = hidden_size
        self.ran_on: set[Runtime] = set()
        self._prepared: tuple[Any, DecodeStep] | None = None  # (the batch it serves, the step)
        self.compile_step = False  # generate's `compile_step`: the prepared step compiled with the body
        self.compile_s = 0.0  # the seconds of the steps during which dynamo compiled the prepared step
        # Each prompt's adapter index (LoRA; None: no adapters), and that of the rows of the next step.
        self.adapter_ids: torch.Tensor | None = None
        self.row_adapters: torch.Tensor | None = None

    def prepared_step(self, owner: Any, params: list[SamplingParams], step: int, bitmask: torch.Tensor | None,
                      state: TokenState | None) -> DecodeStep:
        """The :class:`DecodeStep` of this batch: the last one while the batch is the same (the same params
        objects in the same order, whether a state is read, the bitmask's width, the next step: in a decode
        loop rows only leave, so a new composition has fewer rows), else a new one on a copy of ``state`` (the
        loop appends each step's ids to its own state; the step advances its copy)."""
        width = None if bitmask is None else bitmask.shape[1]
        key = (tuple(id(p) for p in params), state is None, width)
        if self._prepared is not None:
            held, prepared = self._prepared
            if held == key and prepared.next_step == step:
                return prepared
        copy = None if state is None else state.select(list(range(state.rows)))
        prepared = DecodeStep(owner, params, state=copy, bitmask_width=width, start_step=step,
                              vocab_limit=self.vocab_limit)
        if self.compile_step:  # one compiled graph per bucket and knobs (DecodeStep.compile)
            prepared.compile()
        self._prepared = (key, prepared)
        return prepared

    def draw_prepared(self, prepared: DecodeStep, run: Any) -> SamplerOutput:
        """Run one prepared step (``run``: the call) and read its ids (one read; raises what it found)."""
        graphs = _graphs_compiled() if self.compile_step else None
        start = time.perf_counter()
        run()
        ids = prepared.read()
        if graphs is not None and _graphs_compiled() > graphs:
            self.compile_s += time.perf_counter() - start
        out = prepared.last_output
        assert out is not None
        return SamplerOutput(torch.tensor(ids, dtype=torch.int64), out.logprobs)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [B, S]`` -> ``[B, S, H]``: own rows looked up, the rest all-reduced (exact); under
        attention DP a body rank's replicated table, its own prompts only, no meeting."""
        if self.embedding is None:
            raise DistributedError("generate: an attention-DP rank without a body has no input embedding")
        if self.adapter_ids is not None:
            return self.embedding(ids, self.adapter_ids)
        return self.embedding(ids)

    def next_ids(self, rows: torch.Tensor, params: list[SamplingParams], step: int, bitmask: torch.Tensor | None,
                 state: TokenState | None = None) -> SamplerOutput:  # pragma: no cover - abstract
        """The next id of each row of ``rows [b, H]`` (the last hidden rows) and the logprobs its params
        ask for: this rank's columns, xgrammar's ``bitmask`` (or None), the draw (``state``: the rows'
        per-rank token counts, for penalties, bad words and min tokens)."""
        raise NotImplementedError

    def local_logits(self, rows: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """This rank's float32 ``[b, V_local]`` logits of ``rows [b, H]`` (beam search reads them whole)."""
        raise NotImplementedError

    def prompt_logprobs(self, rows: torch.Tensor, token_ids: torch.Tensor,
                        n: int) -> Logprobs:  # pragma: no cover - abstract
        """vLLM's prompt logprobs of the hidden rows ``rows [T, H]`` (``token_ids [T]``: each row's next
        prompt token), top-``n``, never ``[T, V_local]`` beyond the logits budget."""
        raise NotImplementedError


class TorchEnds(VocabEnds):
    """The model's own head: :func:`trtvocab.sampling.decode` (one validated, handshaken step; the
    vocab streamed in chunks when the float32 ``[b, V_local]`` logits exceed the head's budget)."""

    def __init__(self, embedding: Any, head: Any, vocab_limit: int | None) -> None:
        super().__init__(embedding, head.placement, head.hidden_size, vocab_limit)
        self.head = head
        self.deterministic = bool(head.deterministic)

    def local_logits(self, rows: torch.Tensor) -> torch.Tensor:
        self.ran_on.add(Runtime.TORCH)
        return self.head.local_logits(rows).float()

    def prompt_logprobs(self, rows: torch.Tensor, token_ids: torch.Tensor, n: int) -> Logprobs:
        """The head's logits in chunks its budget holds (``sampling.chunked.stream_prompt_logprobs``)."""

        self.ran_on.add(Runtime.TORCH)
        return chunked.stream_prompt_logprobs(rows, self.head, token_ids, n)

    def next_ids(self, rows: torch.Tensor, params: list[SamplingParams], step: int, bitmask: torch.Tensor | None,
                 state: TokenState | None = None) -> SamplerOutput:

        self.ran_on.add(Runtime.TORCH)
        if self.row_adapters is None and not self.head.added_vocab and not streams(self.head, rows.shape[0]):
            prepared = self.prepared_step(self.head, params, step, bitmask, state)
            return self.draw_prepared(prepared, lambda: prepared(rows.to(self.head.dtype), bitmask))
        with self.head.use_adapters(self.row_adapters):
            return decode_output(rows, self.head, params, step=step, vocab_limit=self.vocab_limit, bitmask=bitmask,
                                 state=state)


class ArtifactEnds(VocabEnds):
    """A built artifact's head: the backend computes this rank's float32 ``[b, V_local]`` columns
    (an engine returns its logits: nothing to stream), the ranks check in (:data:`STEP_HANDSHAKE`),
    then each masks its columns and draws (``sampling.apply_token_bitmask``, ``sampling.sample``) on
    the artifact's placement (``Manifest.placement``): the model's head is never loaded."""

    def __init__(self, embedding: Any, placement: VocabPlacement, hidden_size: int, vocab_limit: int | None,
                 backend: Any, dtype: torch.dtype, world: int, deterministic: bool, logits_budget_bytes: int) -> None:
        super().__init__(embedding, placement, hidden_size, vocab_limit)
        self.backend, self.dtype, self.world = backend, dtype, world
        self.deterministic = deterministic
        self.logits_budget_bytes = logits_budget_bytes

    def next_ids(self, rows: torch.Tensor, params: list[SamplingParams], step: int, bitmask: torch.Tensor | None,
                 state: TokenState | None = None) -> SamplerOutput:

        logits = self._logits(rows)
        if self.placement.added is None:
            prepared = self.prepared_step(self.placement, params, step, bitmask, state)
            return self.draw_prepared(prepared, lambda: prepared.draw(logits, bitmask))
        if bitmask is not None:
            apply_token_bitmask(logits, bitmask, self.placement)
        return sample_output(logits, self.placement, params, step=step, vocab_limit=self.vocab_limit, state=state)

    def prompt_logprobs(self, rows: torch.Tensor, token_ids: torch.Tensor, n: int) -> Logprobs:
        """As :meth:`VocabEnds.prompt_logprobs`, the backend's logits of as many rows at a time as the
        head's budget holds (the same on every rank: the same groups and collectives)."""

        widest = max(s.size for s in self.placement.shards)
        group = max(1, self.logits_budget_bytes // (4 * max(1, widest)))
        parts = [prompt_logprobs(self._logits(rows[g : g + group]), self.placement, token_ids[g : g + group], n)
                 for g in range(0, rows.shape[0], group)]
        return Logprobs(*(torch.cat([getattr(p, f) for p in parts]) for f in ("ids", "values", "ranks")))

    def local_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's float32 ``[b, V_local]`` logits from the backend."""
        return self._logits(rows)

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's float32 ``[b, V_local]`` from the backend; the ranks check in first (at tp > 1)."""
        error: Exception | None = None
        local: Any = None
        try:
            local = self.backend.rank_logits(rows.to(self.dtype), torch.ones(rows.shape[0], dtype=torch.int64))
        except Exception as exc:
            if self.world == 1:
                raise
            error = exc
        if self.world > 1:
            values = None if error is not None else {"rows": local.logits.shape[0], "ran_on": local.ran_on}
            STEP_HANDSHAKE.exchange(values, error, None, world=self.world, what="generate (artifact head)")
        self.ran_on.add(Runtime(local.ran_on))
        return local.logits


def _check_artifact_head(source: Any, manifest: Any, tp: int) -> None:
    """Refuse an artifact built for another head than the model's (``source``: its probed head)."""
    if (source.vocab_size, source.hidden_size) != (manifest.head.vocab_size, manifest.head.hidden_size) \
            or manifest.mapping.tp_size != tp:
        raise ArtifactError(f"`artifact`: built for a [{manifest.head.vocab_size}, {manifest.head.hidden_size}] head "
                            f"at tp {manifest.mapping.tp_size}; the model's head is [{source.vocab_size}, "
                            f"{source.hidden_size}] at tp {tp}")
    ops = source.family.head if source.family is not None else HeadOps()
    if manifest.head.family.head != ops:
        raise ArtifactError(f"`artifact`: its head computes {manifest.head.family.head.describe()}, the model's head "
                            f"{ops.describe()} (built from another checkpoint?)")


def open_vocab_ends(spec: Any, rank: int, mapping: Mapping | None, vocab_limit: int | None,
                    body: bool | None = None) -> VocabEnds:
    """This rank's :class:`VocabEnds`. Without an artifact: the checkpoint opened once (``load_tied``: one
    shard buffer for both ends of a tied model). With one (its manifest is the one ``generate``'s ``prepare`` read,
    ``spec.artifact.manifest``): the embedding in the artifact's layout, the head's checkpoint probed
    (headers only: its shard is never read) and the sampler on the manifest's placement. ``spec``: a
    :class:`trtvocab.pipeline.generate.GenerateSpec`, read for the fields :data:`SPEC_FIELDS` names.
    ``body`` (attention DP): whether this rank runs a body (None: ``rank < spec.body_ranks``)."""

    art = spec.artifact
    manifest = art.manifest if art is not None else None
    layout: Any = manifest.head.vocab_layout if manifest is not None else "uneven"
    pad_to = manifest.head.pad_to if manifest is not None else 64
    embedding: Any = None
    if spec.attention_dp and mapping is not None:
        # Attention DP (as TensorRT-LLM: the embedding is not split there): a body rank looks up its own
        # prompts in a replicated table, so a step meets nobody before the body; a rank without a body
        # needs no embedding. Lookups are exact either way, so the tokens are those of tp 1.
        embedding = VocabParallelEmbedding.from_checkpoint(spec.model, mapping=None, dtype=torch.float32) \
            if (rank < spec.body_ranks if body is None else body) else None
    if art is None:
        # LMHead refuses deterministic=True for a quantized head (a ConfigError naming it).
        tied, head = load_tied(spec.model, mapping=mapping, dtype=torch.float32, vocab_layout=layout, pad_to=pad_to,
                               gather_output=False, deterministic=spec.deterministic, gguf_blocks=spec.gguf_blocks)
        if spec.logits_budget_bytes is not None:
            head.logits_budget_bytes = spec.logits_budget_bytes
        if not (spec.attention_dp and mapping is not None):
            embedding = tied
        ends = TorchEnds(embedding, head, vocab_limit)
        for name, folder in spec.loras:  # both ends share one numbering: an adapter's index on each
            embedding.load_adapter(folder, name=name)
            head.load_adapter(folder, name=name)
        if spec.loras:
            ends.adapter_ids = torch.tensor(spec.lora_for, dtype=torch.int64)
        ends.compile_step = bool(spec.compile_step) and spec.kv_cache == "static"
        return ends

    ckpt = open_checkpoint(spec.model)  # opened once: the head's headers, the embedding's rows
    source = open_head(ckpt, mapping=mapping, gguf_blocks=spec.gguf_blocks)  # headers only
    _check_artifact_head(source, manifest, spec.tp)
    placement = manifest.placement(rank)
    if embedding is None and not (spec.attention_dp and mapping is not None):
        embedding = VocabParallelEmbedding.from_checkpoint(ckpt, mapping=mapping, dtype=torch.float32,
                                                           vocab_layout=layout, pad_to=pad_to,
                                                           gguf_blocks=spec.gguf_blocks)
    backend = open_backend(art.backend, Path(art.root), manifest, rank)
    # The PyTorch fallback of a deterministic build is bitwise tp/batch-invariant; engines promise less.
    deterministic = bool(manifest.head.deterministic) and art.backend == "torch"
    budget = DEFAULT_LOGITS_BUDGET_BYTES if spec.logits_budget_bytes is None else spec.logits_budget_bytes
    ends = ArtifactEnds(embedding, placement, source.hidden_size, vocab_limit, backend,
                        head_dtype(manifest.head.dtype), spec.tp, deterministic, budget)
    ends.compile_step = bool(spec.compile_step) and spec.kv_cache == "static"
    return ends




def _graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process so far (torch's own counter)."""
    from torch._dynamo.utils import counters  # torch's own counter (what the compile tests read)

    return int(counters["stats"]["unique_graphs"])


__all__ = ["SPEC_FIELDS", "STEP_HANDSHAKE", "ArtifactEnds", "TorchEnds", "VocabEnds", "open_vocab_ends"]
