"""What a build stores: :class:`Manifest` (``OUT/manifest.json``) and its per-rank records.

Read and written only by :mod:`trtvocab.artifact.store`, strictly (``Manifest.model_validate_json(...,
strict=True)``). The engine records come from :mod:`trtvocab.export.records`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from trtvocab.artifact.recipe import MAX_HIDDEN, MAX_TP, MAX_VOCAB, BuildRecipe, LMHeadSection, MappingSection
from trtvocab.base.family import Family
from trtvocab.base.formats import Runtime, WeightFormat
from trtvocab.errors import ArtifactError, ConfigError
from trtvocab.export.records import EngineBuild, Profile
from trtvocab.parallel.sharding import VocabPlacement, vocab_placement
from trtvocab.quant.config import QuantConfig
from trtvocab.quant.gguf_blocks import GGUFConfig


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HeadRecord(LMHeadSection):
    """The head every rank is a shard of: the recipe's ``[lm_head]`` plus what the checkpoint said."""

    vocab_size: int = Field(ge=1, le=MAX_VOCAB)
    hidden_size: int = Field(ge=1, le=MAX_HIDDEN)
    tensor: str | None = None
    # What the family's output layer and embedding compute beyond x @ W.T / W[ids] (the checkpoint's).
    family: Family = Family()


class QuantRecord(_Record):
    """How the head is quantized, and why (the gating verdict)."""

    weight_format: WeightFormat
    label: str  # e.g. "FP8 W8A8", "dense bf16"
    config: QuantConfig | GGUFConfig | None  # GGUFConfig: a GGUF head kept in its stored blocks
    stored: str | None  # the stored bytes' format when it differs from dense (FP8 / NVFP4 / a GGUF block type)
    dequantized: bool
    reason: str


class VerifyRecord(_Record):
    """The exported graph run on CPU against the PyTorch fallback."""

    backend: Runtime  # what ran the graph (manifests written before the enum say "reference": onnx.reference)
    max_abs_err: float
    tolerance: float
    ok: bool
    argmax_equal: bool








class EngineRecord(_Record):
    """The engine stage of one rank: built (with its :class:`EngineBuild`) or skipped, and why."""

    built: bool
    reason: str | None = None
    build: EngineBuild | None = None


class RankFiles(_Record):
    """A rank's files, relative to the artifact root."""

    weights: str
    onnx: str | None = None
    plan: str | None = None
    embedding_onnx: str | None = None
    embedding_plan: str | None = None


class RankEntry(_Record):
    """One rank of the artifact: its columns ``[start, end)`` inside a buffer of ``width``."""

    rank: int = Field(ge=0, lt=MAX_TP)
    start: int = Field(ge=0, le=MAX_VOCAB)
    end: int = Field(ge=0, le=MAX_VOCAB)
    width: int = Field(ge=0, le=MAX_VOCAB)
    weight_format: WeightFormat
    resident_bytes: int = Field(ge=0)
    files: RankFiles
    verify: VerifyRecord | None = None
    engine: EngineRecord
    quant: QuantRecord
    embedding_verify: VerifyRecord | None = None  # the embedding graph against the PyTorch module
    embedding_engine: EngineRecord | None = None  # the embedding graph's engine (when exported)


class FileRecord(_Record):
    """A file of the artifact: its sha256 and size, checked on every load."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0, lt=2**63)


class BackendsRecord(_Record):
    """Which backends the build produced files for (every rank)."""

    torch: bool = True
    onnx: bool
    tensorrt: bool


class Manifest(_Record):
    """``OUT/manifest.json``: what was built, from what, with which versions; sha256 of every file."""

    format: str
    format_version: int
    created: str
    versions: dict[str, str]
    recipe: BuildRecipe
    recipe_file: str | None
    checkpoint: str  # the checkpoint path, or "synthetic"
    checkpoint_sha256: str | None = None  # trtvocab.checkpoints.provenance.head_digest of it (None: synthetic weights)
    head: HeadRecord
    mapping: MappingSection
    quant: QuantRecord
    profile: Profile
    ranks: list[RankEntry]
    ranks_built: list[int]
    backends: BackendsRecord
    files: dict[str, FileRecord] = {}
    digest: str | None = None  # sha256 of the canonical body without this key (trtvocab.artifact.store.body_digest)

    def entry(self, rank: int) -> RankEntry:
        """The entry of ``rank`` (a partial build, of some ``ranks``, holds only those)."""
        for e in self.ranks:
            if e.rank == rank:
                return e
        raise ConfigError(f"the artifact holds ranks {self.ranks_built}, not rank {rank}")

    def placement(self, rank: int, process_group: object = None) -> VocabPlacement:
        """Where ``rank``'s columns are (what the sampler of this artifact's logits reads), from the
        recorded split alone: no weight is read. Its entry must hold exactly those columns."""
        head = self.head
        place = vocab_placement(head.vocab_size, self.mapping.tp_size, rank, head.vocab_layout, head.pad_to,
                                process_group=process_group)
        entry = self.entry(rank)
        if (entry.start, entry.end, entry.width) != (place.vocab_start, place.vocab_end, place.shard.width):
            raise ArtifactError(f"the artifact's rank {rank} holds columns [{entry.start}, {entry.end}) of width "
                                f"{entry.width}; its {head.vocab_layout} split of {head.vocab_size} over "
                                f"{self.mapping.tp_size} gives [{place.vocab_start}, {place.vocab_end}) of width "
                                f"{place.shard.width}")
        return place

    @property
    def complete(self) -> bool:
        """Whether every rank of the TP group was built (inference needs all of them)."""
        return len(self.ranks) == self.mapping.tp_size

    def require_complete(self, where: str, what: str) -> None:
        """Refuse a partial build (some ``ranks``) where ``what`` needs every rank: an :class:`ArtifactError`
        opening with ``where`` (the artifact as the caller names it)."""
        if not self.complete:
            raise ArtifactError(f"{where}: holds ranks {self.ranks_built} of tp {self.mapping.tp_size}; {what} "
                                "needs all of them")
