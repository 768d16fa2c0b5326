"""Per-request sampling parameters, validated where a user hands them in."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from trtvocab.errors import InputError


class SamplingParams(BaseModel):
    """How one row's next token is drawn (vLLM's order: temperature, top-k, top-p, min-p, draw).

    Args:
        temperature: ``>= 0``; 0 is greedy (the largest logit, lowest id among ties).
        top_k: ``>= 0``; keep the k largest logits (0: off).
        top_p: in ``(0, 1]``; keep the nucleus of the temperature-scaled, top-k-filtered
            distribution (1: off).
        min_p: in ``[0, 1]``; keep tokens with ``p >= min_p * p_max`` (0: off).
        seed: a non-negative int keys the row's noise by ``(seed, step, token id)``: the same
            tokens at every tp size; None draws a fresh seed per call (the same on every rank).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "SamplingParams"
            raise InputError(f"SamplingParams.{field}: {err['msg'].removeprefix('Value error, ')} "
                             f"(got {err.get('input')!r})") from None

    @field_validator("temperature", "top_p", "min_p", mode="before")
    @classmethod
    def _real(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise ValueError("must be a real number")
        return value

    @field_validator("top_k", "seed", mode="before")
    @classmethod
    def _integer(cls, value: Any) -> Any:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError("must be an int")
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if not 0 <= value < float("inf"):
            raise ValueError("must be >= 0 and finite (0 = greedy)")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be >= 0 (0 = off)")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError("must be in (0, 1]")
        return value

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, value: float) -> float:
        if not 0 <= value <= 1:
            raise ValueError("must be in [0, 1]")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value < 2**63:
            raise ValueError("must be a non-negative int below 2**63, or None")
        return value
