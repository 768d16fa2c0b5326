"""Where this process sits among the ranks, TensorRT-LLM style (tensor parallel only)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from trtvocab.errors import ConfigError


class Mapping(BaseModel):
    """Rank layout. Ranks ``[g * tp_size, (g + 1) * tp_size)`` form TP group ``g``.

    With ``enable_attention_dp`` each rank of a TP group runs attention on its own
    requests; the LM head then stays replicated (no vocab split) unless
    ``enable_lm_head_tp_in_adp`` asks to split it over the same group, in which
    case the rows of all ranks are gathered before the GEMM and returned after it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    enable_attention_dp: bool = False
    enable_lm_head_tp_in_adp: bool = False

    def __init__(self, **data: Any) -> None:
        # pydantic wraps any ValueError a validator raises (ConfigError is one) into its
        # ValidationError; callers are promised ConfigError, so unwrap it here.
        try:
            super().__init__(**data)
        except ValidationError as exc:
            for err in exc.errors():
                if isinstance(err.get("ctx", {}).get("error"), ConfigError):
                    raise err["ctx"]["error"] from None
            lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
            raise ConfigError("Mapping: " + "; ".join(lines)) from None

    @model_validator(mode="after")
    def _check(self) -> Mapping:
        if self.world_size < 1:
            raise ConfigError(f"Mapping.world_size must be >= 1, got {self.world_size}")
        if self.tp_size < 1:
            raise ConfigError(f"Mapping.tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"Mapping.rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.world_size % self.tp_size:
            raise ConfigError(
                f"Mapping.world_size ({self.world_size}) must be a multiple of tp_size ({self.tp_size})"
            )
        if self.enable_lm_head_tp_in_adp and not self.enable_attention_dp:
            raise ConfigError("Mapping.enable_lm_head_tp_in_adp requires enable_attention_dp=True")
        return self

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def tp_group(self) -> list[int]:
        first = self.rank - self.tp_rank
        return list(range(first, first + self.tp_size))

    @property
    def lm_head_is_split(self) -> bool:
        """Whether the LM head is split over the vocab (else every rank holds all of it).

        Attention DP replicates the head by default: every rank already holds
        different requests, so a vocab split would need their rows gathered first.
        """
        if self.tp_size == 1:
            return False
        if self.enable_attention_dp:
            return self.enable_lm_head_tp_in_adp
        return True
