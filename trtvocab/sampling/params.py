"""Per-request sampling parameters, validated where a user hands them in."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trtvocab.errors import InputError, KeywordOnlyError
from trtvocab.sampling.noise import mix_int

# Temperatures below this draw greedily (vLLM's ``_SAMPLING_EPS``): at such T the softmax of
# ``logits / T`` is one token wherever the logits differ by more than ~1e-3, and below it
# ``logits / T`` leaves the float32 range (|logit| > 1e-5 * 3.4e38 ~ 3.4e33 overflows at
# T = 1e-5, |logit| > 3.4 at a subnormal T ~ 1e-38), where the race would pick among ``inf``
# ties instead of the argmax. docs/architecture.md "Sampling edge values".
GREEDY_BELOW = 1e-5
# logit_bias values: OpenAI's API and vLLM's server bound them to [-100, 100]. A bias of 1e7 already absorbs
# the logits' differences and the noise in float32 (an equal bias on two ids must leave their odds alone);
# -inf stays allowed as an explicit ban (bad_words / allowed_token_ids are the other ways to ban).
MAX_LOGIT_BIAS = 100.0
# repetition_penalty bounds: logit / 1e-45 overflows float32 for every positive logit (the lowest such id
# would win); a penalty past 100 is a ban by another name. Real values: 1.0 .. 2.0.
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")  # vLLM's names


class SamplingParams(BaseModel):
    """How one row's next token is drawn (the order and each knob's exact semantics: docs/sampling.md).

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
        repetition_penalty: in ``[0.01, 100]`` (:data:`REPETITION_PENALTY_RANGE`); ids in the prompt or the
            output: positive logits divided by it, negative ones multiplied (1: off).
        presence_penalty, frequency_penalty: in ``[-2, 2]``; subtracted once per id present in the
            output / once per occurrence (0: off).
        logit_bias: ``{id: bias}`` added to those logits (ids checked against the vocab per call); each bias
            in ``[-100, 100]`` as OpenAI's API and vLLM's server bound it, or ``-inf``: a ban.
        allowed_token_ids: only these ids may be drawn (None: all).
        bad_words: token sequences; the last token of each is banned when the others end the output.
        min_tokens: the stop ids (and eos, unless ``ignore_eos``) are banned until this many tokens.
        stop_token_ids: ids that end the sequence (the generate loop) besides eos.
        ignore_eos: eos neither ends the sequence nor is banned by ``min_tokens``.
        typical_p: in ``(0, 1]``; locally typical sampling (transformers' ``TypicalLogitsWarper``; 1: off).
        logprobs: None (off) or ``N >= 0``: return the top-N and the sampled token's logprob and rank.
        logprobs_mode: ``raw_logprobs`` (what the head gave) or ``processed_logprobs`` (after every
            step), or the ``*_logits`` variants (vLLM's names).
        prompt_logprobs: None (off) or ``N >= 0``: each prompt token's raw logprob and rank and the
            top-N of its position (``generate``; ``sampling.chunked.stream_prompt_logprobs`` streams them).
        n: ``>= 1`` completions of the prompt (``generate``), each its own seed stream
            (:meth:`sample_seed`).
        beam_width: ``>= 1``; above 1 ``generate`` runs greedy beam search (transformers' ``num_beams``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = Field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    typical_p: float = 1.0
    logprobs: int | None = None
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"] = "raw_logprobs"
    prompt_logprobs: int | None = None
    n: int = 1
    beam_width: int = 1

    @property
    def penalizes(self) -> bool:
        """Whether a repetition, presence or frequency penalty is on."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def processes(self) -> bool:
        """Whether a column-local logits processor is on (bans, bias, penalties)."""
        return (self.penalizes or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words) or (self.min_tokens > 0 and not (self.ignore_eos and not self.stop_token_ids)))

    def sample_seed(self, index: int) -> int | None:
        """The seed of completion ``index`` of ``n``: the row's own seed for 0, then a SplitMix64 mix of
        ``(seed, index)`` (no other request's seed ``seed + 1`` shares its stream); None stays None."""
        if self.seed is None or index == 0:
            return self.seed
        return mix_int(mix_int(self.seed + 0x9E3779B97F4A7C15) ^ index) & (2**63 - 1)

    def max_token_id(self) -> int:
        """The largest id any field names (-1: none): checked against the vocab at each call."""
        ids = [*self.logit_bias, *(self.allowed_token_ids or ()), *(i for w in self.bad_words for i in w),
               *self.stop_token_ids]
        return max(ids, default=-1)

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

    @field_validator("temperature", "top_p", "min_p", "typical_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", mode="before")
    @classmethod
    def _real(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise ValueError("must be a real number")
        return value

    @field_validator("top_k", "seed", "min_tokens", "logprobs", "prompt_logprobs", "n", "beam_width",
                     mode="before")
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

    @field_validator("typical_p")
    @classmethod
    def _typical_p(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError("must be in (0, 1]")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition(cls, value: float) -> float:
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= value <= hi:
            raise ValueError(f"must be in [{lo:g}, {hi:g}] (1 = off; outside it logit / penalty overflows or "
                             "bans)")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value: float) -> float:
        if not -2 <= value <= 2:
            raise ValueError("must be in [-2, 2] (0 = off)")
        return value

    @field_validator("min_tokens", "logprobs", "prompt_logprobs")
    @classmethod
    def _count(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value < 2**31:
            raise ValueError("must be an int >= 0")
        return value

    @field_validator("n", "beam_width")
    @classmethod
    def _n(cls, value: int) -> int:
        if not 1 <= value <= 1024:
            raise ValueError("must be an int in [1, 1024]")
        return value

    @field_validator("ignore_eos", mode="before")
    @classmethod
    def _bool(cls, value: Any) -> Any:
        if not isinstance(value, bool):
            raise ValueError("must be a bool")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            raise ValueError("must be a dict {token id: bias}")
        for i, b in value.items():
            _token_id(i)
            if isinstance(b, bool) or not isinstance(b, int | float) \
                    or not (-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS or b == -float("inf")):
                raise ValueError(f"bias of id {i} must be a number in [-100, 100] (or -inf: a ban), got {b!r:.40}")
        return {int(i): float(b) for i, b in value.items()}

    @field_validator("allowed_token_ids", "stop_token_ids", mode="before")
    @classmethod
    def _ids(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str | bytes | dict) or not hasattr(value, "__iter__"):
            raise ValueError("must be a list of token ids")
        ids = tuple(_token_id(i) for i in value)
        return ids

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None and not value:
            raise ValueError("must name at least one id (None: every id)")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stops(cls, value: tuple[int, ...] | None) -> tuple[int, ...]:
        if value is None:
            raise ValueError("must be a list of token ids")
        return value

    @field_validator("bad_words", mode="before")
    @classmethod
    def _bad_words(cls, value: Any) -> Any:
        if isinstance(value, str | bytes | dict) or not hasattr(value, "__iter__"):
            raise ValueError("must be a list of token id sequences")
        words = []
        for w in value:
            if isinstance(w, str | bytes | dict) or not hasattr(w, "__iter__") or not list(w):
                raise ValueError(f"each entry must be a non-empty list of token ids, got {w!r}")
            words.append(tuple(_token_id(i) for i in w))
        return tuple(words)


def _token_id(value: Any) -> int:
    """``value`` as a token id: a non-negative int (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**62:
        raise ValueError(f"token ids must be ints >= 0, got {value!r}")
    return int(value)

