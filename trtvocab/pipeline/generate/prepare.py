"""From :class:`~trtvocab.pipeline.generate.options.GenerateOptions` (checked when made) to a run: the
artifact checked against the model, the ranks chosen, the model loaded, the prompts encoded
(:func:`prepare` -> :class:`~trtvocab.pipeline.generate.options.GenerateSpec`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from trtvocab.artifact import store as artifacts
from trtvocab.backends import MODULES, canonical, pick_backend
from trtvocab.checkpoints.provenance import head_digest
from trtvocab.errors import ArtifactError, ConfigError, InputError
from trtvocab.parallel.launch import warm_up
from trtvocab.pipeline.generate.model import (
    LoadedModel,
    encode_prompts,
    eos_ids,
    load_model,
    model_path,
    model_shape,
    words_token_ids,
)
from trtvocab.pipeline.generate.options import (
    ArtifactSpec,
    GenerateOptions,
    GenerateSpec,
    choose_body_ranks,
    lora_plan,
)
from trtvocab.sampling import SamplingParams
from trtvocab.sampling.grammar import GrammarSpec, compile_grammar, grammar_spec

# What a rank imports (unpickling the model and tokenizer, opening its head), imported once by the
# ranks' server instead (trtvocab.parallel.launch.warm_up); a model's own modeling_<arch> module
# is small once transformers.modeling_utils is in.
_RANK_MODULES = ("trtvocab.pipeline.generate.loop", "trtvocab.checkpoints.hf_loader", "trtvocab.checkpoints.gguf",
                 "transformers.modeling_utils", "transformers.tokenization_utils_base", "tokenizers")


def artifact_spec(root: str | Path, backend: str, model: Path, tp: int | None,
                  allow_other_checkpoint: bool = False, shape: tuple[int, int] | None = None) -> ArtifactSpec:
    """Check an artifact against the model and pick its backend (:class:`ArtifactError`, naming `` `artifact` ``).

    The artifact must have been built from ``model``'s head (the manifest's ``checkpoint_sha256``,
    :func:`trtvocab.checkpoints.provenance.head_digest`); ``allow_other_checkpoint`` runs it anyway, and the
    report says so. ``shape``: the model's ``(vocab, hidden)`` when the caller has read them."""

    canonical(backend)
    root = Path(root)
    if not root.is_dir():
        raise ArtifactError(f"`artifact` {root}: no such folder (build one with `trtvocab build RECIPE`)")
    manifest = artifacts.read_manifest(root)
    manifest.require_complete(f"`artifact` {root}", "generate")
    if manifest.head.context_logits:
        raise ArtifactError(f"`artifact` {root}: built with context_logits = true (all rows); generate needs "
                            "last-token logits")
    if manifest.mapping.enable_attention_dp:
        raise ArtifactError(f"`artifact` {root}: built for attention DP (ranks hold different requests); generate "
                            "runs one TP group over one batch")
    vocab, hidden = shape if shape is not None else model_shape(model)
    h = manifest.head
    if (h.vocab_size, h.hidden_size) != (vocab, hidden):
        raise ArtifactError(f"`artifact` {root}: its head is vocab {h.vocab_size} x hidden {h.hidden_size}, the "
                            f"model {model.name} is vocab {vocab} x hidden {hidden}")
    note = _provenance(root, manifest, model, allow_other_checkpoint)
    art_tp = manifest.mapping.tp_size
    if tp is not None and tp != art_tp:
        raise ConfigError(f"`tp` {tp}: the artifact {root} is built for tp {art_tp} (omit `tp`, or pass `tp` "
                          f"{art_tp})")
    chosen, usable = pick_backend(manifest, backend)
    notes = [note] if note else []
    # Only auto falls back; a backend the user named is no fallback (the header says it was chosen).
    if canonical(backend) == "auto" and chosen != "tensorrt" and manifest.backends.tensorrt \
            and usable["tensorrt"] is not None:
        notes.append(f"TensorRT engines not run: {usable['tensorrt']}; the head ran on {chosen} instead")
    return ArtifactSpec(str(root.resolve()), chosen, art_tp, "; ".join(notes) or None, manifest)


def _provenance(root: Path, manifest: Any, model: Path, allow: bool) -> str | None:
    """None when the artifact's head is ``model``'s; else refuse (or, allowed, say so)."""

    if manifest.checkpoint_sha256 is None:
        why = ("was built from synthetic weights" if manifest.checkpoint == "synthetic"
               else "records no checkpoint digest")
    else:
        mine = head_digest(model, manifest.head.tensor)
        if mine == manifest.checkpoint_sha256:
            return None
        why = (f"was built from another checkpoint ({manifest.checkpoint}, head sha256 "
               f"{manifest.checkpoint_sha256[:12]}...; {model.name}'s is {mine[:12]}...)")
    if not allow:
        raise ArtifactError(f"`artifact` {root} {why}: its logits are not {model.name}'s head; rebuild it from "
                            "the model, or pass `allow_other_checkpoint` to run it anyway")
    return f"WARNING: the artifact {why}; running it anyway (`allow_other_checkpoint`)"


@dataclasses.dataclass(frozen=True)
class _Rows:
    """The run's rows: a prompt per completion (``n > 1`` repeats it), each with its params, grammar,
    adapter and completion index (the last three empty when none applies)."""

    prompts: tuple[str, ...]
    params: tuple[SamplingParams, ...]
    grammars: tuple[GrammarSpec | None, ...]
    adapters: tuple[int, ...]
    index: tuple[int, ...]

    @classmethod
    def of(cls, options: GenerateOptions, grammars: tuple[GrammarSpec | None, ...],
           adapters: tuple[int, ...]) -> _Rows:
        params = options.per_prompt()
        if not any(p.n > 1 for p in params):
            return cls(tuple(options.prompts), tuple(params), grammars, adapters, ())
        rows = [(b, i) for b, p in enumerate(params) for i in range(p.n)]  # one per completion, own seed stream
        return cls(tuple(options.prompts[b] for b, _ in rows),
                   tuple(params[b].model_copy(update={"seed": params[b].sample_seed(i)}) for b, i in rows),
                   tuple(grammars[b] for b, _ in rows) if grammars else (),
                   tuple(adapters[b] for b, _ in rows) if adapters else (), tuple(i for _, i in rows))


def _ranks(options: GenerateOptions, art: ArtifactSpec | None, rows: int, vocab: int) -> tuple[int, int]:
    """``(tp, body ranks)``: the artifact's tp or the one asked for; the ranks that run a body (attention DP)."""
    ranks = art.tp if art is not None else (options.tp or 1)
    if options.attention_dp and ranks == 1:
        raise ConfigError("`attention_dp` splits the prompts over the ranks: it needs `tp` > 1 (or a tp > 1 "
                          "`artifact`)")
    bodies = choose_body_ranks(ranks, rows, options.body_ranks) if options.attention_dp else 0
    if ranks > vocab:
        raise ConfigError(f"`tp` {ranks}: more ranks than the vocabulary has ids ({vocab})")
    return ranks, bodies


def _encode(options: GenerateOptions, loaded: LoadedModel, rows: _Rows) -> tuple[list[list[int]],
                                                                                   tuple[SamplingParams, ...]]:
    """Each row's prompt ids and its params with the bad words tokenized, checked against the model; every
    distinct grammar compiled once against the tokenizer, before any rank starts (bounded in time, refused
    when it lets the model say nothing; the ranks' compile is then xgrammar's cache at tp 1)."""
    vocab_ids = int(loaded.config.vocab_size)
    stops = eos_ids(loaded.model, loaded.tokenizer)
    for g in dict.fromkeys(g for g in rows.grammars if g is not None):
        compile_grammar(g, loaded.tokenizer, vocab_ids, stops, what=f"`{g.kind}` ({g.label})")
    ids = encode_prompts(loaded.tokenizer, rows.prompts, options.chat)
    params = rows.params
    if options.bad_words:
        banned = tuple(tuple(w) for w in words_token_ids(loaded.tokenizer, list(options.bad_words)))
        params = tuple(p.model_copy(update={"bad_words": p.bad_words + banned}) for p in params)
    for i, p in enumerate(params):
        if p.max_token_id() >= vocab_ids:
            raise InputError(f"params[{i}]: token id {p.max_token_id()} (`logit_bias` / `stop_token_ids` / "
                             f"allowed_token_ids) is outside the vocabulary [0, {vocab_ids})")
    limit = getattr(loaded.config, "max_position_embeddings", None)
    longest = max(len(p) for p in ids)
    if isinstance(limit, int) and longest + options.max_new_tokens > limit:
        raise InputError(f"`max_new_tokens` {options.max_new_tokens}: the longest prompt has {longest} tokens and "
                         f"the model holds at most {limit} positions")
    return ids, params


def prepare(model: str | Path, prompts: GenerateOptions | list[str] | tuple[str, ...] | None,
            **fields: Any) -> tuple[GenerateSpec, LoadedModel]:
    """Load what a run needs and resolve it against the model: the run's spec and the loaded model.

    ``prompts``: a :class:`GenerateOptions` (checked when made), or the prompts, with the other fields of
    :class:`GenerateOptions` by name in ``fields``. What is cheap comes first (the grammar, the adapters'
    headers, the artifact's manifest against the checkpoint's header), then the model loads.
    """
    if isinstance(prompts, GenerateOptions):
        if fields:
            raise InputError(f"prepare: give the fields in the GenerateOptions, not also {sorted(fields)}")
        options = prompts
    else:
        options = GenerateOptions(prompts=prompts if isinstance(prompts, str) else tuple(prompts or ()), **fields)
    path = model_path(model)
    grammar = grammar_spec(options.json_schema, options.regex)
    grammars = options.grammars or ((grammar,) * len(options.prompts) if grammar is not None else ())
    # Adapters by prompt index (before n > 1 repeats the prompts: each completion keeps its prompt's).
    adapters, per_adapter = lora_plan(options.loras, options.lora_for, len(options.prompts),
                                      artifact=options.artifact, attention_dp=options.attention_dp,
                                      deterministic=options.deterministic)
    rows = _Rows.of(options, grammars, per_adapter)
    shape = model_shape(path)  # the checkpoint's header, read once
    art = artifact_spec(options.artifact, options.backend, path, options.tp, options.allow_other_checkpoint,
                        shape) if options.artifact is not None else None
    ranks, bodies = _ranks(options, art, len(rows.prompts), shape[0])
    if ranks > 1:  # the ranks' server imports what they run while this process loads the model
        warm_up(_RANK_MODULES + (MODULES[art.backend] if art is not None else ()))
    loaded = load_model(path)
    ids, params = _encode(options, loaded, rows)
    spec = GenerateSpec(str(path), rows.prompts, tuple(tuple(p) for p in ids), ranks, options.max_new_tokens,
                        params, rows.grammars, art, options.deterministic, bool(options.attention_dp), bodies,
                        options.logits_budget_bytes, adapters, rows.adapters, bool(options.gguf_blocks),
                        tuple(options.stop), rows.index, max(p.beam_width for p in params), options.kv_cache,
                        bool(options.compile_step), bool(options.body_kernels),
                        lm_head_tp=options.lm_head_tp or 0)
    return spec, loaded


__all__ = ["artifact_spec", "prepare"]
