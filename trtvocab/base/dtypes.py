"""The one table of head dtypes: the names recipes, manifests, graphs and the CLI use.

A head computes in one of three floating-point dtypes. Files store the long name
(``"bfloat16"``); the CLI also accepts the short one (``"bf16"``); reports print the
short one.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from trtvocab.errors import ConfigError

DtypeName = Literal["float32", "bfloat16", "float16"]  # what files store (recipes, manifests: pydantic Literal)
HEAD_DTYPES: dict[str, torch.dtype] = dict(zip(get_args(DtypeName), (torch.float32, torch.bfloat16, torch.float16),
                                               strict=True))
# The head dtypes as a tuple, in the table's order: what handshakes index and every "allowed dtypes" check uses.
DTYPES: tuple[torch.dtype, ...] = tuple(HEAD_DTYPES.values())
SHORT_NAMES: dict[torch.dtype, str] = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
DTYPE_ALIASES: dict[str, torch.dtype] = {**HEAD_DTYPES, **{short: dt for dt, short in SHORT_NAMES.items()}}


def head_dtype(name: str, where: str = "dtype") -> torch.dtype:
    """``"bfloat16"`` / ``"bf16"`` (any case) -> ``torch.bfloat16``; a :class:`ConfigError` otherwise."""
    try:
        return DTYPE_ALIASES[str(name).lower()]
    except KeyError:
        raise ConfigError(f"{where}: must be one of {sorted(DTYPE_ALIASES)}, got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name files store)."""
    for name, value in HEAD_DTYPES.items():
        if value == dtype:
            return name
    raise ConfigError(f"head dtype must be one of {list(HEAD_DTYPES)}, got {dtype}")


def short_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"`` (the name reports print)."""
    if dtype not in SHORT_NAMES:
        raise ConfigError(f"head dtype must be one of {list(HEAD_DTYPES)}, got {dtype}")
    return SHORT_NAMES[dtype]
