"""trtvocab: the vocabulary dimension of LLM inference (LM head, TP sharding, FP8/NVFP4, engines).

The public names are imported on first use (PEP 562), so that the command line's help and its
argument errors answer without importing torch; ``from trtvocab import LMHead`` is unchanged.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trtvocab.errors import (
    ArchitectureError,
    ArtifactError,
    CheckpointError,
    ConfigError,
    DistributedError,
    EngineUnavailableError,
    InputError,
    PeerRankError,
    QuantizationError,
    RankFailures,
    RankMismatchError,
    TrtVocabError,
)
from trtvocab.version import __version__

if TYPE_CHECKING:
    from trtvocab import sampling
    from trtvocab.base.family import EmbeddingOps, Family, HeadOps
    from trtvocab.embedding import VocabParallelEmbedding, tie_weights
    from trtvocab.lm_head import LMHead, TensorParallelMode
    from trtvocab.logits import LogitsProcessor
    from trtvocab.parallel.mapping import Mapping
    from trtvocab.parallel.sharding import VocabShard, calc_shard, padded_vocab_size, shard_sizes, vocab_shard
    from trtvocab.quant.config import QuantAlgo, QuantConfig, resolve_lm_head_quant

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "sampling": "trtvocab.sampling",
    "EmbeddingOps": "trtvocab.base.family", "Family": "trtvocab.base.family", "HeadOps": "trtvocab.base.family",
    "VocabParallelEmbedding": "trtvocab.embedding", "tie_weights": "trtvocab.embedding",
    "LMHead": "trtvocab.lm_head", "TensorParallelMode": "trtvocab.lm_head",
    "LogitsProcessor": "trtvocab.logits",
    "Mapping": "trtvocab.parallel.mapping",
    "VocabShard": "trtvocab.parallel.sharding", "calc_shard": "trtvocab.parallel.sharding",
    "padded_vocab_size": "trtvocab.parallel.sharding", "shard_sizes": "trtvocab.parallel.sharding",
    "vocab_shard": "trtvocab.parallel.sharding",
    "QuantAlgo": "trtvocab.quant.config", "QuantConfig": "trtvocab.quant.config",
    "resolve_lm_head_quant": "trtvocab.quant.config",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trtvocab' has no attribute {name!r}")
    value = importlib.import_module(module)
    if name != "sampling":
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ArchitectureError",
    "ArtifactError",
    "CheckpointError",
    "ConfigError",
    "DistributedError",
    "EmbeddingOps",
    "EngineUnavailableError",
    "Family",
    "HeadOps",
    "InputError",
    "LMHead",
    "LogitsProcessor",
    "Mapping",
    "PeerRankError",
    "QuantAlgo",
    "QuantConfig",
    "QuantizationError",
    "RankFailures",
    "RankMismatchError",
    "TensorParallelMode",
    "TrtVocabError",
    "VocabParallelEmbedding",
    "VocabShard",
    "__version__",
    "calc_shard",
    "padded_vocab_size",
    "resolve_lm_head_quant",
    "sampling",
    "shard_sizes",
    "tie_weights",
    "vocab_shard",
]
