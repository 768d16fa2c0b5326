"""The one validator of what every consumer of the head is handed: packed hidden states
``[T, H]`` and the ``seq_lens [B]`` that split them into sequences.

The head, the LogitsProcessor, the runtime, the ONNX and TensorRT runners, ``compare``
and ``quantize`` all call these two functions, so a bad input gets the same message
wherever it enters. :func:`hidden_states_error` *returns* its error instead of raising it:
a rank of a split head must still take part in the handshake before it raises.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from trtvocab.errors import InputError


def hidden_states_error(
    hidden: Any,
    *,
    hidden_size: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    allow_empty: bool = False,
    finite: bool = False,
    what: str = "hidden_states",
    rows: str = "T",
) -> InputError | None:
    """Why ``hidden`` is not a packed ``[T, hidden_size]`` floating-point tensor (None: it is).

    ``dtype`` / ``device``: required exactly (the head's); ``allow_empty``: ``T = 0`` is
    fine (an idle attention-DP rank); ``finite``: NaN / inf are refused (calibration data);
    ``rows``: what the first dimension is called in messages (``"N"`` where rows were selected).
    """
    if not isinstance(hidden, torch.Tensor):
        return InputError(f"{what}: expected a torch.Tensor, got {type(hidden).__name__}")
    width = "H" if hidden_size is None else str(hidden_size)
    if hidden.dim() != 2:
        return InputError(f"{what}: expected shape [{rows}, {width}], got {list(hidden.shape)}")
    if hidden_size is not None and hidden.shape[1] != hidden_size:
        return InputError(f"{what}: expected shape [{rows}, {width}], got {list(hidden.shape)} "
                          f"(hidden size {hidden.shape[1]}, the head's is {hidden_size})")
    if hidden.shape[0] == 0 and not allow_empty:
        return InputError(f"{what}: empty batch ({rows} = 0)")
    if dtype is not None and hidden.dtype != dtype:
        return InputError(f"{what}: expected dtype {dtype} (the head's), got {hidden.dtype}")
    if not hidden.dtype.is_floating_point or hidden.dtype.itemsize < 2:
        return InputError(f"{what}: expected a float16/bfloat16/float32 tensor, got {hidden.dtype}")
    if device is not None and hidden.device != device:
        return InputError(f"{what}: on {hidden.device}, the head is on {device}")
    if finite:
        return nonfinite_error(hidden, what, rows)
    return None


def nonfinite_error(tensor: torch.Tensor, what: str, rows: str = "row") -> InputError | None:
    """An :class:`InputError` naming ``what`` and the first row (and column) holding NaN or inf; None if finite."""
    bad = ~torch.isfinite(tensor)
    if not bool(bad.any()):
        return None
    where = bad.nonzero()[0].tolist()
    value = tensor[tuple(where)].item()
    at = f"row {where[0]}" + (f", column {where[1]}" if len(where) > 1 else "")
    return InputError(f"{what}: contains NaN or inf (first at {at}: {value}); every value must be finite")


def check_hidden_states(hidden: Any, **kwargs: Any) -> torch.Tensor:
    """:func:`hidden_states_error`, raised; returns ``hidden``."""
    error = hidden_states_error(hidden, **kwargs)
    if error is not None:
        raise error
    return hidden


def _short(lens: torch.Tensor) -> str:
    values = lens.tolist()
    return str(values) if len(values) <= 16 else f"{values[:16]} ... ({len(values)} lengths)"


def last_token_rows(seq_lens: Any, total_tokens: int) -> torch.Tensor:
    """Validated ``cumsum(seq_lens) - 1`` as an int64 index tensor: each sequence's last row."""
    if isinstance(seq_lens, torch.Tensor):
        lens = seq_lens
    else:
        try:
            lens = torch.as_tensor(list(seq_lens))
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise InputError(f"seq_lens: expected a 1-D sequence of ints, got {seq_lens!r}") from exc
    if lens.dim() != 1:
        raise InputError(f"seq_lens: expected a 1-D tensor, got shape {list(lens.shape)}")
    if lens.numel() == 0:
        raise InputError("seq_lens: empty batch (B = 0)")
    if lens.dtype.is_floating_point or lens.dtype == torch.bool or lens.is_complex():
        raise InputError(f"seq_lens: expected an integer dtype, got {lens.dtype}")
    try:
        total_tokens = operator.index(total_tokens)
    except TypeError:
        raise InputError(f"seq_lens: the token count T must be an int, got {total_tokens!r}") from None
    lens = lens.to(torch.int64)
    if bool((lens <= 0).any()):
        raise InputError(f"seq_lens: every length must be >= 1, got {_short(lens)}")
    # Each length against T before summing: lengths near 2**62 would wrap the int64 sum to T.
    if bool((lens > total_tokens).any()):
        i = int((lens > total_tokens).nonzero()[0])
        raise InputError(f"seq_lens: length {int(lens[i])} (sequence {i}) is longer than hidden_states' "
                         f"T = {total_tokens} rows")
    total = int(lens.sum())
    if total != total_tokens:
        raise InputError(f"seq_lens: lengths sum to {total}, but hidden_states has T = {total_tokens} rows")
    return torch.cumsum(lens, 0) - 1
