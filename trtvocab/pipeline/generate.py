"""``trtvocab generate``: a causal LM's decode loop with the vocabulary dimension split over ``tp`` ranks.

The body (attention, MLPs, the final norm) runs whole in ``transformers`` with its KV cache on
every rank (``attention_dp``: each rank its own block of prompts, the last hidden rows
gathered). The vocabulary ends run in trtvocab, one :class:`VocabEnds` per rank built once
(:func:`open_vocab_ends`): ``embed(ids)`` (own rows, an exact all-reduce) and
``next_ids(rows, params, step, bitmask)`` (the model's head through ``sampling.decode``, which
streams the vocab above the head's logits budget, or an artifact's backend, then the gather-free
sampler). :func:`_decode` is the batching loop around them, batched as ``transformers.generate``
batches (left padding), so greedy output is token-identical. :func:`prepare` refuses everything
it can before any rank starts (typed errors naming the argument); ``tp > 1`` runs on gloo ranks
(:func:`trtvocab.parallel.launch.run_ranks`) that receive the loaded body in shared memory.

See docs/generate.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from trtvocab.artifact import store as artifacts
from trtvocab.backends import CHOICES, MODULES, canonical, pick_backend
from trtvocab.base.formats import Runtime
from trtvocab.checkpoints.checkpoint import open_checkpoint
from trtvocab.checkpoints.hf_loader import load_causal_lm, quiet_transformers
from trtvocab.checkpoints.provenance import head_digest
from trtvocab.errors import ArtifactError, CheckpointError, ConfigError, DistributedError, InputError
from trtvocab.parallel import distributed as D
from trtvocab.parallel.launch import run_ranks, usable_cores, warm_up
from trtvocab.parallel.mapping import Mapping
from trtvocab.parallel.sharding import calc_shard
from trtvocab.pipeline.body_kernels import KernelLinears, body_kernel_reason
from trtvocab.pipeline.decode import TorchEnds, VocabEnds, open_vocab_ends
from trtvocab.sampling import SamplingParams, TokenState
from trtvocab.sampling.added_vocab import state_placement
from trtvocab.sampling.beam import BeamSearch, beam_candidates
from trtvocab.sampling.grammar import GrammarSpec, RowGrammars, check_grammar, compile_grammar, grammar_spec
from trtvocab.weights.lora import open_adapter

# What the ranks agree on once their setup is done (protocol: trtvocab.parallel.distributed.Handshake):
# a rank whose setup failed stops the others; after every artifact-backend step: pipeline.decode.STEP_HANDSHAKE.
SETUP_HANDSHAKE = D.Handshake("generate", (D.Field("vocab_size"), D.Field("hidden_size"), D.Field("prompts")))
# What a rank imports (unpickling the model and tokenizer, opening its head), imported once by the
# ranks' server instead (trtvocab.parallel.launch.warm_up); a model's own modeling_<arch> module
# is small once transformers.modeling_utils is in.
_RANK_MODULES = ("trtvocab.pipeline.generate", "trtvocab.checkpoints.hf_loader", "trtvocab.checkpoints.gguf",
                 "transformers.modeling_utils", "transformers.tokenization_utils_base", "tokenizers")
_PARAM_OPTIONS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
                  "seed": "--seed", "repetition_penalty": "--repetition-penalty",
                  "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
                  "logit_bias": "--logit-bias", "min_tokens": "--min-tokens", "stop_token_ids": "--stop-token-id",
                  "ignore_eos": "--ignore-eos", "typical_p": "--typical-p", "logprobs": "--logprobs",
                  "logprobs_mode": "--logprobs-mode", "bad_words": "--bad-words",
                  "prompt_logprobs": "--prompt-logprobs", "n": "--n", "beam_width": "--beam-width",
                  "allowed_token_ids": "allowed_token_ids"}


# ---- what a run is ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ArtifactSpec:
    """A built head artifact the loop runs instead of the model's own head."""

    root: str
    backend: str  # canonical, chosen (torch | onnx | tensorrt)
    tp: int
    note: str | None = None  # why auto did not take the artifact's TensorRT engines
    manifest: Any = None  # its Manifest, read (and verified) once by artifact_spec; the ranks use it


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
    # Attention DP: the body runs on ranks 0 .. body_ranks - 1 only (the prompts split over them);
    # the others hold their vocab slices and run no body (see choose_body_ranks()).
    body_ranks: int = 0
    # The model's head streams its vocab in chunks above this many bytes of float32 [b, V_local]
    # logits (LMHead.logits_budget_bytes; None: the head's default).
    logits_budget_bytes: int | None = None
    # LoRA adapters on the embedding and the head ((name, folder), in index order), and each prompt's
    # adapter index (-1: none); empty: no adapters.
    loras: tuple[tuple[str, str], ...] = ()
    lora_for: tuple[int, ...] = ()
    # A GGUF Q8_0 / Q6_K head (and tied table) stays in its stored blocks; False: dequantized to float32.
    gguf_blocks: bool = True
    # Stop strings (vLLM's ``stop``): a prompt ends once its detokenized output holds one; the text
    # is cut before it (the ids keep the token that completed it).
    stop: tuple[str, ...] = ()
    # n > 1 (SamplingParams.n): the prompts above are repeated, one row per completion; this is each
    # row's completion index (empty: every n is 1).
    sample_index: tuple[int, ...] = ()
    beam_width: int = 1  # > 1: greedy beam search (every prompt; transformers' num_beams)
    # The body's KV cache (KV_CACHES): "dynamic" (transformers' default, grown each step) or "static"
    # (its StaticCache, allocated once for the run's longest reach: what compile_step needs; eager,
    # it measured no faster here). Beam search keeps the dynamic one.
    kv_cache: str = "dynamic"
    # The body's one-token steps through torch.compile (static cache only): compiles on the first
    # run of a process (about a minute for SmolLM2 here), off by default.
    compile_step: bool = False
    # The body's float32 linear layers multiply decode batches on trtvocab's dense kernel
    # (pipeline/body_kernels.py: within float32 rounding of torch's sgemm, faster at a few rows).
    body_kernels: bool = False
    # Every rank (tp 1: this process) runs the whole decode once before the one it reports: a compiled
    # step compiles in the first (a tp > 1 run's ranks are new processes each run), so the report's
    # times are the steady state's (benchmarks/generate.py). The same greedy and seeded ids (unseeded
    # sampling draws again); at tp > 1 both decodes fall within run_ranks' one deadline.
    warmup: bool = False


# -inf logprobs (ids a filter removed, processed modes) print as this, as vLLM's OpenAI server does:
# JSON has no infinity.
LOGPROB_FLOOR = -9999.0
# One returned logprob: (token id, logprob, rank), best first per generated token.
Logprob = tuple[int, float, int]


@dataclasses.dataclass
class GenerateResult:
    """One prompt's answer: the generated ids only (an end-of-sequence id included) and their text;
    ``logprobs`` (when its params ask): per generated token, the top-N and the sampled token."""

    prompt: str
    token_ids: list[int]
    text: str
    logprobs: list[list[Logprob]] | None = None
    # Per prompt token (None for the first, as vLLM): its logprob and the top-N of its position.
    prompt_logprobs: list[list[Logprob] | None] | None = None
    index: int | None = None  # n > 1: which completion of its prompt


@dataclasses.dataclass
class GenerateReport:
    """What :func:`generate` returns."""

    results: list[GenerateResult]
    tp: int
    head: str  # what computed the logits: "torch" (the model's head) or the artifact's runtime(s)
    new_tokens: int
    prefill_s: float
    decode_s: float
    # What ran: every rank's head gave tp- and batch-invariant logits (a deterministic LMHead, or a
    # deterministic artifact's PyTorch fallback); not merely what was asked for.
    deterministic: bool
    grammar: str | None = None
    attention_dp: bool = False  # tp > 1: the body ran data-parallel (else every rank ran all of it)
    body_ranks: int = 0  # attention DP: how many ranks ran a body (each its own block of prompts)

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens/s after the prefill (which gives each prompt its first token); None when none followed."""
        after = self.new_tokens - len(self.results)
        return after / self.decode_s if after > 0 and self.decode_s > 0 else None

    def as_json(self, tokenizer: Any = None) -> dict[str, Any]:
        """``{"results": [{"prompt", "token_ids", "text"[, "logprobs"]}, ...]}``: what ``generate --json``
        prints; ``logprobs`` (DESIGN §9): per generated token a list of ``{"id", "token", "logprob", "rank"}``,
        best first (``token``: ``tokenizer.decode([id])``, or None without a tokenizer)."""
        def entry(r: GenerateResult) -> dict[str, Any]:
            out: dict[str, Any] = {"prompt": r.prompt, "token_ids": r.token_ids, "text": r.text}
            if r.index is not None:
                out["index"] = r.index
            def entries(step: list[Logprob]) -> list[dict[str, Any]]:
                return [{"id": i, "token": tokenizer.decode([i]) if tokenizer is not None else None,
                         "logprob": max(v, LOGPROB_FLOOR), "rank": k} for i, v, k in step]
            if r.logprobs is not None:
                out["logprobs"] = [entries(step) for step in r.logprobs]
            if r.prompt_logprobs is not None:
                out["prompt_logprobs"] = [None if step is None else entries(step) for step in r.prompt_logprobs]
            return out
        return {"results": [entry(r) for r in self.results]}


@dataclasses.dataclass
class _RankOutput:
    token_ids: list[list[int]]
    logprobs: list[list[list[Logprob]]]
    prompt_logprobs: list[list[list[Logprob] | None] | None]
    ran_on: list[Runtime]
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
    """``transformers``, offline and quiet (:func:`trtvocab.checkpoints.hf_loader.quiet_transformers`)."""

    return quiet_transformers()


def _cache_key(path: Path) -> tuple[str, int, int]:
    st = path.stat() if path.is_file() else (path / "config.json").stat()
    return str(path), st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=2)
def _load_cached(key: tuple[str, int, int]) -> LoadedModel:
    """The model at ``key[0]`` through :func:`trtvocab.checkpoints.hf_loader.load_causal_lm` (the loader ``hidden``
    uses: offline, safetensors or GGUF only, never a pickle; a model that is not a causal LM is refused
    by name), float32, in eval mode, with the decoder stack ``model.model`` the loop drives."""

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
                    seed: int | None = None, *, logit_bias: dict[int, float] | list[str] | None = None,
                    **knobs: Any) -> SamplingParams:
    """:class:`SamplingParams` from the CLI's options; an error names the option (``--top-p``).

    ``logit_bias``: a dict, or the CLI's ``ID=BIAS`` strings; ``knobs``: the other fields by name."""
    try:
        bias = parse_logit_bias(logit_bias) if isinstance(logit_bias, list | tuple) else (logit_bias or {})
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                              logit_bias=bias, **knobs)
    except InputError as exc:
        text = str(exc)
        for field, option in _PARAM_OPTIONS.items():
            if text.startswith(f"SamplingParams.{field}:"):
                raise InputError(f"{option}:{text.split(':', 1)[1]}") from None
        raise


def parse_logit_bias(items: list[str] | tuple[str, ...]) -> dict[int, float]:
    """``["ID=BIAS", ...]`` -> ``{id: bias}``; a malformed entry raises naming ``--logit-bias``."""
    out: dict[int, float] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        try:
            if not sep:
                raise ValueError
            out[int(key)] = float(value)
        except ValueError:
            raise InputError(f"--logit-bias: expected ID=BIAS (an int token id, a number), got {item!r}") from None
    return out


def words_token_ids(tokenizer: Any, words: list[str] | tuple[str, ...], what: str = "--bad-words") -> list[list[int]]:
    """vLLM's bad-words tokenization: each word as written and with a leading space (when that is
    another sequence of the same length), without special tokens."""
    out: list[list[int]] = []
    for word in words:
        if not str(word).strip():
            raise InputError(f"{what}: a word must not be empty or blank, got {word!r}")
        plain = tokenizer.encode(str(word).lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + str(word).lstrip(), add_special_tokens=False)
        out.append(list(plain))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(list(spaced))
    return out


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` cut before the first stop string it holds (vLLM leaves the stop string out), and whether it held one."""
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def _model_shape(path: Path) -> tuple[int, int]:
    """``(vocab, hidden)`` from the checkpoint's header (no weights read)."""

    config = open_checkpoint(path).config
    try:
        return int(config["vocab_size"]), int(config["hidden_size"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"MODEL {path}: its config has no vocab_size / hidden_size") from None


def artifact_spec(root: str | Path, backend: str, model: Path, tp: int | None,
                  allow_other_checkpoint: bool = False, shape: tuple[int, int] | None = None) -> ArtifactSpec:
    """Check an artifact against the model and pick its backend (:class:`ArtifactError`, naming ``--artifact``).

    The artifact must have been built from ``model``'s head (the manifest's ``checkpoint_sha256``,
    :func:`trtvocab.checkpoints.provenance.head_digest`); ``allow_other_checkpoint`` runs it anyway, and the
    report says so. ``shape``: the model's ``(vocab, hidden)`` when the caller has read them."""

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
    vocab, hidden = shape if shape is not None else _model_shape(model)
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
        raise ArtifactError(f"--artifact {root} {why}: its logits are not {model.name}'s head; rebuild it from "
                            "the model, or pass --allow-other-checkpoint to run it anyway")
    return f"WARNING: the artifact {why}; running it anyway (--allow-other-checkpoint)"


def check_options(*, max_new_tokens: int, tp: int | None, prompts: list[str] | tuple[str, ...] | None,
                  backend: str, artifact: str | Path | None, deterministic: bool) -> None:
    """The checks that need nothing loaded."""

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


def lora_plan(loras: Any, lora_for: Any, prompts: int, *, artifact: Any, attention_dp: bool,
              deterministic: bool) -> tuple[tuple[tuple[str, str], ...], tuple[int, ...]]:
    """``(adapters, each prompt's adapter index)`` from ``--lora NAME=DIR`` and ``--lora-for INDEX[=NAME]``.

    ``loras``: ``{name: folder}`` or ``["NAME=DIR", ...]``; ``lora_for``: ``{prompt index: name}`` or
    ``["INDEX=NAME" | "INDEX", ...]`` (0-based prompt indices; a bare index names the only adapter).
    Without ``lora_for``, a single adapter applies to every prompt. Adapters are read (config and
    header) here, so a bad one is refused before the model loads; one that also targets the body is
    refused (the body runs as the checkpoint has it).
    """

    if not loras:
        if lora_for:
            raise ConfigError("--lora-for: names a prompt's adapter; give the adapters with --lora NAME=DIR")
        return (), ()
    pairs = list(loras.items()) if isinstance(loras, dict) else [_split_pair(x, "--lora", "NAME=DIR") for x in loras]
    names = [str(n) for n, _ in pairs]
    if len(set(names)) != len(names) or not all(names):
        raise ConfigError(f"--lora: adapter names must be distinct and non-empty, got {names}")
    if artifact is not None:
        raise ConfigError("--lora: an --artifact's head was built without adapters; run the model's head "
                          "(drop --artifact)")
    if attention_dp:
        raise ConfigError("--lora: per-prompt adapters with --attention-dp are not supported")
    if deterministic:
        raise ConfigError("--lora: adapters on a --deterministic head are not supported")
    for name, folder in pairs:
        open_adapter(folder, name=str(name))
    per_prompt = [-1] * prompts
    if not lora_for:
        if len(pairs) > 1:
            raise ConfigError("--lora-for INDEX=NAME: several adapters given, say which prompt uses which")
        return tuple((str(n), str(f)) for n, f in pairs), (0,) * prompts
    items = list(lora_for.items()) if isinstance(lora_for, dict) else [
        _split_pair(x, "--lora-for", "INDEX=NAME") if "=" in str(x) else (x, names[0] if len(names) == 1 else None)
        for x in lora_for]
    for index, name in items:
        try:
            i = int(index)
        except (TypeError, ValueError):
            raise ConfigError(f"--lora-for: {index!r} is not a prompt index") from None
        if not 0 <= i < prompts:
            raise ConfigError(f"--lora-for: prompt index {i} outside [0, {prompts}) (0-based, in --prompt order)")
        if name not in names:
            raise ConfigError(f"--lora-for {index}: adapter {name!r} is not among --lora {names}"
                              + (" (several adapters: write INDEX=NAME)" if name is None else ""))
        per_prompt[i] = names.index(name)
    return tuple((str(n), str(f)) for n, f in pairs), tuple(per_prompt)


def _split_pair(text: Any, option: str, form: str) -> tuple[str, str]:
    left, sep, right = str(text).partition("=")
    if not sep or not left or not right:
        raise ConfigError(f"{option}: expected {form}, got {text!r}")
    return left, right


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


def choose_body_ranks(tp: int, prompts: int, asked: int | None = None) -> int:
    """How many ranks run a body under attention DP: ``asked``, or by default one per usable core (at
    most ``tp``); at most one per prompt either way. Ranks on one host share its cores, so a body
    replica beyond the core count adds its per-step overhead and its share of scheduling waits at
    every meeting, and no compute; the vocab dimension stays split over all ``tp`` ranks either way."""
    if asked is None:
        return max(1, min(tp, prompts, usable_cores()))
    if isinstance(asked, bool) or not isinstance(asked, int) or not 1 <= asked <= tp:
        raise ConfigError(f"--body-ranks: must be an int from 1 to the tp size ({tp}), got {asked!r}")
    return min(asked, prompts)  # a body rank past the prompts would own none


def prompt_block(batch: int, bodies: int, rank: int) -> tuple[int, int]:
    """Attention DP: the prompts ``[lo, hi)`` whose body ``rank`` runs (empty past ``bodies``)."""
    if rank >= bodies:
        return batch, batch
    return calc_shard(batch, bodies, rank), calc_shard(batch, bodies, rank + 1)


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
    body_ranks: int | None = None,
    logits_budget_bytes: int | None = None,
    loras: Any = None,
    lora_for: Any = None,
    gguf_blocks: bool = True,
    bad_words: list[str] | tuple[str, ...] = (),
    stop: list[str] | tuple[str, ...] = (),
    kv_cache: str = "dynamic",
    compile_step: bool = False,
    body_kernels: bool = False,
) -> tuple[GenerateSpec, LoadedModel]:
    """Validate everything, then load the model: the run's spec and the loaded model.

    ``params``: one :class:`SamplingParams` for every prompt, or one per prompt; default greedy.
    ``json_schema`` / ``regex`` constrain every prompt; ``grammars`` (from :func:`grammar_spec`)
    gives one grammar (or None) per prompt instead.
    ``body_ranks`` (attention DP only): how many ranks run a body; default one per usable CPU core,
    at most ``tp`` (:func:`choose_body_ranks`).
    ``logits_budget_bytes``: the model's head streams its vocab in chunks when a step's float32
    ``[b, V_local]`` logits would exceed it (``LMHead.logits_budget_bytes``; the ids are the same).
    ``loras`` / ``lora_for``: PEFT LoRA adapters on the embedding and the head, per prompt (:func:`lora_plan`).
    ``gguf_blocks``: a GGUF Q8_0 / Q6_K head stays in its stored blocks (False: float32-dequantized).
    ``bad_words``: words (text) banned for every prompt, tokenized as vLLM does (:func:`words_token_ids`);
    ``stop``: stop strings (vLLM's ``stop``; the text is cut before the first one).
    ``kv_cache``: the body's KV cache, ``"static"`` (allocated once) or ``"dynamic"`` (grown each step);
    ``compile_step``: the body's one-token steps through ``torch.compile`` (static cache only; the
    first run of a process compiles). Neither changes the tokens (docs/generate.md).
    ``body_kernels``: the body's float32 linear layers multiply decode batches on trtvocab's dense
    kernel (:mod:`trtvocab.pipeline.body_kernels`; a compiled step calls it as one opaque op).
    Cheap checks (options, the grammar, the artifact's manifest against the checkpoint's
    header) come before the model is loaded.
    """
    if kv_cache not in KV_CACHES:
        raise InputError(f"--kv-cache: expected one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
    if compile_step and kv_cache != "static":
        raise InputError("--compile-step: needs --kv-cache static (a compiled step keeps its shapes)")
    if body_kernels and (reason := body_kernel_reason()) is not None:
        raise InputError(f"--body-kernels: {reason}")
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise InputError(f"--stop: expected non-empty strings, got {stop!r}"[:300])
    budget = logits_budget_bytes
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise ConfigError(f"logits_budget_bytes: must be None or an int > 0, got {budget!r}")
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
    beam = max(p.beam_width for p in per_prompt)
    if beam > 1:
        plain = SamplingParams(temperature=0.0, beam_width=beam)
        if any(p.model_copy(update={"seed": None, "stop_token_ids": ()}) != plain for p in per_prompt) \
                or per_grammar or attention_dp:
            raise ConfigError(f"--beam-width {beam}: greedy beam search of every prompt alone (temperature 0, the "
                              "same width everywhere; no other sampling knob, grammar or --attention-dp)")
    # Adapters by --prompt index (before n > 1 repeats the prompts: each completion keeps its prompt's).
    adapters, per_adapter = lora_plan(loras, lora_for, len(prompts), artifact=artifact, attention_dp=attention_dp,
                                      deterministic=deterministic)
    if adapters and (beam > 1 or any(p.prompt_logprobs is not None for p in per_prompt)):
        raise ConfigError("--lora: not with --beam-width or --prompt-logprobs (they read the head without a "
                          "row's adapter)")
    index: list[int] = []
    if any(p.n > 1 for p in per_prompt):  # one row per completion, each its own seed stream
        rows = [(b, i) for b, p in enumerate(per_prompt) for i in range(p.n)]
        prompts = [prompts[b] for b, _ in rows]
        per_grammar = tuple(per_grammar[b] for b, _ in rows) if per_grammar else ()
        per_adapter = tuple(per_adapter[b] for b, _ in rows) if per_adapter else ()
        per_prompt = [per_prompt[b].model_copy(update={"seed": per_prompt[b].sample_seed(i)}) for b, i in rows]
        index = [i for _, i in rows]
    shape = _model_shape(path)  # the checkpoint's header, read once
    art = artifact_spec(artifact, backend, path, tp, allow_other_checkpoint, shape) if artifact is not None else None
    ranks = art.tp if art is not None else (tp or 1)
    if attention_dp and ranks == 1:
        raise ConfigError("--attention-dp splits the prompts over the ranks: it needs --tp > 1 (or a tp > 1 "
                          "--artifact)")
    if body_ranks is not None and not attention_dp:
        raise ConfigError("--body-ranks: only with --attention-dp (without it every rank runs the whole body)")
    if attention_dp and any(p.prompt_logprobs is not None for p in per_prompt):
        raise ConfigError("--prompt-logprobs: not with --attention-dp (a rank holds the prompt rows of its own "
                          "block only)")
    bodies = choose_body_ranks(ranks, len(prompts), body_ranks) if attention_dp else 0
    vocab, _ = shape
    if ranks > vocab:
        raise ConfigError(f"--tp {ranks}: more ranks than the vocabulary has ids ({vocab})")
    if ranks > 1:  # the ranks' server imports what they run while this process loads the model

        warm_up(_RANK_MODULES + (MODULES[art.backend] if art is not None else ()))
    loaded = load_model(path)
    # Every distinct grammar compiled once against the tokenizer, before any rank starts: bounded in time,
    # refused when it lets the model say nothing (the ranks' compile is then xgrammar's cache at tp 1).
    stops = _eos_ids(loaded.model, loaded.tokenizer)
    for g in dict.fromkeys(g for g in per_grammar if g is not None):
        compile_grammar(g, loaded.tokenizer, int(loaded.config.vocab_size), stops,
                        what=f"--{g.kind.replace('_', '-')} ({g.label})")
    ids = encode_prompts(loaded.tokenizer, prompts, chat)
    if bad_words:
        banned = tuple(tuple(w) for w in words_token_ids(loaded.tokenizer, list(bad_words)))
        per_prompt = [p.model_copy(update={"bad_words": p.bad_words + banned}) for p in per_prompt]
    vocab_ids = int(loaded.config.vocab_size)
    for i, p in enumerate(per_prompt):
        if p.max_token_id() >= vocab_ids:
            raise InputError(f"params[{i}]: token id {p.max_token_id()} (--logit-bias / --stop-token-id / "
                             f"allowed_token_ids) is outside the vocabulary [0, {vocab_ids})")
    limit = getattr(loaded.config, "max_position_embeddings", None)
    longest = max(len(p) for p in ids)
    if isinstance(limit, int) and longest + max_new_tokens > limit:
        raise InputError(f"--max-new-tokens {max_new_tokens}: the longest prompt has {longest} tokens and the model "
                         f"holds at most {limit} positions")
    spec = GenerateSpec(str(path), tuple(prompts), tuple(tuple(p) for p in ids), ranks, max_new_tokens,
                        tuple(per_prompt), per_grammar, art, deterministic, bool(attention_dp), bodies, budget,
                        adapters, per_adapter, bool(gguf_blocks), tuple(stop), tuple(index), beam, kv_cache,
                        bool(compile_step), bool(body_kernels))
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
        out = _decode_reported(spec, loaded.model, loaded.tokenizer, rank=0)
    else:

        # Attention DP: a rank that owns no prompt runs no body, so it is not sent the model
        # (the largest argument by far; unpickling it also imports transformers there).
        blocks = [prompt_block(len(spec.prompts), spec.body_ranks, r) for r in range(spec.tp)]
        facts = _ModelFacts.of(loaded.model, loaded.tokenizer)
        models = [(loaded.model if lo < hi or not spec.attention_dp else None,) for lo, hi in blocks]
        outs = run_ranks(_rank_main, spec.tp, spec, loaded.tokenizer, facts, rank_args=models)
        out = outs[0]
        for r, other in enumerate(outs[1:], start=1):
            if other.token_ids != out.token_ids:  # the sampler promises the same ids everywhere
                raise DistributedError(f"generate: rank {r} produced other token ids than rank 0")
        out.ran_on = sorted({name for o in outs for name in o.ran_on})
        out.deterministic = all(o.deterministic for o in outs)
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
                          out.deterministic, grammar, spec.attention_dp, spec.body_ranks)


def _rank_main(rank: int, world: int, spec: GenerateSpec, tokenizer: Any, facts: _ModelFacts,
               model: Any) -> _RankOutput:
    """One rank of a tp > 1 run (spawned by run_ranks: the model arrives in shared memory; None on an
    attention-DP rank that owns no prompt)."""
    _quiet_transformers()
    if spec.attention_dp:  # a body rank gets its share of the cores for the body; a vocab-only rank, one
        # rank's share for its head slice (the slices are equal, so a step's head waits on the slowest)
        cores = usable_cores()
        torch.set_num_threads(max(1, cores // (spec.body_ranks if rank < spec.body_ranks else spec.tp)))
    return _decode_reported(spec, model, tokenizer, rank=rank, facts=facts)


def _decode_reported(spec: GenerateSpec, model: Any, tokenizer: Any, rank: int,
                     facts: _ModelFacts | None = None) -> _RankOutput:
    """The decode a rank reports, after one untimed decode of the same run where ``spec.warmup`` asks."""
    if spec.warmup:
        _decode(spec, model, tokenizer, rank=rank, facts=facts)
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


KV_CACHES = ("static", "dynamic")


class _Body:
    """``model.model`` (the decoder stack + final norm) with its KV cache, under either kwarg name.

    ``kv_cache="static"``: transformers' ``StaticCache`` of ``max_len`` positions, allocated on the
    first call (its batch is the first call's), and the attention mask handed over at that full
    length (a step's shapes never change: no per-step reallocation of the cache or the mask);
    ``"dynamic"``: transformers' default cache, grown each step. ``compile_step``: the one-token
    steps run through ``torch.compile`` of the body (static cache only; the compiled body is kept per
    body object, so a process compiles it once per batch shape)."""

    def __init__(self, model: Any, kv_cache: str = "dynamic", max_len: int = 0, compile_step: bool = False,
                 body_kernels: bool = False) -> None:
        self.body = model.model
        self.linears = KernelLinears(self.body) if body_kernels else None
        names = inspect.signature(self.body.forward).parameters
        self.cache_kw = "cache" if "cache" in names else "past_key_values"
        self.cache: Any = None
        self.static = kv_cache == "static"
        self.max_len = max_len
        self.step_fn: Any = _compiled_body(self.body) if compile_step and self.static else self.body

    def __call__(self, embeds: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
                 length: int | None = None) -> torch.Tensor:
        """The last hidden states of ``embeds [B, S, H]``; ``mask``: ``None`` (no padding) or the mask
        buffer whose first ``length`` columns are the positions so far (all of it when ``length`` is None)."""
        if self.static and self.cache is None:
            self.cache = quiet_transformers().StaticCache(config=self.body.config, max_cache_len=self.max_len)
        if mask is not None and not self.static and length is not None:
            mask = mask[:, :length]
        fn = self.step_fn if embeds.shape[1] == 1 else self.body
        with self.linears.swapped() if self.linears is not None else contextlib.nullcontext():
            out = fn(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=True,
                     **{self.cache_kw: self.cache})
        if not self.static:
            cache = getattr(out, "cache", None)
            self.cache = cache if cache is not None else out.past_key_values
        return out.last_hidden_state


_COMPILED: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _compiled_body(body: Any) -> Any:
    """``torch.compile`` of a decoder stack, made once per body object (kept beside it, not on it: a
    module set as an attribute would become a submodule, its weights a second time in the state dict).
    Not ``dynamic=False``: Gemma 3's sliding-window cache layers count positions in a Python int, which a
    compile specialized on every value recompiled at each step until dynamo's limit (8; then eager); by
    default dynamo makes such an int symbolic on its second value (two compiles in all)."""
    if body not in _COMPILED:
        _COMPILED[body] = torch.compile(body, dynamic=None)
    return _COMPILED[body]


def _setup(spec: GenerateSpec, rank: int, tokenizer: Any, facts: _ModelFacts) -> tuple[VocabEnds, Any]:
    """This rank's vocab ends and grammar matchers; at tp > 1 the ranks then meet once
    (:data:`SETUP_HANDSHAKE`), so a rank whose shard or backend failed to load stops the others."""
    split = spec.tp > 1
    mapping = Mapping(world_size=spec.tp, rank=rank, tp_size=spec.tp) if split else None
    vocab_limit = len(tokenizer) if len(tokenizer) < facts.vocab_size else None
    error: Exception | None = None
    ends: Any = None
    grammar = None
    try:
        ends = open_vocab_ends(spec, rank, mapping, vocab_limit)
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


def _decode(spec: GenerateSpec, model: Any, tokenizer: Any, rank: int, facts: _ModelFacts | None = None) -> _RankOutput:
    """The batching loop of one rank: embed, body, last rows, ``ends.next_ids``, until every prompt is done."""
    facts = facts or _ModelFacts.of(model, tokenizer)
    ends, grammar = _setup(spec, rank, tokenizer, facts)
    if spec.beam_width > 1:
        return _decode_beams(spec, model, ends, facts)
    eos, pad = set(facts.eos), facts.pad
    batch = len(spec.prompt_ids)
    longest = max(len(p) for p in spec.prompt_ids)
    # Every step's buffers up front: the mask holds every position the run can reach (the last token
    # is never fed back), its first `length` columns the positions so far; the feed is refilled.
    total = longest + spec.max_new_tokens
    body = _Body(model, spec.kv_cache, total, spec.compile_step, spec.body_kernels) if model is not None else None
    ids = torch.full((batch, longest), pad, dtype=torch.int64)
    mask = torch.zeros((batch, total), dtype=torch.int64)
    for b, p in enumerate(spec.prompt_ids):
        ids[b, longest - len(p):] = torch.tensor(p, dtype=torch.int64)
        mask[b, longest - len(p):longest] = 1
    length = longest
    positions = (mask[:, :longest].cumsum(-1) - 1).masked_fill(mask[:, :longest] == 0, 0)
    padded = not bool(mask[:, :longest].all())
    feed = torch.empty((batch, 1), dtype=torch.int64)
    generated: list[list[int]] = [[] for _ in range(batch)]
    returned: list[list[list[Logprob]]] = [[] for _ in range(batch)]
    active = list(range(batch))
    # Per-rank token counts of the ids this rank owns, only when a prompt's params read them.
    counted = state_placement(ends.head) if isinstance(ends, TorchEnds) else ends.placement  # token order
    state = TokenState.for_head(counted, spec.prompt_ids, eos) if any(p.processes for p in spec.params) else None
    # The prompts whose body this rank runs: all of them, or (attention DP) its own block.
    adp = spec.attention_dp and spec.tp > 1
    lo, hi = prompt_block(batch, spec.body_ranks, rank) if adp else (0, batch)
    blocks = [prompt_block(batch, spec.body_ranks, r) for r in range(spec.tp)] if adp else []

    def last_rows(hidden: torch.Tensor | None, rows: list[int]) -> torch.Tensor:
        """The last hidden row of each prompt in ``rows`` (global ids, sorted): left padding puts
        every prompt's last token in the last column. Attention DP: gathered from the ranks that
        ran their body (every rank gets all of them, in prompt order)."""
        if not adp:
            assert hidden is not None
            return hidden[rows, -1, :]
        mine = [b - lo for b in rows if lo <= b < hi]
        local = hidden[mine, -1, :] if hidden is not None and mine else \
            torch.zeros((0, facts.hidden_size), dtype=torch.float32)
        counts = [sum(1 for b in rows if r_lo <= b < r_hi) for r_lo, r_hi in blocks]
        return D.all_gather_rows(local.float().contiguous(), counts, None)

    def run_body(ids_now: torch.Tensor, positions_now: torch.Tensor) -> torch.Tensor | None:
        if not adp:  # every rank embeds (a split table: all-reduced) and runs every prompt
            assert body is not None
            return body(ends.embed(ids_now), mask if padded else None, positions_now, length)
        if hi == lo or body is None:
            return None  # no prompt of this rank's block: it only takes part in the vocab dimension
        return body(ends.embed(ids_now[lo:hi]), mask[lo:hi] if padded else None, positions_now[lo:hi], length)

    start = time.perf_counter()
    prefill_s = 0.0
    step = 0
    with torch.inference_mode():
        hidden = run_body(ids, positions)
        prompt_lps = _prompt_logprobs(spec, ends, hidden, longest)
        while True:
            bitmask = grammar.bitmask(active) if grammar is not None and grammar.constrains(active) else None
            if ends.adapter_ids is not None:
                ends.row_adapters = ends.adapter_ids[active]
            rows_state = None if state is None else state if len(active) == batch else state.select(active)
            out = ends.next_ids(last_rows(hidden, active), [spec.params[b] for b in active], step, bitmask, rows_state)
            next_ids = out.token_ids.tolist()
            if state is not None:
                state.append_rows(active, next_ids)
            if step == 0:
                prefill_s = time.perf_counter() - start
            feed.fill_(pad)  # a finished prompt is fed padding (its row stays in the batch)
            feed[active, 0] = out.token_ids.to(torch.int64)
            still = []
            for j, (b, tok) in enumerate(zip(active, next_ids, strict=True)):
                generated[b].append(tok)
                p = spec.params[b]
                if out.logprobs is not None and p.logprobs is not None:
                    returned[b].append(out.logprobs.row(j, p.logprobs))
                done = (tok in eos and not p.ignore_eos) or tok in p.stop_token_ids \
                    or len(generated[b]) >= spec.max_new_tokens
                if spec.stop:
                    done = cut_at_stop(tokenizer.decode(generated[b], skip_special_tokens=True), spec.stop)[1] or done
                if grammar is not None:
                    done = grammar.accept(b, tok) or done
                if not done:
                    still.append(b)
            active = still
            step += 1
            if not active:
                break
            mask[:, length] = 1
            length += 1
            positions = positions[:, -1:] + 1
            hidden = run_body(feed, positions)
    decode_s = time.perf_counter() - start - prefill_s
    return _RankOutput(generated, returned, prompt_lps, sorted(ends.ran_on), prefill_s, decode_s, ends.deterministic)


def _decode_beams(spec: GenerateSpec, model: Any, ends: VocabEnds, facts: _ModelFacts) -> _RankOutput:
    """Greedy beam search of every prompt (``spec.beam_width`` beams each, as transformers' ``num_beams``):
    the body on ``B * W`` rows, :func:`~trtvocab.sampling.beam.beam_candidates` on the shards, the
    bookkeeping of :class:`~trtvocab.sampling.beam.BeamSearch`, the KV cache reordered after each step."""

    w, batch = spec.beam_width, len(spec.prompt_ids)
    body = _Body(model, body_kernels=spec.body_kernels)
    longest = max(len(p) for p in spec.prompt_ids)
    ids = torch.full((batch, longest), facts.pad, dtype=torch.int64)
    mask = torch.zeros((batch, longest), dtype=torch.int64)
    for b, p in enumerate(spec.prompt_ids):
        ids[b, longest - len(p):] = torch.tensor(p, dtype=torch.int64)
        mask[b, longest - len(p):] = 1
    ids, mask = ids.repeat_interleave(w, 0), mask.repeat_interleave(w, 0)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    padded = not bool(mask.all())
    search = BeamSearch(batch, w, set(facts.eos), spec.max_new_tokens)
    start = time.perf_counter()
    prefill_s = 0.0
    with torch.inference_mode():
        hidden = body(ends.embed(ids), mask if padded else None, positions)
        while True:
            logits = ends.local_logits(hidden[:, -1, :])
            scores, parents, tokens = beam_candidates(logits, ends.placement, search.running_scores.reshape(-1), w,
                                                      k=search.k)
            rows, feed = search.step(scores, parents, tokens)
            if prefill_s == 0.0:
                prefill_s = time.perf_counter() - start
            if search.done:
                break
            body.cache.reorder_cache(torch.tensor(rows, dtype=torch.int64))
            mask = torch.cat([mask, torch.ones((batch * w, 1), dtype=torch.int64)], dim=-1)
            positions = positions[:, -1:] + 1
            hidden = body(ends.embed(torch.tensor(feed, dtype=torch.int64)[:, None]), mask if padded else None,
                          positions)
    decode_s = time.perf_counter() - start - prefill_s
    return _RankOutput(search.best(), [[] for _ in range(batch)], [None] * batch, sorted(ends.ran_on), prefill_s,
                       decode_s, ends.deterministic)


def _prompt_logprobs(spec: GenerateSpec, ends: VocabEnds, hidden: torch.Tensor | None,
                     longest: int) -> list[list[list[Logprob] | None] | None]:
    """Per prompt: None, or (its params ask) ``[None, then per later prompt token its logprob and the
    top-N of the position before it]`` from the prefill's hidden rows (left-padded to ``longest``),
    all prompts' rows in one streamed call. Attention DP is refused for it (:func:`prepare`)."""
    out: list[list[list[Logprob] | None] | None] = [None] * len(spec.prompt_ids)
    asked = [b for b, p in enumerate(spec.params) if p.prompt_logprobs is not None]
    if not asked:
        return out
    assert hidden is not None
    rows = [(b, longest - len(spec.prompt_ids[b]) + t) for b in asked for t in range(len(spec.prompt_ids[b]) - 1)]
    nexts = [spec.prompt_ids[b][t - (longest - len(spec.prompt_ids[b])) + 1] for b, t in rows]
    n = max(spec.params[b].prompt_logprobs or 0 for b in asked)
    lp = ends.prompt_logprobs(hidden[[b for b, _ in rows], [t for _, t in rows]].float(),
                              torch.tensor(nexts, dtype=torch.int64), n) if rows else None
    per: dict[int, list[list[Logprob] | None]] = {b: [None] for b in asked}
    for j, (b, _) in enumerate(rows):
        assert lp is not None
        per[b].append(lp.row(j, spec.params[b].prompt_logprobs or 0))
    for b, lists in per.items():
        out[b] = lists
    return out


def run(model: str | Path, prompts: list[str], **options: Any) -> GenerateReport:
    """:func:`prepare` then :func:`generate`: the Python twin of ``trtvocab generate``."""
    spec, loaded = prepare(model, prompts, **options)
    return generate(spec, loaded)


__all__ = ["KV_CACHES", "SETUP_HANDSHAKE", "ArtifactSpec", "GenerateReport", "GenerateResult",
           "GenerateSpec", "LoadedModel", "artifact_spec", "check_options",
           "choose_body_ranks", "cut_at_stop", "encode_prompts", "generate", "load_model", "model_path",
           "parse_logit_bias", "prepare", "prompt_block", "run", "sampling_params",
           "words_token_ids"]
