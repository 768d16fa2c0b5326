"""Per-format weight handling of the LM head, one small strategy class per stored format.

The head never branches on the format: :func:`weight_class` picks the class that stores,
loads and multiplies its shard from one table, and the head calls ``weights(x)``.
"""

from __future__ import annotations

from trtvocab.base.formats import WeightFormat
from trtvocab.quant.config import QuantConfig
from trtvocab.quant.gguf_blocks import GGUFConfig
from trtvocab.weights.base import WeightMethod
from trtvocab.weights.dense import DenseWeight
from trtvocab.weights.fp8 import FP8Weight
from trtvocab.weights.gguf import GGUFWeight
from trtvocab.weights.nvfp4 import NVFP4Weight

FORMATS: dict[WeightFormat, type[WeightMethod]] = {
    WeightFormat.DENSE: DenseWeight,
    WeightFormat.FP8: FP8Weight,
    WeightFormat.NVFP4: NVFP4Weight,
    WeightFormat.GGUF_Q8_0: GGUFWeight,
    WeightFormat.GGUF_Q6_K: GGUFWeight,
    WeightFormat.GGUF_Q4_0: GGUFWeight,
    WeightFormat.GGUF_Q4_1: GGUFWeight,
    WeightFormat.GGUF_Q5_0: GGUFWeight,
    WeightFormat.GGUF_Q4_K: GGUFWeight,
}


def weight_class(quant_config: QuantConfig | GGUFConfig | None) -> type[WeightMethod]:
    """The weight format class for a :class:`~trtvocab.quant.config.QuantConfig` (``None`` -> dense)."""
    return FORMATS[WeightFormat.DENSE if quant_config is None else quant_config.weight_format]


__all__ = ["FORMATS", "DenseWeight", "FP8Weight", "GGUFWeight", "NVFP4Weight", "WeightMethod", "weight_class"]
