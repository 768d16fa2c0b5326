"""What one ``generate`` run is asked for: :class:`GenerateOptions` (frozen, checked when made, nothing
loaded) and what :func:`~trtvocab.pipeline.generate.prepare` resolves it to, :class:`GenerateSpec`.

Errors name the field in backquotes (`` `kv_cache`: expected one of ... ``); the command line re-spells
each field as its flag (``trtvocab.commands.cli``), so no layer below it spells a flag.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from trtvocab.backends import CHOICES, canonical
from trtvocab.errors import ConfigError, InputError
from trtvocab.parallel.launch import usable_cores
from trtvocab.parallel.sharding import calc_shard
from trtvocab.pipeline.body_kernels import body_kernel_reason
from trtvocab.sampling import SamplingParams
from trtvocab.sampling.grammar import GrammarSpec, check_grammar
from trtvocab.weights.lora import open_adapter

# The body's KV cache: "dynamic" (transformers' default, grown each step) or "static" (allocated once).
KV_CACHES = ("static", "dynamic")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """One ``generate`` run as asked (the fields of ``trtvocab generate``, the model aside), checked when
    made: an impossible or inconsistent field raises a :class:`ConfigError` / :class:`InputError` naming it.

    ``params``: one :class:`SamplingParams` for every prompt, or one per prompt; default greedy.
    ``json_schema`` / ``regex`` constrain every prompt; ``grammars`` (from
    :func:`~trtvocab.sampling.grammar.grammar_spec`) gives one grammar (or None) per prompt instead.
    ``body_ranks`` (attention DP only): how many ranks run a body (:func:`choose_body_ranks`).
    ``lm_head_tp`` (attention DP only): the head split over groups of that many of the ``tp`` ranks
    (``Mapping.lm_head_tp_size``; default ``tp``): the body ranks spread over the groups
    (:func:`rank_blocks`), each group decodes its own ranks' rows over its split, and the sampled ids
    are exchanged over every rank once a step.
    ``logits_budget_bytes``: the model's head streams its vocab in chunks when a step's float32
    ``[b, V_local]`` logits would exceed it (``LMHead.logits_budget_bytes``; the ids are the same).
    ``loras`` / ``lora_for``: PEFT LoRA adapters on the embedding and the head, per prompt (:func:`lora_plan`).
    ``gguf_blocks``: a GGUF Q8_0 / Q6_K head stays in its stored blocks (False: float32-dequantized).
    ``bad_words``: words banned for every prompt, tokenized as vLLM does; ``stop``: stop strings (vLLM's
    ``stop``; the text is cut before the first one).
    ``kv_cache``: :data:`KV_CACHES`; ``compile_step``: the body's one-token steps through ``torch.compile``
    (static cache only; the first run of a process compiles). Neither changes the tokens (docs/generate.md).
    ``body_kernels``: the body's float32 linear layers multiply decode batches on trtvocab's dense kernel
    (:mod:`trtvocab.pipeline.body_kernels`).
    """

    prompts: tuple[str, ...]
    chat: bool = False
    tp: int | None = None
    max_new_tokens: int = 32
    params: SamplingParams | tuple[SamplingParams, ...] | None = None
    json_schema: str | Path | None = None
    regex: str | None = None
    grammars: tuple[GrammarSpec | None, ...] | None = None
    deterministic: bool = False
    backend: str = "torch"
    artifact: str | Path | None = None
    allow_other_checkpoint: bool = False
    attention_dp: bool = False
    body_ranks: int | None = None
    lm_head_tp: int | None = None
    logits_budget_bytes: int | None = None
    loras: Any = None
    lora_for: Any = None
    gguf_blocks: bool = True
    bad_words: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()
    kv_cache: str = "dynamic"
    compile_step: bool = False
    body_kernels: bool = False

    def __post_init__(self) -> None:
        for name in ("prompts", "bad_words", "stop", "grammars", "params"):  # lists in, tuples kept
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        self.validate()

    def validate(self) -> None:
        """The checks that need nothing loaded (the rest come as :func:`prepare` reads what they need)."""
        self._check_body()
        self._check_run()
        per_prompt = self.per_prompt()
        grammars = self._check_grammars()
        beam = max(p.beam_width for p in per_prompt)
        if beam > 1:
            plain = SamplingParams(temperature=0.0, beam_width=beam)
            if any(p.model_copy(update={"seed": None, "stop_token_ids": ()}) != plain for p in per_prompt) \
                    or grammars or self.json_schema is not None or self.regex is not None or self.attention_dp:
                raise ConfigError(f"`beam_width` {beam}: greedy beam search of every prompt alone (temperature 0, "
                                  "the same width everywhere; no other sampling knob, grammar or `attention_dp`)")
        if self.body_ranks is not None and not self.attention_dp:
            raise ConfigError("`body_ranks`: only with `attention_dp` (without it every rank runs the whole body)")
        self._check_lm_head_tp()
        if self.attention_dp and any(p.prompt_logprobs is not None for p in per_prompt):
            raise ConfigError("`prompt_logprobs`: not with `attention_dp` (a rank holds the prompt rows of its own "
                              "block only)")
        check_lora_fields(self.loras, self.lora_for, artifact=self.artifact, attention_dp=self.attention_dp,
                          deterministic=self.deterministic)
        if self.loras and (beam > 1 or any(p.prompt_logprobs is not None for p in per_prompt)):
            raise ConfigError("`loras`: not with `beam_width` or `prompt_logprobs` (they read the head without a "
                              "row's adapter)")

    def _check_body(self) -> None:
        if self.kv_cache not in KV_CACHES:
            raise InputError(f"`kv_cache`: expected one of {', '.join(KV_CACHES)}, got {self.kv_cache!r}")
        if self.compile_step and self.kv_cache != "static":
            raise InputError("`compile_step`: needs `kv_cache` static (a compiled step keeps its shapes)")
        if self.body_kernels and (reason := body_kernel_reason()) is not None:
            raise InputError(f"`body_kernels`: {reason}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise InputError(f"`stop`: expected non-empty strings, got {self.stop!r}"[:300])
        budget = self.logits_budget_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
            raise ConfigError(f"`logits_budget_bytes`: must be None or an int > 0, got {budget!r}")

    def _check_lm_head_tp(self) -> None:
        n = self.lm_head_tp
        if n is None:
            return
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"`lm_head_tp`: must be an int >= 1 (the head's TP group), got {n!r}")
        if not self.attention_dp or self.artifact is not None or not isinstance(self.tp, int) or self.tp % n:
            raise ConfigError(f"`lm_head_tp` {n}: needs `attention_dp`, the model's own head (no `artifact`) and a "
                              f"`tp` it divides (got tp {self.tp})")

    def _check_run(self) -> None:
        check_options(max_new_tokens=self.max_new_tokens, tp=self.tp, prompts=self.prompts, backend=self.backend,
                      artifact=self.artifact, deterministic=self.deterministic)

    def _check_grammars(self) -> tuple[GrammarSpec | None, ...]:
        """The per-prompt grammars given (empty: none, or one for all from ``json_schema`` / ``regex``)."""
        if self.grammars is None:
            return ()
        if self.json_schema is not None or self.regex is not None:
            raise InputError("`grammars`: give either one grammar per prompt or `json_schema` / `regex`, not both")
        if len(self.grammars) != len(self.prompts) or \
                not all(g is None or isinstance(g, GrammarSpec) for g in self.grammars):
            raise InputError(f"`grammars`: expected one GrammarSpec or None per prompt ({len(self.prompts)})")
        for i, g in enumerate(self.grammars):
            if g is not None:
                check_grammar(g, f"grammars[{i}] ({g.label})")
        return self.grammars

    def per_prompt(self) -> list[SamplingParams]:
        """One :class:`SamplingParams` per prompt."""
        params, n = self.params, len(self.prompts)
        if params is None:
            return [SamplingParams(temperature=0.0)] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if isinstance(params, tuple) and len(params) == n and all(isinstance(p, SamplingParams) for p in params):
            return list(params)
        raise InputError(f"`params`: expected a SamplingParams or one per prompt ({n}), got {params!r}"[:300])


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
    """One validated run, resolved against the model (picklable: it travels to the ranks)."""

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
    # Attention DP: the head split over groups of this many ranks (Mapping.lm_head_tp_size; 0: all tp).
    # Each group decodes the rows of its own body ranks only (rank_blocks spreads the body ranks over
    # the groups); the sampled ids (and logprobs) are then exchanged once per step over the world.
    lm_head_tp: int = 0

    def blocks(self) -> tuple[tuple[int, int], ...]:
        """Attention DP: every rank's prompts ``[lo, hi)`` (:func:`rank_blocks`)."""
        return rank_blocks(len(self.prompt_ids), self.tp, self.body_ranks, self.lm_head_tp)

    @property
    def head_groups(self) -> bool:
        """Attention DP with the head over groups smaller than ``tp`` (each group its own ranks' rows)."""
        return self.attention_dp and 0 < self.lm_head_tp < self.tp


# ---- the checks, also for callers without GenerateOptions ------------------------------------------
def check_options(*, max_new_tokens: int, tp: int | None, prompts: list[str] | tuple[str, ...] | None,
                  backend: str, artifact: str | Path | None, deterministic: bool) -> None:
    """The checks of a run's shape that need nothing loaded."""

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"`max_new_tokens`: must be an int >= 1, got {max_new_tokens!r}")
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        raise ConfigError(f"`tp`: must be an int >= 1 (local gloo ranks), got {tp!r}")
    if not prompts:
        raise InputError("`prompts`: give at least one prompt")
    name = canonical(backend)
    if name != "torch" and artifact is None:
        raise ConfigError(f"`backend` {backend}: runs a built head; give `artifact` DIR (trtvocab build RECIPE), "
                          f"or use `backend` torch for the model's own head (choices: {CHOICES})")
    if deterministic and artifact is not None:
        raise ConfigError("`deterministic`: applies to the head loaded from MODEL; an artifact's head is fixed at "
                          "build time (drop `artifact` or `deterministic`)")


_PARAM_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "logit_bias", "min_tokens", "stop_token_ids", "ignore_eos", "typical_p",
                 "logprobs", "logprobs_mode", "bad_words", "prompt_logprobs", "n", "beam_width", "allowed_token_ids")


def sampling_params(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                    seed: int | None = None, *, logit_bias: dict[int, float] | list[str] | None = None,
                    **knobs: Any) -> SamplingParams:
    """:class:`SamplingParams` from the command line's values; an error names the field (`` `top_p` ``).

    ``logit_bias``: a dict, or ``ID=BIAS`` strings; ``knobs``: the other fields by name."""
    try:
        bias = parse_logit_bias(logit_bias) if isinstance(logit_bias, list | tuple) else (logit_bias or {})
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                              logit_bias=bias, **knobs)
    except InputError as exc:
        text = str(exc)
        for field in _PARAM_FIELDS:
            if text.startswith(f"SamplingParams.{field}:"):
                raise InputError(f"`{field}`:{text.split(':', 1)[1]}") from None
        raise


def parse_logit_bias(items: list[str] | tuple[str, ...]) -> dict[int, float]:
    """``["ID=BIAS", ...]`` -> ``{id: bias}``; a malformed entry raises naming `` `logit_bias` ``."""
    out: dict[int, float] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        try:
            if not sep:
                raise ValueError
            out[int(key)] = float(value)
        except ValueError:
            raise InputError(f"`logit_bias`: expected ID=BIAS (an int token id, a number), got {item!r}") from None
    return out


def check_lora_fields(loras: Any, lora_for: Any, *, artifact: Any, attention_dp: bool, deterministic: bool) -> None:
    """What :func:`lora_plan` refuses without reading an adapter."""
    if not loras:
        if lora_for:
            raise ConfigError("`lora_for`: names a prompt's adapter; give the adapters with `loras` NAME=DIR")
        return
    _distinct_prompts(lora_for)
    pairs = _lora_pairs(loras)
    names = [str(n) for n, _ in pairs]
    if len(set(names)) != len(names) or not all(names):
        raise ConfigError(f"`loras`: adapter names must be distinct and non-empty, got {names}")
    if artifact is not None:
        raise ConfigError("`loras`: an `artifact`'s head was built without adapters; run the model's head "
                          "(drop `artifact`)")
    if attention_dp:
        raise ConfigError("`loras`: per-prompt adapters with `attention_dp` are not supported")
    if deterministic:
        raise ConfigError("`loras`: adapters on a `deterministic` head are not supported")


def _distinct_prompts(lora_for: Any) -> None:
    """Refuse two ``lora_for`` entries for one prompt index (the last one would win without a word)."""
    if not lora_for or isinstance(lora_for, dict):
        return
    seen: dict[str, str] = {}
    for item in lora_for:
        index = str(item).partition("=")[0].strip()
        index = str(int(index)) if index.lstrip("+-").isdigit() else index
        if index in seen:
            raise ConfigError(f"`lora_for`: prompt index {index} is given twice ({seen[index]!r} and {str(item)!r}); "
                              "one adapter per prompt")
        seen[index] = str(item)


def _lora_pairs(loras: Any) -> list[tuple[str, str]]:
    return list(loras.items()) if isinstance(loras, dict) else [_split_pair(x, "loras", "NAME=DIR") for x in loras]


def lora_plan(loras: Any, lora_for: Any, prompts: int, *, artifact: Any, attention_dp: bool,
              deterministic: bool) -> tuple[tuple[tuple[str, str], ...], tuple[int, ...]]:
    """``(adapters, each prompt's adapter index)`` from ``loras`` and ``lora_for``.

    ``loras``: ``{name: folder}`` or ``["NAME=DIR", ...]``; ``lora_for``: ``{prompt index: name}`` or
    ``["INDEX=NAME" | "INDEX", ...]`` (0-based prompt indices, each at most once; a bare index names the
    only adapter). Without ``lora_for``, a single adapter applies to every prompt. Adapters are read
    (config and header) here, so a bad one is refused before the model loads; one that also targets the
    body is refused (the body runs as the checkpoint has it).
    """

    check_lora_fields(loras, lora_for, artifact=artifact, attention_dp=attention_dp, deterministic=deterministic)
    if not loras:
        return (), ()
    pairs = _lora_pairs(loras)
    names = [str(n) for n, _ in pairs]
    for name, folder in pairs:
        open_adapter(folder, name=str(name))
    adapters = tuple((str(n), str(f)) for n, f in pairs)
    if not lora_for:
        if len(pairs) > 1:
            raise ConfigError("`lora_for` INDEX=NAME: several adapters given, say which prompt uses which")
        return adapters, (0,) * prompts
    items = list(lora_for.items()) if isinstance(lora_for, dict) else [
        _split_pair(x, "lora_for", "INDEX=NAME") if "=" in str(x) else (x, names[0] if len(names) == 1 else None)
        for x in lora_for]
    per_prompt = [-1] * prompts
    for index, name in items:
        try:
            i = int(index)
        except (TypeError, ValueError):
            raise ConfigError(f"`lora_for`: {index!r} is not a prompt index") from None
        if not 0 <= i < prompts:
            raise ConfigError(f"`lora_for`: prompt index {i} outside [0, {prompts}) (0-based, in `prompts` order)")
        if name not in names:
            raise ConfigError(f"`lora_for` {index}: adapter {name!r} is not among `loras` {names}"
                              + (" (several adapters: write INDEX=NAME)" if name is None else ""))
        if per_prompt[i] != -1:
            raise ConfigError(f"`lora_for`: prompt index {i} is given twice; one adapter per prompt")
        per_prompt[i] = names.index(name)
    return adapters, tuple(per_prompt)


def _split_pair(text: Any, field: str, form: str) -> tuple[str, str]:
    left, sep, right = str(text).partition("=")
    if not sep or not left or not right:
        raise ConfigError(f"`{field}`: expected {form}, got {text!r}")
    return left, right


def choose_body_ranks(tp: int, prompts: int, asked: int | None = None) -> int:
    """How many ranks run a body under attention DP: ``asked``, or by default one per usable core (at
    most ``tp``); at most one per prompt either way. Ranks on one host share its cores, so a body
    replica beyond the core count adds its per-step overhead and its share of scheduling waits at
    every meeting, and no compute; the vocab dimension stays split over all ``tp`` ranks either way."""
    if asked is None:
        return max(1, min(tp, prompts, usable_cores()))
    if isinstance(asked, bool) or not isinstance(asked, int) or not 1 <= asked <= tp:
        raise ConfigError(f"`body_ranks`: must be an int from 1 to the tp size ({tp}), got {asked!r}")
    return min(asked, prompts)  # a body rank past the prompts would own none


def prompt_block(batch: int, bodies: int, rank: int) -> tuple[int, int]:
    """Attention DP: the prompts ``[lo, hi)`` whose body ``rank`` runs (empty past ``bodies``)."""
    if rank >= bodies:
        return batch, batch
    return calc_shard(batch, bodies, rank), calc_shard(batch, bodies, rank + 1)


def rank_blocks(batch: int, tp: int, bodies: int, head_tp: int = 0) -> tuple[tuple[int, int], ...]:
    """Attention DP: every rank's prompts ``[lo, hi)`` (empty: the rank runs no body).

    Without head groups (``head_tp`` 0 or ``tp``) ranks ``0 .. bodies - 1`` run the bodies
    (:func:`prompt_block`). With head groups of ``head_tp`` ranks (``Mapping.lm_head_tp_size``) the body
    ranks are spread over the groups, the first ``bodies % G`` of the ``G`` groups one more than the
    others, each group's body ranks its first ranks; the prompts split over the body ranks in rank order,
    so each group's rows are one contiguous block (the rows its head decodes) and the groups' blocks
    follow the row order (a group may hold none when ``bodies < G``)."""
    if not head_tp or head_tp == tp:
        return tuple(prompt_block(batch, bodies, r) for r in range(tp))
    groups = tp // head_tp
    body_ids = [g * head_tp + i for g in range(groups) for i in range(bodies // groups + (g < bodies % groups))]
    out = [(batch, batch)] * tp
    for j, r in enumerate(body_ids):
        out[r] = (calc_shard(batch, bodies, j), calc_shard(batch, bodies, j + 1))
    return tuple(out)


__all__ = ["KV_CACHES", "ArtifactSpec", "GenerateOptions", "GenerateSpec", "check_lora_fields", "check_options",
           "choose_body_ranks", "lora_plan", "parse_logit_bias", "prompt_block", "rank_blocks", "sampling_params"]
