"""Every error trtvocab raises on purpose lives here.

Each class takes one message argument so that it pickles cleanly across the
process boundary of a multi-rank launch (a rank's typed error arrives in the
parent as the same type, with the same text); RankFailures adds the per-rank errors
and pickles them along. :func:`first_line` is how their messages quote another library's exception.
"""

from __future__ import annotations


class TrtVocabError(Exception):
    """Base class of all trtvocab errors."""


class ConfigError(TrtVocabError, ValueError):
    """A mapping, head or recipe setting is impossible or inconsistent."""


class InputError(TrtVocabError, ValueError):
    """A runtime input (hidden states, seq_lens, logits) has the wrong shape, dtype or values."""


class GrammarError(InputError):
    """A ``json_schema`` / ``regex`` constraint is refused: larger or deeper than the limits, slower to
    compile than the time limit, using what xgrammar would ignore or reinterpret, or matching nothing."""


class CheckpointError(TrtVocabError, ValueError):
    """A checkpoint is missing a tensor, or holds one of the wrong shape or dtype."""


class ArchitectureError(CheckpointError):
    """A checkpoint's architecture changes the logits or the embedding rows in a way trtvocab does not
    model (a config field, a tensor); the message names the model type and the field."""


class AdapterError(CheckpointError):
    """A LoRA adapter folder (PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``) is refused:
    a method trtvocab does not run (DoRA, ...), a rank or shape that disagrees with the config or the
    model, a target module it cannot apply, NaN / inf values; the message names the file and the tensor."""


class KeywordOnlyError(TrtVocabError, TypeError):
    """A call passed positional arguments to something whose fields are keyword-only
    (``SamplingParams(0.5)``); the message names the fields to pass by name."""


class QuantizationError(TrtVocabError, ValueError):
    """A quantization config or stored scale is unusable."""


class PatternError(QuantizationError):
    """A ``re:`` pattern of a checkpoint's quantization config is refused: too long, nested too deeply,
    invalid, using a construct the bounded matcher does not run, or needing more steps than its bound."""


class DistributedError(TrtVocabError, RuntimeError):
    """A process group could not be set up, a launched rank failed, or the ranks of a group
    did not agree in a handshake (the two subclasses below)."""


class RankMismatchError(DistributedError):
    """Ranks of one group disagree about the head (vocab, hidden, tp, layout) or the batch."""


class PeerRankError(DistributedError):
    """Another rank of the group failed validation, so this rank stops before any data moves."""


class RankFailures(DistributedError):
    """One or more launched ranks raised. ``errors`` maps rank -> exception (same type as raised)."""

    def __init__(self, message: str, errors: dict[int, BaseException] | None = None) -> None:
        super().__init__(message)
        self.errors: dict[int, BaseException] = errors or {}

    def __reduce__(self):  # keep ``errors`` across pickling
        return (self.__class__, (self.args[0], self.errors))


class ArtifactError(TrtVocabError, RuntimeError):
    """A build artifact is missing, partial, corrupt or from another version."""


class WriteError(ArtifactError, OSError):
    """A file could not be written (disk full, file too large, quota, read-only filesystem); the message
    names the path and what was left as it was. Also an ``OSError``, for callers that catch those."""


class EngineUnavailableError(TrtVocabError, RuntimeError):
    """TensorRT or a suitable GPU is not available for the requested engine."""


def first_line(exc: BaseException, limit: int | None = 300) -> str:
    """The first non-blank line of an exception's message (leading blanks dropped), at most ``limit``
    characters (None: all of it), for one-line errors that quote it; ``""`` for a blank message."""
    text = str(exc).strip().splitlines()
    return text[0][:limit] if text else ""
