"""Where this process sits among the ranks, TensorRT-LLM style (tensor parallel only)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from trtvocab.errors import ConfigError


class Mapping(BaseModel):
    """Rank layout. Ranks ``[g * tp_size, (g + 1) * tp_size)`` form TP group ``g``.

    With ``enable_attention_dp`` each rank of a TP group runs attention on its own
    requests; the LM head then stays replicated (no vocab split) unless
    ``enable_lm_head_tp_in_adp`` asks to split it, in which case the rows of every rank of
    the head's group are gathered before the GEMM and returned after it.

    ``lm_head_tp_size`` (default ``tp_size``): the head's own TP size. Ranks
    ``[h * lm_head_tp_size, (h + 1) * lm_head_tp_size)`` form head group ``h``; the vocabulary
    (head and embedding) is split over it (:attr:`lm_head_tp_rank`, :attr:`lm_head_tp_group`;
    the process groups: :func:`trtvocab.parallel.distributed.lm_head_group`). It must divide
    ``world_size``. Without attention DP the ranks of a TP group hold the same rows, so a head
    group lies inside one (``lm_head_tp_size`` divides ``tp_size``: each head group computes the
    TP group's logits over its own split). With attention DP + LM-head TP every rank brings its
    own rows, so any divisor of the world works: world 4 as 2 head groups of 2 (SGLang's
    ``enable_dp_lm_head``), or world 8 with ``tp_size`` 2 and the head over 4 (a pair of ranks
    that hold the same requests brings them once, or twice: each rank gets its own rows back).
    Attention DP without LM-head TP replicates the head: ``lm_head_tp_size`` stays ``tp_size``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    enable_attention_dp: bool = False
    enable_lm_head_tp_in_adp: bool = False
    lm_head_tp_size: int = 1  # not given (or None): tp_size, filled in before validation

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

    @model_validator(mode="before")
    @classmethod
    def _default_head_tp(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        head = data.get("lm_head_tp_size")
        if isinstance(head, bool) or (head is not None and not isinstance(head, int)):
            raise ConfigError(f"Mapping.lm_head_tp_size must be an int >= 1 (default: tp_size), got {head!r}")
        if head is None:
            data = {**data, "lm_head_tp_size": data.get("tp_size", 1)}
        return data

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
        self._check_head_tp()
        return self

    def _check_head_tp(self) -> None:
        head = self.lm_head_tp_size
        if isinstance(head, bool) or not isinstance(head, int) or head < 1:
            raise ConfigError(f"Mapping.lm_head_tp_size must be an int >= 1 (default: tp_size), got {head!r}")
        if head == self.tp_size:
            return
        if self.world_size % head:
            raise ConfigError(f"Mapping.lm_head_tp_size ({head}) must divide world_size ({self.world_size}): "
                              "the head's groups tile the world")
        if self.enable_attention_dp and not self.enable_lm_head_tp_in_adp:
            raise ConfigError(f"Mapping.lm_head_tp_size ({head}) splits the head, which attention DP replicates "
                              "unless enable_lm_head_tp_in_adp=True")
        if not self.enable_attention_dp and self.tp_size % head:
            raise ConfigError(f"Mapping.lm_head_tp_size ({head}) must divide tp_size ({self.tp_size}) without "
                              "attention DP (the ranks of a TP group hold the same rows; a head group spanning "
                              "TP groups needs enable_attention_dp=True and enable_lm_head_tp_in_adp=True)")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def tp_group(self) -> list[int]:
        first = self.rank - self.tp_rank
        return list(range(first, first + self.tp_size))

    @property
    def lm_head_tp_rank(self) -> int:
        """This rank's place in its head group (its vocabulary shard when the head is split)."""
        return self.rank % self.lm_head_tp_size

    @property
    def lm_head_tp_group(self) -> list[int]:
        """The ranks of this rank's head group (the vocabulary's split)."""
        first = self.rank - self.lm_head_tp_rank
        return list(range(first, first + self.lm_head_tp_size))

    @property
    def lm_head_is_split(self) -> bool:
        """Whether the LM head is split over the vocab (else every rank holds all of it).

        Attention DP replicates the head by default: every rank already holds
        different requests, so a vocab split would need their rows gathered first.
        """
        if self.lm_head_tp_size == 1:
            return False
        if self.enable_attention_dp:
            return self.enable_lm_head_tp_in_adp
        return True
