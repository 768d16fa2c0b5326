"""What a model family's output layer and input embedding compute beyond ``x @ W.T`` and ``W[ids]``::

    logits = softcap(((x @ W.T + b) * scale) / divisor)      softcap(z) = c * tanh(z / c)
    rows   = W[ids] * embed_scale

``b`` is the head's ``[V]`` bias (sharded with its columns), ``scale`` / ``divisor`` a logit multiplier or
divisor, ``softcap`` Gemma 2's ``final_logit_softcapping``, ``embed_scale`` the scale a family's embedding
module applies itself (Gemma's ``sqrt(H)``, rounded to the table's dtype first). Each step runs in the
logits' dtype in transformers' order; elementwise, so any column range of a shard has the bits of the
whole shard. Which family computes what is read at load (:mod:`trtvocab.checkpoints.families`); these
classes are also what an API user passes to the head and the embedding. Where each op runs:
docs/architecture.md, "Model families".
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, field_validator

from trtvocab.errors import ConfigError


def _positive_finite(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


class HeadOps(BaseModel):
    """What follows ``x @ W.T`` in a family's output layer: ``softcap(((z + b) * scale) / divisor)``.

    Args:
        bias: the head has a ``[V]`` bias (loaded with the weight as ``"bias"``, sharded with its columns).
        scale: multiply the logits (1.0: no step).
        divisor: divide the logits (1.0: no step).
        softcap: ``c`` of ``c * tanh(z / c)`` (None: no soft-capping).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    bias: bool = False
    scale: float = 1.0
    divisor: float = 1.0
    softcap: float | None = None

    @field_validator("scale", "divisor", mode="before")
    @classmethod
    def _check_factor(cls, value: float, info: Any) -> float:
        return _positive_finite(value, f"HeadOps.{info.field_name}")

    @field_validator("softcap", mode="before")
    @classmethod
    def _check_softcap(cls, value: float | None) -> float | None:
        return None if value is None else _positive_finite(value, "HeadOps.softcap")

    @property
    def is_identity(self) -> bool:
        """Whether the head is plain ``x @ W.T``."""
        return not self.bias and self.scale == 1.0 and self.divisor == 1.0 and self.softcap is None

    def describe(self) -> str:
        """``"+ bias, * 0.0625, softcap 30"``, or ``"x @ W.T"`` for a plain head."""
        parts = (["+ bias"] if self.bias else []) + ([f"* {self.scale:g}"] if self.scale != 1.0 else []) \
            + ([f"/ {self.divisor:g}"] if self.divisor != 1.0 else []) \
            + ([f"softcap {self.softcap:g}"] if self.softcap is not None else [])
        return ", ".join(parts) if parts else "x @ W.T"

    def apply_(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The steps on ``logits [N, C]`` (a fresh tensor: changed in place and returned); ``bias``:
        the ``[C]`` float32 bias of the same columns (required when :attr:`bias`)."""
        if self.bias:
            if bias is None:
                raise ConfigError("HeadOps(bias=True): the head holds no bias")
            if logits.dtype == torch.float32:
                logits.add_(bias)
            else:
                logits.copy_(logits.float().add_(bias))
        if self.scale != 1.0:
            logits.mul_(self.scale)
        if self.divisor != 1.0:
            logits.div_(self.divisor)
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    def digest(self) -> int:
        """A 62-bit integer that differs between different ops (what ranks compare in a handshake);
        computed once per (frozen) instance: every split forward asks for it."""
        return self._digest

    @functools.cached_property
    def _digest(self) -> int:
        raw = hashlib.sha256(self.model_dump_json().encode()).digest()
        return int.from_bytes(raw[:8], "little") >> 2


class EmbeddingOps(BaseModel):
    """What a family's embedding module does to the looked-up rows: ``rows * scale``.

    Args:
        scale: the multiplier (1.0: no step).
        round_scale: round ``scale`` to the table's dtype before multiplying (Gemma, MiniCPM3:
            ``embed_scale.to(weight.dtype)``); False multiplies by the Python float (XGLM).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    scale: float = 1.0
    round_scale: bool = True

    @field_validator("scale", mode="before")
    @classmethod
    def _check_scale(cls, value: float) -> float:
        return _positive_finite(value, "EmbeddingOps.scale")

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0

    def describe(self) -> str:
        return "W[ids]" if self.is_identity else f"W[ids] * {self.scale:g}"

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` times the scale, in ``rows``' dtype (transformers' rounding)."""
        if self.is_identity:
            return rows
        if self.round_scale:
            return rows * torch.tensor(self.scale, dtype=torch.float32).to(rows.dtype)
        return rows * self.scale


class Family(BaseModel):
    """A checkpoint's family, as far as the vocabulary ends care.

    Args:
        architecture: the model type (``config.json`` ``model_type``, or the GGUF
            ``general.architecture``); ``""`` when the checkpoint names none.
        head: the output layer's steps after ``x @ W.T``.
        embedding: the embedding module's steps after the lookup.
        bias_tensor: the checkpoint tensor holding the head's bias (when ``head.bias``).
        source: where each non-trivial step came from (``"final_logit_softcapping = 30"``).
        body: what the family's body applies itself (documented, not computed here).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    architecture: str = ""
    head: HeadOps = HeadOps()
    embedding: EmbeddingOps = EmbeddingOps()
    bias_tensor: str | None = None
    source: tuple[str, ...] = ()
    body: tuple[str, ...] = ()

