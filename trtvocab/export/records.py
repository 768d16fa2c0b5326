"""What the export layer hands up: the optimization profile an engine is built for, and the record
of an engine build (what it computes, read from the builder's layer table).

The artifact's manifest stores these records as they are; see docs/architecture.md ("Engines").
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trtvocab.base.formats import HIDDEN, SEQ_LENS, WeightFormat
from trtvocab.errors import ConfigError

MAX_TOKENS = 2**31 - 1  # TensorRT profile dimensions are int32


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Profile(_Strict):
    """Optimization-profile ranges: tokens T of ``hidden_states [T, H]``, batch B of ``seq_lens [B]``.

    The recipe's ``[profile]`` and :func:`trtvocab.export.tensorrt.build_engine` take this one model.
    """

    min_tokens: int = Field(default=1, ge=1, le=MAX_TOKENS)
    opt_tokens: int = Field(default=256, ge=1, le=MAX_TOKENS)
    max_tokens: int = Field(default=8192, ge=1, le=MAX_TOKENS)
    min_batch: int = Field(default=1, ge=1, le=MAX_TOKENS)
    opt_batch: int = Field(default=8, ge=1, le=MAX_TOKENS)
    max_batch: int = Field(default=256, ge=1, le=MAX_TOKENS)

    @model_validator(mode="after")
    def _ordered(self) -> Profile:
        for kind in ("tokens", "batch"):
            lo, opt, hi = (getattr(self, f"{k}_{kind}") for k in ("min", "opt", "max"))
            if not lo <= opt <= hi:
                raise ConfigError(f"profile: need min_{kind} <= opt_{kind} <= max_{kind}, got {lo}, {opt}, {hi}")
        # Every sequence has at least one token, so B <= T at each end of the range.
        if self.max_batch > self.max_tokens:
            raise ConfigError(f"profile: max_batch ({self.max_batch}) > max_tokens ({self.max_tokens}); "
                              "every sequence has at least one token")
        if self.min_batch > self.min_tokens:
            raise ConfigError(f"profile: min_batch ({self.min_batch}) > min_tokens ({self.min_tokens})")
        return self

    def shapes(self, hidden_size: int, has_seq_lens: bool) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Input name -> (min, opt, max) shapes."""
        out = {HIDDEN: tuple((t, hidden_size) for t in (self.min_tokens, self.opt_tokens, self.max_tokens))}
        if has_seq_lens:
            out[SEQ_LENS] = tuple((b,) for b in (self.min_batch, self.opt_batch, self.max_batch))
        return out


def validate_profile(profile: Profile | dict[str, Any]) -> Profile:
    """A :class:`Profile` from itself or a dict; :class:`ConfigError` naming the bad keys otherwise."""
    if isinstance(profile, Profile):
        return profile
    if not isinstance(profile, dict):
        raise ConfigError(f"profile must be a dict of min/opt/max tokens and batch, got {type(profile).__name__}")
    unknown = sorted(set(profile) - set(Profile.model_fields))
    if unknown:
        raise ConfigError(f"profile: unknown keys {unknown}; allowed: {sorted(Profile.model_fields)}")
    try:
        return Profile(**profile)
    except ValidationError as exc:
        errors = exc.errors()
        for e in errors:  # our own cross-field check, wrapped by pydantic: raise it as it was
            if isinstance(e.get("ctx", {}).get("error"), ConfigError):
                raise e["ctx"]["error"] from None
        lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors]
        raise ConfigError("profile: " + "; ".join(lines)) from None


class GemmRecord(_Strict):
    """The engine layer that multiplies by the weight: its kind, and the datatypes of the activation,
    of the weight operand (``weight_resident``: a constant of the engine, not computed per call)
    and of its output (names of :data:`trtvocab.export.layer_table.DATATYPES`)."""

    layer: str
    kind: str
    activation: str | None
    weight: str
    weight_resident: bool
    output: str | None
    weight_source: str | None = None  # not resident: the datatype of the constant it is computed from


class EngineCompute(_Strict):
    """What an engine computes, from the builder's layer table, checked against the head's contract.

    ``expected`` says the contract in words; ``problems`` name the layer and datatypes where the
    engine breaks it (empty: it holds). ``gemm`` is None for an embedding engine (``table`` is
    then the datatype of its lookup table as stored in the engine).
    """

    layers: int
    kinds: dict[str, int]
    gemm: GemmRecord | None = None
    table: str | None = None
    weights_bytes: int | None = None
    activation_bytes: int | None = None
    expected: str
    problems: list[str] = []
    notes: list[str] = []  # what costs time or memory without breaking the contract
    # A GGUF graph: what the engine multiplies by (a fused weight-only GEMM on the stored codes, or a
    # dequantized copy of the weight, resident or per call); None for every other graph.
    weight_path: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


class EngineBuild(_Strict):
    """What :func:`trtvocab.export.tensorrt.build_engine` produced.

    ``compiler``: ``tensorrt`` (built for the local GPU: ``device`` and ``compute_capability``
    name it) or ``tensorrt-rtx`` (ahead of time for ``targets``; no device).
    ``distributive_independence``: built with TensorRT's ``DISTRIBUTIVE_INDEPENDENCE`` flag (a
    deterministic head): a row's output does not depend on the other rows of the batch.
    """

    plan_path: str
    sha256: str
    bytes: int
    onnx_path: str  # the graph actually parsed (the dequantized variant in dequantize_fp4 mode)
    onnx_bytes: int = 0  # the graph's file(s) on disk, for the engine-vs-ONNX size
    graph: Literal["lm_head", "embedding"] = "lm_head"
    mode: str  # "native" | "dequantize_fp4"
    weight_format: WeightFormat
    compiler: Literal["tensorrt", "tensorrt-rtx"] = "tensorrt"
    tensorrt_version: str  # the compiler's version
    targets: list[str] = []  # the compute targets the engine holds ("sm89", ...)
    device: str | None  # the GPU's name (standard TensorRT: an engine runs only on that GPU model); None for AOT
    compute_capability: str | None
    profile: Profile
    workspace_bytes: int
    timing_cache_path: str | None
    inputs: list[str]
    outputs: list[str]
    build_seconds: float
    distributive_independence: bool = False
    compute: EngineCompute | None = None
    warnings: list[str] = []
