"""Accuracy statistics of quantized heads: llama.cpp's teacher-forced block, CI gates, the report plot.

``stats`` turns per-row float64 numbers (negative log-likelihoods, KL, Δp, ...) into
the KL-divergence statistics of llama.cpp's ``llama-perplexity`` plus EAR, KL both ways, JS and
bootstrap intervals; ``gates`` checks them against CI thresholds; ``plot`` draws a
:class:`trtvocab.accuracy.compare.CompareReport`. Nothing here runs a head.
"""

from __future__ import annotations

from trtvocab.accuracy.gates import Gates, check_gates
from trtvocab.accuracy.stats import LlamaCppStats, TokenRows, llamacpp_stats, token_rows

__all__ = ["Gates", "LlamaCppStats", "TokenRows", "check_gates", "llamacpp_stats", "token_rows"]
