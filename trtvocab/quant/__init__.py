"""Quantized LM-head formats: config and gating here, numerics in fp8.py / nvfp4.py."""

from trtvocab.quant.config import (
    HeadQuantDecision,
    QuantAlgo,
    QuantConfig,
    resolve_lm_head_quant,
)

__all__ = ["HeadQuantDecision", "QuantAlgo", "QuantConfig", "resolve_lm_head_quant"]
