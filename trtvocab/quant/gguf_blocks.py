"""GGUF block formats a head runs in (Q8_0, Q6_K, Q4_0, Q4_1, Q5_0, Q4_K): the config, the exact decode,
the float32 chain.

The weight is ``gguf.quants.dequantize``'s value bit for bit (Q8_0, Q4_0, Q5_0 ``d * q``; Q6_K
``(d * sc) * q``; Q4_1 ``d * q + m``; Q4_K ``(d * sc) * q - dmin * m``, each operation rounded to
float32 as numpy does: the products are exact, the add of Q4_1 / Q4_K rounds once); a logit is the documented chain
(docs/architecture.md, "GGUF heads in their stored blocks"): 8 float32 lanes over H, lane ``l``
of step ``s`` holds element ``8 s + l``, ``acc = acc + w * x`` (a rounded product, then a rounded
sum: no FMA), the lanes reduced as ``((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7))``, then ``+ 0``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from trtvocab.base.formats import GGUF_PREFIX, Activation, WeightFormat
from trtvocab.errors import CheckpointError, ConfigError

LANES = 8
CHAIN_ELEMENTS = 1 << 20  # float32 products per torch chain chunk ([N, rows, H]): 4 MiB, reused chunk to chunk


def first_nonfinite_scale(raw: torch.Tensor, block_type: str) -> tuple[int, int, str, float] | None:
    """``(row, block, scale name, value)`` of the first NaN / inf fp16 block scale of rows ``raw [R, row_bytes]``
    (row-major; None: every scale finite). One fp16 per 32 or 256 values is read, never the codes: a NaN
    or inf ``d`` / ``m`` / ``dmin`` would multiply into every logit of that token."""
    size = BLOCK_TYPES[block_type].bytes
    if raw.numel() == 0:
        return None
    blocks = raw.reshape(raw.shape[0], -1, size)
    first: tuple[int, int, str, float] | None = None
    for name, at in BLOCK_TYPES[block_type].scales:
        scale = blocks[..., at : at + 2].contiguous().view(torch.float16).reshape(blocks.shape[0], -1)
        bad = (~torch.isfinite(scale)).nonzero()
        if bad.numel():
            row, block = (int(v) for v in bad[0])
            if first is None or (row, block) < first[:2]:
                first = (row, block, name, float(scale[row, block]))
    return first


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from ``raw [..., 2]`` uint8, as float32 (exact)."""
    return raw.contiguous().view(torch.float16).float()


def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """float32 ``[R, H]`` of Q8_0 rows ``raw [R, H / 32 * 34]``: ``q * d`` as gguf.quants computes it."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = _f16(blocks[..., :2])
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (q * d).reshape(raw.shape[0], -1)


def dequantize_q6_k(raw: torch.Tensor) -> torch.Tensor:
    """float32 ``[R, H]`` of Q6_K rows ``raw [R, H / 256 * 210]``: ``(d * sc) * q`` as gguf.quants computes it."""
    rows = raw.shape[0]
    b = raw.reshape(-1, 210)
    nb = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * sc).reshape(nb, 16, 1)
    shifts4 = torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    shifts2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    lo = ((ql.reshape(nb, 2, 1, 64) >> shifts4) & 0x0F).reshape(nb, 8, 32)
    hi = ((qh.reshape(nb, 2, 1, 32) >> shifts2) & 0x03).reshape(nb, 8, 32)
    q = ((lo | (hi << 4)).to(torch.int16) - 32).reshape(nb, 16, 16).float()
    return (d * q).reshape(rows, -1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[nb, 32]`` codes 0..15 of ``qs [nb, 16]``: byte ``j``'s low nibble is element ``j``, its high
    one ``j + 16``."""
    return torch.cat([qs & 0x0F, qs >> 4], 1)


def dequantize_q4_0(raw: torch.Tensor) -> torch.Tensor:
    """float32 ``[R, H]`` of Q4_0 rows (18-byte blocks): ``d * (q - 8)``."""
    b = raw.reshape(-1, 18)
    q = (_nibbles(b[:, 2:]).to(torch.int16) - 8).float()
    return (_f16(b[:, :2]) * q).reshape(raw.shape[0], -1)


def dequantize_q4_1(raw: torch.Tensor) -> torch.Tensor:
    """float32 ``[R, H]`` of Q4_1 rows (20-byte blocks): ``d * q + m`` (an exact product, one rounded add)."""
    b = raw.reshape(-1, 20)
    return (_f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])).reshape(raw.shape[0], -1)


def dequantize_q5_0(raw: torch.Tensor) -> torch.Tensor:
    """float32 ``[R, H]`` of Q5_0 rows (22-byte blocks): ``d * (q - 16)``; bit ``j`` of ``qh`` is element
    ``j``'s fifth bit."""
    b = raw.reshape(-1, 22)
    qh = b[:, 2:6].to(torch.int64)
    qh = qh[:, 0] | (qh[:, 1] << 8) | (qh[:, 2] << 16) | (qh[:, 3] << 24)
    five = (qh[:, None] >> torch.arange(32)) & 1
    q = ((_nibbles(b[:, 6:]).to(torch.int64) | (five << 4)) - 16).float()
    return (_f16(b[:, :2]) * q).reshape(raw.shape[0], -1)


def q4_k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 6-bit ``(sc, m) [nb, 8]`` of the 12 packed bytes ``scales [nb, 12]`` (gguf.quants' layout)."""
    s = scales.to(torch.int16)
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], 1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], 1)
    return sc, mn


def dequantize_q4_k(raw: torch.Tensor) -> torch.Tensor:
    """float32 ``[R, H]`` of Q4_K rows (144-byte blocks of 256): ``(d * sc) * q - dmin * m`` per sub-block of 32."""
    b = raw.reshape(-1, 144)
    nb = b.shape[0]
    sc, mn = q4_k_scales(b[:, 4:16])
    ds = (_f16(b[:, :2]) * sc.float()).reshape(nb, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).reshape(nb, 8, 1)
    qs = b[:, 16:].reshape(nb, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(nb, 8, 32).float()
    return (ds * q - dm).reshape(raw.shape[0], -1)


@dataclass(frozen=True)
class BlockType:
    """One GGUF block type a head runs in, as stored: every fact the kernels, the loaders, the embedding and the
    ONNX exporter need of it (they derive from :data:`BLOCK_TYPES`; docs/kernels.md, "Adding a GGUF block type").

    ``kind`` is ``trtvocab_gguf_logits``' kind, the C++ ``enum Kind`` of ``csrc/gguf.cpp`` (a test holds the two
    equal); ``scales`` the fp16 scales' ``(name, byte offset)`` inside a block, as ``gguf.quants`` reads them;
    ``onnx_codes`` the codes' ONNX type in a blocked ``DequantizeLinear`` graph (``"int8"`` / ``"int4"``), None
    where no graph holds the type's blocks (such a head exports float32-dequantized)."""

    name: str  # the GGML type name (gguf.GGMLQuantizationType)
    values: int  # per block
    bytes: int  # per block
    kind: int
    scales: tuple[tuple[str, int], ...]
    dequantize: Callable[[torch.Tensor], torch.Tensor]
    onnx_codes: str | None = None

    @property
    def weight_format(self) -> WeightFormat:
        return WeightFormat(GGUF_PREFIX + self.name)


# One row per block type, in kind order.
BLOCK_TYPES: dict[str, BlockType] = {t.name: t for t in (
    BlockType("Q8_0", 32, 34, 0, (("d", 0),), dequantize_q8_0, onnx_codes="int8"),
    BlockType("Q6_K", 256, 210, 1, (("d", 208),), dequantize_q6_k),
    BlockType("Q4_0", 32, 18, 2, (("d", 0),), dequantize_q4_0, onnx_codes="int4"),
    BlockType("Q4_1", 32, 20, 3, (("d", 0), ("m", 2)), dequantize_q4_1, onnx_codes="int4"),
    BlockType("Q5_0", 32, 22, 4, (("d", 0),), dequantize_q5_0),
    BlockType("Q4_K", 256, 144, 5, (("d", 0), ("dmin", 2)), dequantize_q4_k),
)}
NAMES = tuple(BLOCK_TYPES)
BY_FORMAT: dict[WeightFormat, BlockType] = {t.weight_format: t for t in BLOCK_TYPES.values()}
FORMATS = tuple(BY_FORMAT)  # every GGUF WeightFormat, in kind order
ONNX_FORMATS = tuple(t.weight_format for t in BLOCK_TYPES.values() if t.onnx_codes)  # blocked DequantizeLinear
# Views of the table by the names older callers use.
BLOCKS: dict[str, tuple[int, int]] = {t.name: (t.values, t.bytes) for t in BLOCK_TYPES.values()}
SCALES: dict[str, tuple[tuple[str, int], ...]] = {t.name: t.scales for t in BLOCK_TYPES.values()}
DEQUANTIZE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {t.name: t.dequantize for t in BLOCK_TYPES.values()}


def of_format(fmt: WeightFormat) -> BlockType:
    """The row of a GGUF ``fmt`` (:attr:`WeightFormat.is_gguf`); ``KeyError`` for any other format."""
    return BY_FORMAT[fmt]


class GGUFConfig(BaseModel):
    """A head kept in a GGUF block type (what ``LMHead(quant_config=...)`` takes for one).

    Args:
        block_type: a name of :data:`BLOCK_TYPES` (the GGML type name).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_type: Literal[NAMES]  # type: ignore[valid-type]  # the table's names, in its order

    def __init__(self, **data: Any) -> None:
        # A public quant_config of LMHead: its errors are ConfigErrors naming the field, as Mapping's are.
        try:
            super().__init__(**data)
        except ValidationError as exc:
            lines = [f"{'.'.join(map(str, e['loc'])) or 'GGUFConfig'}: {e['msg']} (got {e.get('input')!r:.60})"
                     for e in exc.errors()]
            raise ConfigError(f"GGUFConfig: {'; '.join(lines)}") from None
    activation: Activation = Activation.NONE  # activations stay float (llama.cpp quantizes them to Q8)

    @property
    def weight_format(self) -> WeightFormat:
        return BLOCK_TYPES[self.block_type].weight_format

    @property
    def label(self) -> str:
        return f"GGUF {self.block_type}"

    @property
    def block(self) -> int:
        return BLOCK_TYPES[self.block_type].values

    @property
    def type_size(self) -> int:
        return BLOCK_TYPES[self.block_type].bytes

    def row_bytes(self, hidden: int) -> int:
        """Stored bytes of one row of ``hidden`` values."""
        if hidden % self.block:
            raise CheckpointError(f"GGUF {self.block_type}: H = {hidden} is not a multiple of {self.block}")
        return hidden // self.block * self.type_size


def tree8(lanes: torch.Tensor) -> torch.Tensor:
    """The fixed reduction of ``[..., 8]`` lanes: ``((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7))``, then ``+ 0``."""
    lane = lanes.unbind(-1)
    return (((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]))) + 0.0


def chain_logits(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``x [N, H]`` times float32 ``w [R, H]`` in the chain (module docstring): ``[N, R]``.

    Bitwise the fused kernels' logits (each lane a rounded product then a rounded sum), in bounded
    chunks of rows; slow (one torch op per step), the path where the kernels do not build."""
    n, hidden = x.shape
    rows = w.shape[0]
    if hidden % LANES:
        raise ValueError(f"chain_logits: H = {hidden} is not a multiple of {LANES}")
    out = torch.empty(n, rows, dtype=torch.float32) if out is None else out
    if n == 0 or rows == 0:
        return out
    steps = hidden // LANES
    step_rows = min(rows, max(1, CHAIN_ELEMENTS // max(1, n * hidden)))
    xs = x.float().reshape(n, 1, steps, LANES)
    # one product buffer and one accumulator for every chunk: the peak is one chunk's products, not two
    prod_buf = torch.empty(n * step_rows * hidden, dtype=torch.float32)
    acc_buf = torch.empty(n * step_rows * LANES, dtype=torch.float32)
    for a in range(0, rows, step_rows):
        b = min(rows, a + step_rows)
        prod = prod_buf[: n * (b - a) * hidden].view(n, b - a, steps, LANES)
        torch.mul(w[a:b].reshape(1, b - a, steps, LANES), xs, out=prod)  # [N, r, S, 8], each product rounded
        acc = acc_buf[: n * (b - a) * LANES].view(n, b - a, LANES).zero_()
        for s in range(steps):
            acc.add_(prod[:, :, s])
        out[:, a:b] = tree8(acc)
    return out
