"""The model a ``generate`` run drives: loaded once per process (:func:`load_model`), its tokenizer's
view of the prompts (:func:`encode_prompts`, :func:`words_token_ids`), what every rank needs of it
(:class:`ModelFacts`) and its decoder stack with a KV cache (:class:`Body`)."""

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

from trtvocab.checkpoints.checkpoint import open_checkpoint
from trtvocab.checkpoints.hf_loader import load_causal_lm, quiet_transformers
from trtvocab.errors import CheckpointError, InputError
from trtvocab.pipeline.body_kernels import KernelLinears


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


def model_shape(path: Path) -> tuple[int, int]:
    """``(vocab, hidden)`` from the checkpoint's header (no weights read)."""

    config = open_checkpoint(path).config
    try:
        return int(config["vocab_size"]), int(config["hidden_size"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"MODEL {path}: its config has no vocab_size / hidden_size") from None


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


def encode_prompts(tokenizer: Any, prompts: list[str] | tuple[str, ...], chat: bool) -> list[list[int]]:
    """Each prompt's ids: as the tokenizer encodes it, or through its chat template (``chat``)."""
    out = []
    if chat and not getattr(tokenizer, "chat_template", None):
        raise InputError("`chat`: the tokenizer has no chat template")
    for i, text in enumerate(prompts):
        if not isinstance(text, str):
            raise InputError(f"`prompts` {i + 1}: expected text, got {type(text).__name__}")
        if chat:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                     add_generation_prompt=True)
            ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        if not ids:
            raise InputError(f"`prompts` {i + 1} ({text!r}): encodes to no tokens")
        out.append([int(t) for t in ids])
    return out


def words_token_ids(tokenizer: Any, words: list[str] | tuple[str, ...], what: str = "`bad_words`") -> list[list[int]]:
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


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What every rank needs of the model besides its body (a rank without a body has only this)."""

    vocab_size: int
    hidden_size: int
    eos: frozenset[int]
    pad: int

    @classmethod
    def of(cls, model: Any, tokenizer: Any) -> ModelFacts:
        eos = eos_ids(model, tokenizer)
        return cls(int(model.config.vocab_size), int(model.config.hidden_size), frozenset(eos),
                   _pad_id(model, tokenizer, eos))


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The ids that end an answer: the generation config's, else the tokenizer's."""
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


class Body:
    """``model.model`` (the decoder stack + final norm) with its KV cache, under either kwarg name.

    ``kv_cache="static"``: transformers' ``StaticCache`` of ``max_len`` positions, allocated on the
    first call (its batch is the first call's), and the attention mask handed over at that full
    length (a step's shapes never change: no per-step reallocation of the cache or the mask);
    ``"dynamic"``: transformers' default cache, grown each step. ``compile_step``: the one-token
    steps run through ``torch.compile`` of the body (static cache only; the compiled body is kept per
    body object, so a process compiles it once per batch shape). :attr:`compile_s`: the seconds of the
    compiled steps during which dynamo compiled a graph (the rest of a run's steps reuse it)."""

    def __init__(self, model: Any, kv_cache: str = "dynamic", max_len: int = 0, compile_step: bool = False,
                 body_kernels: bool = False) -> None:
        self.body = model.model
        self.linears = KernelLinears(self.body) if body_kernels else None
        names = inspect.signature(self.body.forward).parameters
        self.cache_kw = "cache" if "cache" in names else "past_key_values"
        self.cache: Any = None
        self.static = kv_cache == "static"
        self.max_len = max_len
        self.compiled = compile_step and self.static
        self.step_fn: Any = _compiled_body(self.body) if self.compiled else self.body
        self.compile_s = 0.0

    def __call__(self, embeds: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
                 length: int | None = None) -> torch.Tensor:
        """The last hidden states of ``embeds [B, S, H]``; ``mask``: ``None`` (no padding) or the mask
        buffer whose first ``length`` columns are the positions so far (all of it when ``length`` is None)."""
        if self.static and self.cache is None:
            self.cache = quiet_transformers().StaticCache(config=self.body.config, max_cache_len=self.max_len)
        if mask is not None and not self.static and length is not None:
            mask = mask[:, :length]
        step = embeds.shape[1] == 1
        graphs = _graphs_compiled() if step and self.compiled else None
        start = time.perf_counter()
        with self.linears.swapped() if self.linears is not None else contextlib.nullcontext():
            out = (self.step_fn if step else self.body)(inputs_embeds=embeds, attention_mask=mask,
                                                        position_ids=positions, use_cache=True,
                                                        **{self.cache_kw: self.cache})
        if graphs is not None and _graphs_compiled() > graphs:
            self.compile_s += time.perf_counter() - start
        if not self.static:
            cache = getattr(out, "cache", None)
            self.cache = cache if cache is not None else out.past_key_values
        return out.last_hidden_state


def _graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters  # torch's own counter (what the compile tests read)

    return int(counters["stats"]["unique_graphs"])


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


__all__ = ["Body", "LoadedModel", "ModelFacts", "encode_prompts", "eos_ids", "load_model", "model_path",
           "model_shape", "words_token_ids"]
