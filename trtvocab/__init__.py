"""trtvocab: the vocabulary dimension of LLM inference (LM head, TP sharding, FP8/NVFP4, engines)."""

from trtvocab import sampling
from trtvocab.base.family import EmbeddingOps, Family, HeadOps
from trtvocab.embedding import VocabParallelEmbedding, tie_weights
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
from trtvocab.lm_head import LMHead, TensorParallelMode
from trtvocab.logits import LogitsProcessor
from trtvocab.parallel.mapping import Mapping
from trtvocab.parallel.sharding import VocabShard, calc_shard, padded_vocab_size, shard_sizes, vocab_shard
from trtvocab.quant.config import QuantAlgo, QuantConfig, resolve_lm_head_quant
from trtvocab.version import __version__

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
