"""Build recipes (``builders/*.toml``): one complete engine build each, validated by pydantic.

Unknown keys and bad values are errors that name the file, the section and key,
and what is allowed: a typo must never silently fall back to a default.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from trtvocab.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SyntheticSpec(_Section):
    """Deterministic random weights: rows are generated per 1024-row block from ``seed``,
    so every rank produces its own rows without the full matrix ever existing."""

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    seed: int = 0
    std: float = Field(default=0.02, gt=0)


class CheckpointSection(_Section):
    path: str | None = None  # HF directory or .safetensors file (relative to the recipe file)
    package: str | None = None  # or: an installed Python package that ships the checkpoint
    package_subdir: str = "model"
    tensor: str | None = None  # head tensor name; default lm_head.weight or the tied embedding
    synthetic: SyntheticSpec | None = None

    @model_validator(mode="after")
    def _one_source(self) -> CheckpointSection:
        given = [k for k in ("path", "package", "synthetic") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of path, package, synthetic (got {given or 'none'})")
        return self


class MappingSection(_Section):
    tp_size: int = Field(default=1, ge=1)
    enable_attention_dp: bool = False
    enable_lm_head_tp_in_adp: bool = False


class LMHeadSection(_Section):
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    gather_output: bool = True
    vocab_layout: Literal["uneven", "padded"] = "uneven"
    pad_to: int = Field(default=64, ge=1)
    context_logits: bool = False


class QuantizationSection(_Section):
    mode: Literal["auto", "none"] = "auto"
    weight_only: bool = False
    dequantize_fp4: bool = False  # build FP4 heads as bf16 engines on GPUs below CC 10.0


class ProfileSection(_Section):
    min_tokens: int = Field(default=1, ge=1)
    opt_tokens: int = Field(default=128, ge=1)
    max_tokens: int = Field(default=2048, ge=1)
    min_batch: int = Field(default=1, ge=1)
    opt_batch: int = Field(default=8, ge=1)
    max_batch: int = Field(default=64, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> ProfileSection:
        if not self.min_tokens <= self.opt_tokens <= self.max_tokens:
            raise ValueError("need min_tokens <= opt_tokens <= max_tokens")
        if not self.min_batch <= self.opt_batch <= self.max_batch:
            raise ValueError("need min_batch <= opt_batch <= max_batch")
        if self.max_batch > self.max_tokens:
            raise ValueError("max_batch cannot exceed max_tokens (every sequence has >= 1 token)")
        return self


class EngineSection(_Section):
    workspace_mib: int = Field(default=4096, ge=64)
    timing_cache: str | None = None
    require: bool = False  # fail the build if no TensorRT engine can be built


class OutputSection(_Section):
    # Relative to the working directory (where you run the build), unlike [checkpoint] path,
    # which is relative to the recipe file (the recipe ships next to what it names).
    dir: str = "artifacts/default"
    onnx: bool = True
    verify: bool = True  # run the exported graph on CPU and compare with the PyTorch fallback


class BuildRecipe(_Section):
    name: str = "default"
    description: str = ""
    checkpoint: CheckpointSection
    mapping: MappingSection = MappingSection()
    lm_head: LMHeadSection = LMHeadSection()
    quantization: QuantizationSection = QuantizationSection()
    profile: ProfileSection = ProfileSection()
    engine: EngineSection = EngineSection()
    output: OutputSection = OutputSection()

    source: str | None = Field(default=None, exclude=True)  # file the recipe came from

    @model_validator(mode="after")
    def _tp_fits(self) -> BuildRecipe:
        syn = self.checkpoint.synthetic
        if syn is not None and self.mapping.tp_size > syn.vocab_size:
            raise ValueError(f"mapping.tp_size ({self.mapping.tp_size}) is larger than the vocab ({syn.vocab_size})")
        return self

    def checkpoint_path(self) -> Path | None:
        """Where the checkpoint lives (None for synthetic weights)."""
        ck = self.checkpoint
        if ck.synthetic is not None:
            return None
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
    "profile": ProfileSection,
    "engine": EngineSection,
    "output": OutputSection,
}


def _describe(err: dict[str, Any], source: str) -> str:
    loc = [str(p) for p in err["loc"]]
    section, key = ".".join(loc[:-1]), loc[-1] if loc else ""
    where = f"[{section}] {key}" if section else key or "(top level)"
    if err["type"] == "extra_forbidden":
        model = _SECTIONS.get(section, BuildRecipe)
        allowed = [k for k in model.model_fields if k != "source"]
        return f"{source}: {where}: unknown key; allowed keys: {', '.join(allowed)}"
    got = f" (got {err.get('input')!r})" if loc else ""
    return f"{source}: {where}: {err['msg']}{got}"


def parse_recipe(data: dict[str, Any], source: str = "<recipe>") -> BuildRecipe:
    try:
        return BuildRecipe.model_validate({**data, "source": source})
    except ValidationError as exc:
        lines = [_describe(e, source) for e in exc.errors()]
        raise ConfigError("invalid recipe:\n  " + "\n  ".join(lines)) from None


def load_recipe(path: str | Path) -> BuildRecipe:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"recipe {path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"recipe {path}: not valid TOML ({exc})") from None
    return parse_recipe(data, str(path))
