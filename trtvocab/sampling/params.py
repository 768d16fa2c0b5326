"""Per-request sampling parameters, validated where a user hands them in."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from trtvocab.errors import InputError, KeywordOnlyError

# Temperatures below this draw greedily (vLLM's ``_SAMPLING_EPS``): at such T the softmax of
# ``logits / T`` is one token wherever the logits differ by more than ~1e-3, and below it
# ``logits / T`` leaves the float32 range (|logit| > 1e-5 * 3.4e38 ~ 3.4e33 overflows at
# T = 1e-5, |logit| > 3.4 at a subnormal T ~ 1e-38), where the race would pick among ``inf``
# ties instead of the argmax. docs/architecture.md "Sampling edge values".
GREEDY_BELOW = 1e-5


class SamplingParams(BaseModel):
    """How one row's next token is drawn (vLLM's order: temperature, top-k, top-p, min-p, draw).

    Every field is keyword-only: ``SamplingParams(temperature=0.5)``; a positional argument
    raises :class:`~trtvocab.errors.KeywordOnlyError` (a ``TypeError``) saying so.

    Args:
        temperature: ``>= 0``; 0 is greedy (the largest logit, lowest id among ties), and so is
            every temperature below :data:`GREEDY_BELOW` (``1e-5``, as vLLM): subnormal and tiny
            temperatures (``1e-45 .. 1e-6``) draw exactly the greedy token and skip top-k / top-p /
            min-p, instead of overflowing ``logits / T`` (:attr:`greedy`).
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

    @property
    def greedy(self) -> bool:
        """Whether this row draws greedily: ``temperature < GREEDY_BELOW`` (0 included)."""
        return self.temperature < GREEDY_BELOW

    def __init__(self, *args: Any, **data: Any) -> None:
        if args:
            names = list(type(self).model_fields)
            hint = ", ".join(f"{n}={v!r}" for n, v in zip(names, args, strict=False))
            raise KeywordOnlyError(f"SamplingParams fields are keyword-only ({', '.join(n + '=' for n in names)}); "
                                   f"got {len(args)} positional argument(s): write SamplingParams({hint})")
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
        if not 0 <= value < 2**63:
            raise ValueError("must be >= 0 (0 = off) and below 2**63")
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
