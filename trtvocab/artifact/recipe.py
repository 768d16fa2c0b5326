"""What a user writes: build recipes (``builders/*.toml``).

:class:`BuildRecipe` is one complete engine build, one section class per TOML table; its
``[profile]`` is the engine builder's :class:`~trtvocab.export.records.Profile`. What a build
writes (``OUT/manifest.json``) is :mod:`trtvocab.artifact.manifest`, read and written only by
:mod:`trtvocab.artifact.store`.

:func:`parse_recipe` / :func:`load_recipe` parse strictly: unknown keys and bad values are errors
that name the file, the section and key, and what is allowed (a typo never falls back to a
default); ``true`` is not ``1``, ``"4"`` is not ``4``, ``64.9`` is not ``64``; every integer has a
range (the table above the constants). docs/threat_model.md, "Recipes"; the artifact:
docs/architecture.md, "Artifacts".
"""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trtvocab.base.dtypes import DtypeName
from trtvocab.base.safe_read import read_regular
from trtvocab.checkpoints.real_models import model_path
from trtvocab.errors import ConfigError, TrtVocabError
from trtvocab.export.records import Profile
from trtvocab.export.targets import parse_targets
from trtvocab.parallel.mapping import Mapping

# The range of every number a recipe holds (said in its error):
#   vocab_size              [1, 2**31 - 1]   (MAX_VOCAB)
#   hidden_size             [1, 2**20]       (MAX_HIDDEN)
#   tp_size                 [1, 4096]        (MAX_TP)
#   pad_to                  [1, 2**20]       (MAX_PAD_TO); the padded vocab must stay <= MAX_VOCAB
#   seed                    [0, 2**32 - 1]   (MAX_SEED)
#   std                     (0, 10000], finite
#   profile tokens / batch  [1, 2**31 - 1]   (export.records.MAX_TOKENS)
#   workspace_mib           [64, 2**20]      (MAX_WORKSPACE_MIB)
MAX_VOCAB = 2**31 - 1  # token ids and per-rank widths are int32 in graphs and engines
MAX_HIDDEN = 2**20
MAX_TP = 4096
MAX_PAD_TO = 2**20
MAX_SEED = 2**32 - 1
MAX_WORKSPACE_MIB = 2**20  # 1 TiB
MAX_RECIPE_BYTES = 1 << 20


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SyntheticSpec(_Section):
    """Deterministic random weights: rows are generated per 1024-row block from ``seed``,
    so every rank produces its own rows without the full matrix ever existing."""

    vocab_size: int = Field(ge=1, le=MAX_VOCAB)
    hidden_size: int = Field(ge=1, le=MAX_HIDDEN)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    std: float = Field(default=0.02, gt=0, le=1e4, allow_inf_nan=False)


class CheckpointSection(_Section):
    """``[checkpoint]``: exactly one of ``path``, ``package`` (an installed package that ships it),
    ``gguf_package`` (an installed package that ships a ``.gguf`` file, named by ``file``) or
    ``synthetic``; ``tensor`` names the head tensor when it is not found by name.

    ``gguf_package`` is located with ``importlib.util.find_spec`` and never imported (a
    top-level name only: finding ``a.b`` would import ``a``); ``file`` is a plain file name
    inside it, no folders.
    """

    path: str | None = None  # HF directory, .safetensors or .gguf file (relative to the recipe file)
    package: str | None = None  # or: an installed Python package that ships the checkpoint (imported)
    package_subdir: str = "model"
    gguf_package: str | None = None  # or: an installed package shipping a .gguf file (found, not imported)
    file: str | None = None  # the .gguf file inside gguf_package
    model: str | None = None  # or: a real model by its `trtvocab models` name (gemma3, smollm2, minilm)
    tensor: str | None = None  # head tensor name; default lm_head.weight or the tied embedding
    synthetic: SyntheticSpec | None = None

    @model_validator(mode="after")
    def _one_source(self) -> CheckpointSection:
        given = [k for k in ("path", "package", "gguf_package", "model", "synthetic") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of path, package, synthetic, model, or gguf_package with file "
                             f"(got {given or 'none'})")
        if (self.file is None) != (self.gguf_package is None):
            raise ValueError("file and gguf_package go together: file names the .gguf inside gguf_package")
        if self.gguf_package is not None:
            if not self.gguf_package.isidentifier():
                raise ValueError(f"gguf_package must be a top-level package name (found, never imported), "
                                 f"got {self.gguf_package!r}")
            name = self.file or ""
            if not name.endswith(".gguf") or "/" in name or "\\" in name or name.startswith("."):
                raise ValueError(f"file must be a plain .gguf file name inside gguf_package, got {name!r}")
        return self


class MappingSection(_Section):
    """``[mapping]``: one TP group of ``tp_size`` ranks (the build writes every rank of it)."""

    tp_size: int = Field(default=1, ge=1, le=MAX_TP)
    enable_attention_dp: bool = False
    enable_lm_head_tp_in_adp: bool = False

    @model_validator(mode="after")
    def _valid(self) -> MappingSection:
        if self.enable_lm_head_tp_in_adp and not self.enable_attention_dp:
            raise ValueError("enable_lm_head_tp_in_adp requires enable_attention_dp = true")
        return self

    def for_rank(self, rank: int) -> Mapping:
        """The :class:`~trtvocab.parallel.mapping.Mapping` of ``rank`` of this group (``world_size = tp_size``)."""
        return Mapping(world_size=self.tp_size, rank=rank, tp_size=self.tp_size,
                       enable_attention_dp=self.enable_attention_dp,
                       enable_lm_head_tp_in_adp=self.enable_lm_head_tp_in_adp)

    @property
    def lm_head_is_split(self) -> bool:
        return self.for_rank(0).lm_head_is_split


class LMHeadSection(_Section):
    """``[lm_head]``: the head dtype, whether to gather, the vocab layout, context (all-token) logits."""

    dtype: DtypeName = "bfloat16"
    gather_output: bool = True
    vocab_layout: Literal["uneven", "padded"] = "uneven"
    pad_to: int = Field(default=64, ge=1, le=MAX_PAD_TO)
    context_logits: bool = False
    output_dtype: Literal["auto", "float32"] = "auto"  # float32: a dense head's float32 accumulation
    deterministic: bool = False  # the fallback's logits bitwise batch- and tp-invariant
    # A GGUF head (and its tied table) kept in its stored blocks: weights.safetensors holds the blocks, the
    # graph dequantizes them with blocked DequantizeLinear (Q8_0 / Q4_0 / Q4_1; other block types have no
    # graph). False (the default): dequantized to the head dtype at load, as artifacts always were.
    gguf_blocks: bool = False

    def head_options(self) -> dict[str, Any]:
        """The ``LMHead`` keywords these settings give (``output_dtype``, ``deterministic``)."""
        import torch

        return {"output_dtype": torch.float32 if self.output_dtype == "float32" else None,
                "deterministic": self.deterministic}


class QuantizationSection(_Section):
    """``[quantization]``: ``auto`` (the checkpoint's gating) or ``none``; ``weight_only`` W8A16 / W4A16;
    ``dequantize_fp4`` builds NVFP4 heads as bf16 engines below compute capability 10.0."""

    mode: Literal["auto", "none"] = "auto"
    weight_only: bool = False
    dequantize_fp4: bool = False  # build FP4 heads as bf16 engines on GPUs below CC 10.0


class EngineSection(_Section):
    """``[engine]``: which compiler and targets, TensorRT workspace, timing cache file, whether a
    missing engine fails the build, and whether a layer table that breaks the head's contract
    fails it (``contract = "error"``) or is recorded as a warning (``"warn"``).

    ``compiler``: ``auto`` (standard TensorRT where it and a GPU exist, else TensorRT-RTX where
    it imports, else no engine), ``tensorrt`` or ``tensorrt-rtx``. ``targets``: TensorRT-RTX
    compute targets (``["sm89", "sm120"]``); None: every target whose hardware has the graph's
    datatypes, in one engine per rank.
    """

    compiler: Literal["auto", "tensorrt", "tensorrt-rtx"] = "auto"
    targets: list[str] | None = None
    workspace_mib: int = Field(default=4096, ge=64, le=MAX_WORKSPACE_MIB)
    timing_cache: str | None = None
    require: bool = False  # fail the build if no TensorRT engine can be built
    contract: Literal["error", "warn"] = "error"

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, targets: list[str] | None) -> list[str] | None:
        if targets is None:
            return None
        if not targets:
            raise ValueError("must name at least one target (or be left out for the default set)")
        try:
            return parse_targets(targets)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _targets_need_rtx(self) -> EngineSection:
        if self.compiler == "tensorrt" and self.targets is not None:
            raise ValueError(f"targets {self.targets} are TensorRT-RTX targets, but compiler 'tensorrt' builds for "
                             "the local GPU only (leave targets out, or use compiler 'tensorrt-rtx' or 'auto')")
        return self


class OutputSection(_Section):
    """``[output]``: the artifact folder, whether to export ONNX and check it against the fallback."""

    # Relative to the working directory (where you run the build), unlike [checkpoint] path,
    # which is relative to the recipe file (the recipe ships next to what it names).
    dir: str = "artifacts/default"
    onnx: bool = True
    verify: bool = True  # run the exported graph on CPU and compare with the PyTorch fallback


class EmbeddingSection(_Section):
    """``[embedding]``: also export each rank's masked embedding lookup as ``rank{r}/embedding.onnx``
    (checked on onnxruntime against :class:`~trtvocab.embedding.VocabParallelEmbedding`);
    ``tensor`` names the input embedding when it has none of the known names."""

    export: bool = False
    tensor: str | None = None


class BuildRecipe(_Section):
    """A complete build (``builders/*.toml``): the sections above; ``source`` is the file it came from."""

    name: str = "default"
    description: str = ""
    checkpoint: CheckpointSection
    mapping: MappingSection = MappingSection()
    lm_head: LMHeadSection = LMHeadSection()
    quantization: QuantizationSection = QuantizationSection()
    profile: Profile = Profile()
    engine: EngineSection = EngineSection()
    output: OutputSection = OutputSection()
    embedding: EmbeddingSection = EmbeddingSection()

    source: str | None = Field(default=None, exclude=True)  # file the recipe came from

    @model_validator(mode="after")
    def _tp_fits(self) -> BuildRecipe:
        syn = self.checkpoint.synthetic
        if syn is not None and self.mapping.tp_size > syn.vocab_size:
            raise ValueError(f"mapping.tp_size ({self.mapping.tp_size}) is larger than the vocab ({syn.vocab_size})")
        lh = self.lm_head
        if lh.vocab_layout == "padded":
            multiple = lh.pad_to * self.mapping.tp_size
            vocab = syn.vocab_size if syn is not None else 1
            if -(-vocab // multiple) * multiple > MAX_VOCAB:
                raise ValueError(f"lm_head.pad_to ({lh.pad_to}) x mapping.tp_size ({self.mapping.tp_size}) pads the "
                                 f"vocab past {MAX_VOCAB}")
        return self

    def checkpoint_path(self) -> Path | None:
        """Where the checkpoint lives (None for synthetic weights)."""
        ck = self.checkpoint
        if ck.synthetic is not None:
            return None
        if ck.model is not None:
            try:
                return model_path(ck.model)
            except TrtVocabError as exc:
                raise ConfigError(f"{self.source or 'recipe'}: [checkpoint] model: {exc}") from None
        if ck.gguf_package is not None:
            from importlib.util import find_spec

            spec = find_spec(ck.gguf_package)  # a top-level name: nothing is imported
            if spec is None or not spec.submodule_search_locations:
                raise ConfigError(f"{self.source or 'recipe'}: [checkpoint] gguf_package {ck.gguf_package!r} is not "
                                  "installed (as a package folder)")
            path = Path(next(iter(spec.submodule_search_locations))).resolve() / str(ck.file)
            if not path.is_file():
                raise ConfigError(f"{self.source or 'recipe'}: [checkpoint] {ck.gguf_package} ships no file "
                                  f"{ck.file!r} ({path})")
            return path
        if ck.package is not None:
            try:
                module = importlib.import_module(ck.package)
            except ImportError as exc:
                raise ConfigError(
                    f"{self.source or 'recipe'}: [checkpoint] package {ck.package!r} is not installed ({exc}); "
                    "install the examples extra"
                ) from None
            path = Path(module.__file__).resolve().parent / ck.package_subdir
        else:
            path = Path(ck.path)  # type: ignore[arg-type]
            if not path.is_absolute() and self.source is not None:
                path = Path(self.source).resolve().parent / path
        if not path.exists():
            raise ConfigError(f"{self.source or 'recipe'}: [checkpoint] {path} does not exist")
        return path


_SECTIONS: dict[str, type[BaseModel]] = {
    "checkpoint": CheckpointSection,
    "checkpoint.synthetic": SyntheticSpec,
    "mapping": MappingSection,
    "lm_head": LMHeadSection,
    "quantization": QuantizationSection,
    "profile": Profile,
    "engine": EngineSection,
    "output": OutputSection,
    "embedding": EmbeddingSection,
}


def _bounds(model: type[BaseModel], key: str) -> str:
    """``" (allowed: [lo, hi])"`` from a field's ge/gt/le/lt constraints ("" when it has none)."""
    field = model.model_fields.get(key)
    if field is None:
        return ""
    lo = hi = None
    lo_open = hi_open = False
    for m in field.metadata:
        if getattr(m, "ge", None) is not None:
            lo = m.ge
        if getattr(m, "gt", None) is not None:
            lo, lo_open = m.gt, True
        if getattr(m, "le", None) is not None:
            hi = m.le
        if getattr(m, "lt", None) is not None:
            hi, hi_open = m.lt, True
    if lo is None and hi is None:
        return ""
    return f" (allowed: {'(' if lo_open else '['}{lo if lo is not None else '-inf'}, " \
           f"{hi if hi is not None else 'inf'}{')' if hi_open else ']'})"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(err: dict[str, Any], source: str) -> str:
    loc = [str(p) for p in err["loc"]]
    section, key = ".".join(loc[:-1]), loc[-1] if loc else ""
    where = f"[{section}] {key}" if section else key or "(top level)"
    model = _SECTIONS.get(section, BuildRecipe)
    if err["type"] == "extra_forbidden":
        allowed = [k for k in model.model_fields if k != "source"]
        return f"{source}: {where}: unknown key; allowed keys: {', '.join(allowed)}"
    got = f" (got {_shown(err.get('input'))})" if loc else ""
    bounds = _bounds(model, key) if err["type"] in (
        "greater_than", "greater_than_equal", "less_than", "less_than_equal") else ""
    return f"{source}: {where}: {err['msg']}{got}{bounds}"


def parse_recipe(data: dict[str, Any], source: str = "<recipe>") -> BuildRecipe:
    """A :class:`BuildRecipe` from parsed TOML, validated strictly (types as written, bounded ints)."""
    if not isinstance(data, dict):
        raise ConfigError(f"invalid recipe: {source}: expected a table of sections, got {type(data).__name__}")
    try:
        return BuildRecipe.model_validate({**data, "source": source}, strict=True)
    except ValidationError as exc:
        lines = [_describe(e, source) for e in exc.errors()]
        raise ConfigError("invalid recipe:\n  " + "\n  ".join(lines)) from None


def load_recipe(path: str | Path) -> BuildRecipe:
    """Read and validate a recipe file: a regular file of at most 1 MiB, UTF-8 TOML."""
    path = Path(path)
    raw = read_regular(path, "recipe", max_bytes=MAX_RECIPE_BYTES, error=ConfigError)
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"recipe {path}: not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"recipe {path}: not valid TOML ({exc})") from None
    except (RecursionError, ValueError) as exc:
        raise ConfigError(f"recipe {path}: not a TOML file trtvocab can read ({type(exc).__name__})") from None
    return parse_recipe(data, str(path))
