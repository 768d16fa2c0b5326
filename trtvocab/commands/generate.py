"""The decode loop: ``ids -> embedding -> body -> last rows -> head -> sampler -> ids``, every step.

The transformer body (attention, MLPs, the final norm) runs in ``transformers`` with its KV
cache, whole and unsplit, on every rank (with ``attention_dp``: on each rank for its own block
of prompts, the last hidden rows gathered). The vocabulary dimension runs in trtvocab on the
``tp`` ranks, and that is where the ranks meet::

    input ids [B, S]  -> VocabParallelEmbedding       masked lookup of own rows, all-reduce (SUM)
    inputs_embeds     -> model.model(...)             the body, KV cache, on every rank (no collective)
    last rows [B, H]  -> LogitsProcessor + LMHead     this rank's columns, float32 [B, V_local]
                         (or an artifact's backend: open_backend(...).rank_logits)
    (xgrammar)        -> apply_token_bitmask          each rank masks its own columns
    next ids [B]      -> sample                       Gumbel race: [tp, B] (score, id) pairs cross

so per step exactly two things cross ranks: the embedding rows of the new ids and each rank's
best ``(score, id)`` per row; the ``[B, V]`` logits are never gathered. Every rank ends up with
the same ids, feeds them to its own body, and the next step starts.

Batching (as ``transformers.generate`` does it, so that greedy output is token-identical):
prompts are left-padded; prefill positions are ``cumsum(mask) - 1`` (0 on padding) and the
mask is dropped when nothing is padded; each decode step extends the mask by one and the
positions by one. The head sees the packed non-padding rows of the prefill with their
``seq_lens`` (the LogitsProcessor takes each sequence's last row), then one row per
unfinished prompt. A prompt stops at an end-of-sequence id (the model's generation config,
else the tokenizer's; the id is kept in ``token_ids``) or after ``max_new_tokens``; a finished
prompt stays in the body's batch (fed padding, as ``generate`` does) but produces no more tokens.

Structured output: one ``xgrammar.GrammarMatcher`` per constrained prompt on every rank,
compiled against the tokenizer with the model's config vocab (the CLI constrains every prompt;
the Python API takes one grammar per prompt, or none); each step fills the bitmask of the
unfinished rows (all ones for an unconstrained row) and every rank applies it to its own
columns (:mod:`trtvocab.commands.grammar`: the checks, limits and matchers). JSON schemas compile with
``any_whitespace=False`` (:data:`trtvocab.commands.grammar.JSON_ANY_WHITESPACE`): compact JSON.

``tp == 1`` runs in this process (a replicated head); ``tp > 1`` starts ``tp`` gloo ranks with
:func:`trtvocab.parallel.launch.run_ranks`, which receive the loaded body in shared memory (it is not
loaded again); each rank reads only its own rows of the vocabulary matrix (``load_tied``).
Everything that can be refused is refused before any rank starts (:func:`prepare`): typed
errors naming the argument.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from pathlib import Path
from typing import Any

import torch

from trtvocab.commands.grammar import GrammarSpec, RowGrammars, check_grammar, compile_grammar, grammar_spec
from trtvocab.errors import ArtifactError, CheckpointError, ConfigError, DistributedError, InputError
from trtvocab.parallel import distributed as D
from trtvocab.parallel.mapping import Mapping
from trtvocab.parallel.sharding import calc_shard
from trtvocab.sampling import SamplingParams

RAN_ON = ("torch", "onnxruntime", "onnx.reference", "tensorrt")
# What the ranks agree on once their setup is done, and after every artifact-backend step
# (protocol: trtvocab.parallel.distributed.Handshake): a rank whose setup or backend failed stops the others.
SETUP_HANDSHAKE = D.Handshake("generate", (D.Field("vocab_size"), D.Field("hidden_size"), D.Field("prompts")))
STEP_HANDSHAKE = D.Handshake("generate.head", (D.Field("rows"), D.Field("ran_on", RAN_ON, per_rank=True)))
_PARAM_OPTIONS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
                  "seed": "--seed"}


# ---- what a run is ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ArtifactSpec:
    """A built head artifact the loop runs instead of the model's own head."""

    root: str
    backend: str  # canonical, chosen (torch | onnx | tensorrt)
    tp: int
    note: str | None = None  # why auto did not take the artifact's TensorRT engines


@dataclasses.dataclass(frozen=True)
class GenerateSpec:
    """One validated run (picklable: it travels to the ranks)."""

    model: str
    prompts: tuple[str, ...]
    prompt_ids: tuple[tuple[int, ...], ...]
    tp: int
    max_new_tokens: int
    params: tuple[SamplingParams, ...]  # one per prompt
    grammars: tuple[GrammarSpec | None, ...] = ()  # one per prompt (empty: none)
    artifact: ArtifactSpec | None = None
    deterministic: bool = False
    # Attention DP (tp > 1): rank r runs the body for its own block of prompts only; the last
    # hidden rows are gathered and the vocabulary stays split (TensorRT-LLM's
    # enable_lm_head_tp_in_adp). Off: every rank runs the whole body on every prompt.
    attention_dp: bool = False


@dataclasses.dataclass
class GenerateResult:
    """One prompt's answer: the generated ids only (an end-of-sequence id included) and their text."""

    prompt: str
    token_ids: list[int]
    text: str


@dataclasses.dataclass
class GenerateReport:
    """What :func:`generate` returns."""

    results: list[GenerateResult]
    tp: int
    head: str  # what computed the logits: "torch" (the model's head) or the artifact's runtime(s)
    new_tokens: int
    prefill_s: float
    decode_s: float
    deterministic: bool  # whether the head really ran in deterministic mode
    grammar: str | None = None
    attention_dp: bool = False  # tp > 1: the body ran data-parallel (else every rank ran all of it)

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        """``{"results": [{"prompt", "token_ids", "text"}, ...]}``: what ``generate --json`` prints."""
        return {"results": [{"prompt": r.prompt, "token_ids": r.token_ids, "text": r.text} for r in self.results]}


@dataclasses.dataclass
class _RankOutput:
    token_ids: list[list[int]]
    ran_on: list[str]
    prefill_s: float
    decode_s: float
    deterministic: bool


# ---- loading the model -----------------------------------------------------------------------------
@dataclasses.dataclass
class LoadedModel:
    """A causal LM from ``transformers`` (float32, eval mode) and its tokenizer."""

    path: str
    model: Any
    tokenizer: Any

    @property
    def config(self) -> Any:
        return self.model.config


def model_path(model: str | Path) -> Path:
    """MODEL as given: an HF causal-LM directory or a ``.gguf`` file; :class:`InputError` otherwise."""
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InputError(f"MODEL {path}: a folder without config.json (expected an HF causal-LM directory)")
        return path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.exists():
        raise InputError(f"MODEL {path}: expected an HF causal-LM directory or a .gguf file")
    raise InputError(f"MODEL {path}: no such file or directory")


def _quiet_transformers() -> Any:
    """``transformers``, offline and quiet (:func:`trtvocab.commands.hf_loader.quiet_transformers`)."""
    from trtvocab.commands.hf_loader import quiet_transformers

    return quiet_transformers()


def _cache_key(path: Path) -> tuple[str, int, int]:
    st = path.stat() if path.is_file() else (path / "config.json").stat()
    return str(path), st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=2)
def _load_cached(key: tuple[str, int, int]) -> LoadedModel:
    """The model at ``key[0]`` through :func:`trtvocab.commands.hf_loader.load_causal_lm` (the loader ``hidden``
    uses: offline, safetensors or GGUF only, never a pickle; a model that is not a causal LM is refused
    by name), float32, in eval mode, with the decoder stack ``model.model`` the loop drives."""
    from trtvocab.commands.hf_loader import load_causal_lm

    path = Path(key[0])
    tokenizer, model = load_causal_lm(path, dtype=torch.float32, label="MODEL")
    if not hasattr(model, "model"):
        raise CheckpointError(f"MODEL {path}: loads as {type(model).__name__}, which has no decoder stack "
                              "`.model` (expected a Llama-style *ForCausalLM: embed_tokens, layers, norm)")
    model.eval()
    return LoadedModel(str(path), model, tokenizer)


def load_model(model: str | Path) -> LoadedModel:
    """The model and tokenizer at ``model`` (offline), loaded once per process and file version."""
    return _load_cached(_cache_key(model_path(model)))


# ---- validation ---------------------------------------------------------------------------------------
def sampling_params(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                    seed: int | None = None) -> SamplingParams:
    """:class:`SamplingParams` from the CLI's options; an error names the option (``--top-p``)."""
    try:
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    except InputError as exc:
        text = str(exc)
        for field, option in _PARAM_OPTIONS.items():
            if text.startswith(f"SamplingParams.{field}:"):
                raise InputError(f"{option}:{text.split(':', 1)[1]}") from None
        raise


def _model_shape(path: Path) -> tuple[int, int]:
    """``(vocab, hidden)`` from the checkpoint's header (no weights read)."""
    from trtvocab.checkpoints.checkpoint import open_checkpoint

    config = open_checkpoint(path).config
    try:
        return int(config["vocab_size"]), int(config["hidden_size"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"MODEL {path}: its config has no vocab_size / hidden_size") from None


def artifact_spec(root: str | Path, backend: str, model: Path, tp: int | None,
                  allow_other_checkpoint: bool = False) -> ArtifactSpec:
    """Check an artifact against the model and pick its backend (:class:`ArtifactError`, naming ``--artifact``).

    The artifact must have been built from ``model``'s head (the manifest's ``checkpoint_sha256``,
    :func:`trtvocab.checkpoints.provenance.head_digest`); ``allow_other_checkpoint`` runs it anyway, and the
    report says so."""
    from trtvocab.artifact import store as artifacts
    from trtvocab.backends import canonical, pick_backend

    canonical(backend)
    root = Path(root)
    if not root.is_dir():
        raise ArtifactError(f"--artifact {root}: no such folder (build one with `trtvocab build RECIPE`)")
    manifest = artifacts.read_manifest(root)
    if not manifest.complete:
        raise ArtifactError(f"--artifact {root}: holds ranks {manifest.ranks_built} of tp {manifest.mapping.tp_size}; "
                            "generate needs all of them")
    if manifest.head.context_logits:
        raise ArtifactError(f"--artifact {root}: built with context_logits = true (all rows); generate needs "
                            "last-token logits")
    if manifest.mapping.enable_attention_dp:
        raise ArtifactError(f"--artifact {root}: built for attention DP (ranks hold different requests); generate "
                            "runs one TP group over one batch")
    vocab, hidden = _model_shape(model)
    h = manifest.head
    if (h.vocab_size, h.hidden_size) != (vocab, hidden):
        raise ArtifactError(f"--artifact {root}: its head is vocab {h.vocab_size} x hidden {h.hidden_size}, the model "
                            f"{model.name} is vocab {vocab} x hidden {hidden}")
    note = _provenance(root, manifest, model, allow_other_checkpoint)
    art_tp = manifest.mapping.tp_size
    if tp is not None and tp != art_tp:
        raise ConfigError(f"--tp {tp}: the artifact {root} is built for tp {art_tp} (omit --tp, or pass --tp {art_tp})")
    chosen, usable = pick_backend(manifest, backend)
    notes = [note] if note else []
    if chosen != "tensorrt" and manifest.backends.tensorrt and usable["tensorrt"] is not None:
        notes.append(f"TensorRT engines not run: {usable['tensorrt']}; the head ran on {chosen} instead")
    return ArtifactSpec(str(root.resolve()), chosen, art_tp, "; ".join(notes) or None)


def _provenance(root: Path, manifest: Any, model: Path, allow: bool) -> str | None:
    """None when the artifact's head is ``model``'s; else refuse (or, allowed, say so)."""
    from trtvocab.checkpoints.provenance import head_digest

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
        raise ArtifactError(f"--artifact {root} {why}: its logits are not {model.name}'s head; rebuild it from "
                            "the model, or pass --allow-other-checkpoint to run it anyway")
    return f"WARNING: the artifact {why}; running it anyway (--allow-other-checkpoint)"


def check_options(*, max_new_tokens: int, tp: int | None, prompts: list[str] | tuple[str, ...] | None,
                  backend: str, artifact: str | Path | None, deterministic: bool) -> None:
    """The checks that need nothing loaded."""
    from trtvocab.backends import CHOICES, canonical

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"--max-new-tokens: must be an int >= 1, got {max_new_tokens!r}")
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        raise ConfigError(f"--tp: must be an int >= 1 (local gloo ranks), got {tp!r}")
    if not prompts:
        raise InputError("--prompt: give at least one prompt")
    name = canonical(backend)
    if name != "torch" and artifact is None:
        raise ConfigError(f"--backend {backend}: runs a built head; give --artifact DIR (trtvocab build RECIPE), "
                          f"or use --backend torch for the model's own head (choices: {CHOICES})")
    if deterministic and artifact is not None:
        raise ConfigError("--deterministic: applies to the head loaded from MODEL; an artifact's head is fixed at "
                          "build time (drop --artifact or --deterministic)")


def encode_prompts(tokenizer: Any, prompts: list[str] | tuple[str, ...], chat: bool) -> list[list[int]]:
    """Each prompt's ids: as the tokenizer encodes it, or through its chat template (``--chat``)."""
    out = []
    if chat and not getattr(tokenizer, "chat_template", None):
        raise InputError("--chat: the tokenizer has no chat template")
    for i, text in enumerate(prompts):
        if not isinstance(text, str):
            raise InputError(f"--prompt {i + 1}: expected text, got {type(text).__name__}")
        if chat:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                     add_generation_prompt=True)
            ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        if not ids:
            raise InputError(f"--prompt {i + 1} ({text!r}): encodes to no tokens")
        out.append([int(t) for t in ids])
    return out


def prepare(
    model: str | Path,
    prompts: list[str] | tuple[str, ...],
    *,
    chat: bool = False,
    tp: int | None = None,
    max_new_tokens: int = 32,
    params: SamplingParams | list[SamplingParams] | None = None,
    json_schema: str | Path | None = None,
    regex: str | None = None,
    grammars: list[GrammarSpec | None] | None = None,
    deterministic: bool = False,
    backend: str = "torch",
    artifact: str | Path | None = None,
    allow_other_checkpoint: bool = False,
    attention_dp: bool = False,
) -> tuple[GenerateSpec, LoadedModel]:
    """Validate everything, then load the model: the run's spec and the loaded model.

    ``params``: one :class:`SamplingParams` for every prompt, or one per prompt; default greedy.
    ``json_schema`` / ``regex`` constrain every prompt; ``grammars`` (from :func:`grammar_spec`)
    gives one grammar (or None) per prompt instead.
    Cheap checks (options, the grammar, the artifact's manifest against the checkpoint's
    header) come before the model is loaded.
    """
    check_options(max_new_tokens=max_new_tokens, tp=tp, prompts=prompts, backend=backend, artifact=artifact,
                  deterministic=deterministic)
    path = model_path(model)
    per_prompt = _per_prompt(params, len(prompts))
    grammar = grammar_spec(json_schema, regex)
    if grammars is not None:
        if grammar is not None:
            raise InputError("grammars: give either one grammar per prompt or --json-schema / --regex, not both")
        if len(grammars) != len(prompts) or not all(g is None or isinstance(g, GrammarSpec) for g in grammars):
            raise InputError(f"grammars: expected one GrammarSpec or None per prompt ({len(prompts)})")
        for i, g in enumerate(grammars):
            if g is not None:
                check_grammar(g, f"grammars[{i}] ({g.label})")
        per_grammar = tuple(grammars)
    else:
        per_grammar = (grammar,) * len(prompts) if grammar is not None else ()
    art = artifact_spec(artifact, backend, path, tp, allow_other_checkpoint) if artifact is not None else None
    ranks = art.tp if art is not None else (tp or 1)
    if attention_dp and ranks == 1:
        raise ConfigError("--attention-dp splits the prompts over the ranks: it needs --tp > 1 (or a tp > 1 "
                          "--artifact)")
    vocab, _ = _model_shape(path)
    if ranks > vocab:
        raise ConfigError(f"--tp {ranks}: more ranks than the vocabulary has ids ({vocab})")
    loaded = load_model(path)
    # Every distinct grammar compiled once against the tokenizer, before any rank starts: bounded in time,
    # refused when it lets the model say nothing (the ranks' compile is then xgrammar's cache at tp 1).
    stops = _eos_ids(loaded.model, loaded.tokenizer)
    for g in dict.fromkeys(g for g in per_grammar if g is not None):
        compile_grammar(g, loaded.tokenizer, int(loaded.config.vocab_size), stops,
                        what=f"--{g.kind.replace('_', '-')} ({g.label})")
    ids = encode_prompts(loaded.tokenizer, prompts, chat)
    limit = getattr(loaded.config, "max_position_embeddings", None)
    longest = max(len(p) for p in ids)
    if isinstance(limit, int) and longest + max_new_tokens > limit:
        raise InputError(f"--max-new-tokens {max_new_tokens}: the longest prompt has {longest} tokens and the model "
                         f"holds at most {limit} positions")
    spec = GenerateSpec(str(path), tuple(prompts), tuple(tuple(p) for p in ids), ranks, max_new_tokens,
                        tuple(per_prompt), per_grammar, art, deterministic, bool(attention_dp))
    return spec, loaded


def _per_prompt(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams(temperature=0.0)] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, list | tuple) and len(params) == n and all(isinstance(p, SamplingParams) for p in params):
        return list(params)
    raise InputError(f"params: expected a SamplingParams or one per prompt ({n}), got {params!r}"[:300])


# ---- running it ---------------------------------------------------------------------------------------
def generate(spec: GenerateSpec, loaded: LoadedModel) -> GenerateReport:
    """Run the decode loop of ``spec``: in this process at tp 1, on ``spec.tp`` gloo ranks otherwise."""
    if spec.tp == 1:
        out = _decode(spec, loaded.model, loaded.tokenizer, rank=0)
    else:
        from trtvocab.parallel.launch import run_ranks

        # Attention DP: a rank that owns no prompt runs no body, so it is not sent the model
        # (the largest argument by far; unpickling it also imports transformers there).
        owns = [calc_shard(len(spec.prompts), spec.tp, r + 1) > calc_shard(len(spec.prompts), spec.tp, r)
                for r in range(spec.tp)]
        facts = _ModelFacts.of(loaded.model, loaded.tokenizer)
        models = [(loaded.model if owns[r] or not spec.attention_dp else None,) for r in range(spec.tp)]
        outs = run_ranks(_rank_main, spec.tp, spec, loaded.tokenizer, facts, rank_args=models)
        out = outs[0]
        for r, other in enumerate(outs[1:], start=1):
            if other.token_ids != out.token_ids:  # the sampler promises the same ids everywhere
                raise DistributedError(f"generate: rank {r} produced other token ids than rank 0")
        out.ran_on = sorted({name for o in outs for name in o.ran_on})
    tok = loaded.tokenizer
    results = [GenerateResult(p, ids, tok.decode(ids, skip_special_tokens=True))
               for p, ids in zip(spec.prompts, out.token_ids, strict=True)]
    head = ", ".join(out.ran_on) if spec.artifact is not None else "torch"
    labels = {g.label for g in spec.grammars if g is not None}
    grammar = None if not labels else labels.pop() if len(labels) == 1 and None not in spec.grammars else \
        "per-prompt grammars"
    return GenerateReport(results, spec.tp, head, sum(len(r) for r in out.token_ids), out.prefill_s, out.decode_s,
                          out.deterministic, grammar, spec.attention_dp)


def _rank_main(rank: int, world: int, spec: GenerateSpec, tokenizer: Any, facts: _ModelFacts,
               model: Any) -> _RankOutput:
    """One rank of a tp > 1 run (spawned by run_ranks: the model arrives in shared memory; None on an
    attention-DP rank that owns no prompt)."""
    _quiet_transformers()
    return _decode(spec, model, tokenizer, rank=rank, facts=facts)


@dataclasses.dataclass(frozen=True)
class _ModelFacts:
    """What every rank needs of the model besides its body (a rank without a body has only this)."""

    vocab_size: int
    hidden_size: int
    eos: frozenset[int]
    pad: int

    @classmethod
    def of(cls, model: Any, tokenizer: Any) -> _ModelFacts:
        eos = _eos_ids(model, tokenizer)
        return cls(int(model.config.vocab_size), int(model.config.hidden_size), frozenset(eos),
                   _pad_id(model, tokenizer, eos))


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])}


def _pad_id(model: Any, tokenizer: Any, eos: set[int]) -> int:
    for pad in (tokenizer.pad_token_id, getattr(model.generation_config, "pad_token_id", None)):
        if pad is not None:
            return int(pad)
    return min(eos) if eos else 0


class _Body:
    """``model.model`` (the decoder stack + final norm) with its KV cache, under either kwarg name."""

    def __init__(self, model: Any) -> None:
        self.body = model.model
        names = inspect.signature(self.body.forward).parameters
        self.cache_kw = "cache" if "cache" in names else "past_key_values"
        self.cache: Any = None

    def __call__(self, embeds: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        out = self.body(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=True,
                        **{self.cache_kw: self.cache})
        cache = getattr(out, "cache", None)
        self.cache = cache if cache is not None else out.past_key_values
        return out.last_hidden_state


def _load_vocab_ends(spec: GenerateSpec, rank: int, mapping: Mapping | None) -> tuple[Any, Any, bool]:
    """``(embedding, head, deterministic)`` of this rank, the artifact's layout where there is one."""
    from trtvocab.embedding import load_tied

    layout: Any = "uneven"
    pad_to = 64
    manifest = None
    if spec.artifact is not None:
        from trtvocab.artifact import store as artifacts

        manifest = artifacts.read_manifest(Path(spec.artifact.root), verify=False)  # verified by prepare
        layout, pad_to = manifest.head.vocab_layout, manifest.head.pad_to
    # LMHead refuses deterministic=True for a quantized head (a ConfigError naming it).
    embedding, head = load_tied(spec.model, mapping=mapping, dtype=torch.float32, vocab_layout=layout, pad_to=pad_to,
                                gather_output=False, deterministic=spec.deterministic)
    deterministic = spec.deterministic
    if manifest is not None:
        entry = manifest.entry(rank)
        if (entry.start, entry.end) != (head.vocab_start, head.vocab_end):
            raise ArtifactError(f"--artifact: rank {rank} holds columns [{entry.start}, {entry.end}), the model's "
                                f"shard is [{head.vocab_start}, {head.vocab_end})")
    return embedding, head, deterministic


def _decode(spec: GenerateSpec, model: Any, tokenizer: Any, rank: int, facts: _ModelFacts | None = None) -> _RankOutput:
    from trtvocab.logits import LogitsProcessor
    from trtvocab.sampling import apply_token_bitmask, decode, sample

    split = spec.tp > 1
    mapping = Mapping(world_size=spec.tp, rank=rank, tp_size=spec.tp) if split else None
    error: Exception | None = None
    try:
        embedding, head, deterministic = _load_vocab_ends(spec, rank, mapping)
        backend = None
        if spec.artifact is not None:
            from trtvocab.artifact import store as artifacts
            from trtvocab.backends import open_backend
            from trtvocab.base.dtypes import head_dtype

            manifest = artifacts.read_manifest(Path(spec.artifact.root), verify=False)
            backend = open_backend(spec.artifact.backend, Path(spec.artifact.root), manifest, rank)
            backend_dtype = head_dtype(manifest.head.dtype)
        facts = facts or _ModelFacts.of(model, tokenizer)
        grammar = RowGrammars(spec.grammars, tokenizer, facts.vocab_size, set(facts.eos)) \
            if any(g is not None for g in spec.grammars) else None
    except Exception as exc:
        if not split:
            raise
        error = exc
    if split:
        values = None if error is not None else {"vocab_size": head.vocab_size, "hidden_size": head.hidden_size,
                                                 "prompts": len(spec.prompts)}
        SETUP_HANDSHAKE.exchange(values, error, None, world=spec.tp, what="generate (setup)")

    facts = facts or _ModelFacts.of(model, tokenizer)
    eos, pad, config_vocab = set(facts.eos), facts.pad, facts.vocab_size
    vocab_limit = len(tokenizer) if len(tokenizer) < config_vocab else None
    processor = LogitsProcessor()
    body = _Body(model) if model is not None else None
    batch = len(spec.prompt_ids)
    longest = max(len(p) for p in spec.prompt_ids)
    ids = torch.full((batch, longest), pad, dtype=torch.int64)
    mask = torch.zeros((batch, longest), dtype=torch.int64)
    for b, p in enumerate(spec.prompt_ids):
        ids[b, longest - len(p):] = torch.tensor(p, dtype=torch.int64)
        mask[b, longest - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    padded = not bool(mask.all())
    generated: list[list[int]] = [[] for _ in range(batch)]
    active = list(range(batch))
    ran_on: set[str] = set()
    # The prompts whose body this rank runs: all of them, or (attention DP) its own block.
    adp = spec.attention_dp and split
    lo, hi = (calc_shard(batch, spec.tp, rank), calc_shard(batch, spec.tp, rank + 1)) if adp else (0, batch)
    body_mask = mask[lo:hi]

    def head_logits(hidden: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        if backend is None:
            return processor(hidden, head, seq_lens)
        err: Exception | None = None
        local: Any = None
        try:
            local = backend.rank_logits(hidden.to(backend_dtype), seq_lens)
        except Exception as exc:
            if not split:
                raise
            err = exc
        if split:
            values = None if err is not None else {"rows": local.logits.shape[0], "ran_on": local.ran_on}
            STEP_HANDSHAKE.exchange(values, err, None, world=spec.tp, what="generate (artifact head)")
        ran_on.add(local.ran_on)
        return local.logits

    def gathered_last(hidden: torch.Tensor | None, rows: list[int]) -> torch.Tensor:
        """Attention DP: the last hidden row of each prompt in ``rows`` (global ids, sorted), gathered
        from the ranks that ran their body (every rank gets all of them, in prompt order)."""
        mine = [b - lo for b in rows if lo <= b < hi]
        local = hidden[mine, -1, :] if hidden is not None and mine else \
            torch.zeros((0, facts.hidden_size), dtype=torch.float32)
        counts = [sum(1 for b in rows if calc_shard(batch, spec.tp, r) <= b < calc_shard(batch, spec.tp, r + 1))
                  for r in range(spec.tp)]
        return D.all_gather_rows(local.float().contiguous(), counts, None)

    def run_body(embeds: torch.Tensor, positions_now: torch.Tensor) -> torch.Tensor | None:
        if hi == lo or body is None:
            return None  # no prompt of this rank's block: it only takes part in the vocab dimension
        return body(embeds[lo:hi], body_mask if padded else None, positions_now[lo:hi])

    start = time.perf_counter()
    prefill_s = 0.0
    step = 0
    with torch.inference_mode():
        embeds = embedding(ids)  # every rank looks up all prompts' ids: the vocab dimension stays split
        hidden = run_body(embeds, positions)
        logits: torch.Tensor | None
        if adp:
            # Left padding: the last column is every prompt's last token.
            last = gathered_last(hidden, active)
            logits = None if backend is None else head_logits(last, torch.ones(batch, dtype=torch.int64))
        else:
            assert hidden is not None
            rows = hidden[mask.bool()]  # packed non-padding rows, prompt after prompt
            logits = head_logits(rows, mask.sum(-1))
            last = rows
        while True:
            bitmask = grammar.bitmask(active) if grammar is not None and grammar.constrains(active) else None
            rows_params = [spec.params[b] for b in active]
            if logits is None:
                # A torch-path decode step: head + bitmask + draw validated together, one collective
                # per steady step (trtvocab.sampling.decode).
                next_ids = decode(last, head, rows_params, step=step, vocab_limit=vocab_limit,
                                  bitmask=bitmask).tolist()
            else:
                if bitmask is not None:
                    apply_token_bitmask(logits, bitmask, head)
                next_ids = sample(logits, head, rows_params, step=step, vocab_limit=vocab_limit).tolist()
            if step == 0:
                prefill_s = time.perf_counter() - start
            feed = torch.full((batch, 1), pad, dtype=torch.int64)
            still = []
            for b, tok in zip(active, next_ids, strict=True):
                generated[b].append(tok)
                feed[b, 0] = tok
                done = tok in eos or len(generated[b]) >= spec.max_new_tokens
                if grammar is not None:
                    done = grammar.accept(b, tok) or done
                if not done:
                    still.append(b)
            active = still
            step += 1
            if not active:
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.int64)], dim=-1)
            body_mask = mask[lo:hi]
            positions = positions[:, -1:] + 1
            hidden = run_body(embedding(feed), positions)
            if adp:
                last = gathered_last(hidden, active)
            else:
                assert hidden is not None
                last = hidden[active, -1, :]
            logits = None if backend is None else head_logits(last, torch.ones(len(active), dtype=torch.int64))
    decode_s = time.perf_counter() - start - prefill_s
    return _RankOutput(generated, sorted(ran_on) or ["torch"], prefill_s, decode_s, deterministic)


def run(model: str | Path, prompts: list[str], **options: Any) -> GenerateReport:
    """:func:`prepare` then :func:`generate`: the Python twin of ``trtvocab generate``."""
    spec, loaded = prepare(model, prompts, **options)
    return generate(spec, loaded)


__all__ = ["SETUP_HANDSHAKE", "STEP_HANDSHAKE", "ArtifactSpec", "GenerateReport", "GenerateResult", "GenerateSpec",
           "LoadedModel", "artifact_spec", "check_options", "encode_prompts", "generate", "load_model", "model_path",
           "prepare", "run", "sampling_params"]
