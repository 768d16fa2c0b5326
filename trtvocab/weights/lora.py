"""PEFT LoRA adapters on the two vocabulary modules, one shard at a time.

:func:`open_adapter` reads an adapter folder's ``adapter_config.json`` and ``adapter_model.safetensors``
header; :func:`shard_adapter` reads one rank's part of the head or the embedding as a :class:`ShardAdapter`::

    head  lm_head.lora_A.weight [r, H] replicated, lora_B.weight [V, r] own rows   += s (x A^T) B^T
    emb   lora_embedding_A [r, V] own columns, lora_embedding_B [H, r] replicated  += s A^T[ids] B^T
    both  modules_to_save copy [V, H] and trainable tokens [k, H]: own rows, replace the base rows
    both  modules_to_save copy [V + k, H] of a resized table: also adds k tokens, whose rows each rank
          keeps for its piece of the module's added segment (trtvocab.parallel.added_vocab)

``s = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA). DoRA and the other methods that change the formula,
shapes that disagree with the config or the model, NaN / inf and modules other than the two are refused
(:class:`~trtvocab.errors.AdapterError`, naming the file and the tensor or field). The functions below
apply each row's adapter; the full table, mixed batches and tied heads: docs/architecture.md, "LoRA adapters".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from trtvocab.base.safe_read import file_kind, load_json_file
from trtvocab.checkpoints.checkpoint import Checkpoint
from trtvocab.checkpoints.names import EMBEDDING_NAMES
from trtvocab.errors import AdapterError, CheckpointError
from trtvocab.parallel.sharding import VocabShard, vocab_shard
from trtvocab.weights.base import read_rows

CONFIG_FILE = "adapter_config.json"
# The largest |lora_alpha / r| accepted: the bound of a family's logit factors (trtvocab.checkpoints.families
# FACTOR_RANGE; real adapters: 0.5 .. 64).
MAX_SCALING = 2.0**24
# Factor dtypes read as values: what PEFT saves (float8 bytes would be codes without their scale).
FACTOR_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
HEAD_MODULE = "lm_head"
EMBEDDING_MODULES = tuple(n.rsplit(".", 1)[0] for n in EMBEDDING_NAMES)
# Config fields that change what an adapter computes beyond LoRA's formula: refused by name when set.
REFUSED_FIELDS = {
    "use_dora": "DoRA (weight-decomposed LoRA: a magnitude vector rescales every column)",
    "use_qalora": "QALoRA",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "ensure_weight_tying": "ensure_weight_tying (LoRA tied across the embedding and the head)",
    "lora_bias": "lora_bias (a bias on lora_B)",
    "target_parameters": "target_parameters (LoRA on raw parameters)",
    "fan_in_fan_out": "fan_in_fan_out (transposed weights)",
}
# What each tensor suffix of a vocab module is.
SUFFIXES = {
    "lora_A.weight": "lora_A", "lora_B.weight": "lora_B", "lora_embedding_A": "emb_A", "lora_embedding_B": "emb_B",
    "base_layer.weight": "base", "weight": "copy", "token_adapter.trainable_tokens_delta": "tokens",
}
Module = Literal["head", "embedding"]


@dataclass
class ShardAdapter:
    """One adapter's part of one shard of one vocabulary module (all optional; see the module docstring).

    ``lora_a`` / ``lora_b``: float32; for the head ``[r, H]`` and ``[V_local, r]``, for the embedding
    ``[V_local, r]`` (columns of ``lora_embedding_A``, transposed) and ``[H, r]``. ``copy``: the
    ``[V_local, H]`` table that replaces the shard's rows. ``token_index`` (sorted, local ids) and
    ``token_rows`` ``[k, H]``: rows that replace single rows (trainable tokens). ``added``: how many tokens
    the adapter adds past the base vocabulary; ``added_rows``: this rank's rows of them (see the field).
    """

    name: str
    path: str = ""
    scaling: float = 0.0
    rank: int = 0
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    copy: torch.Tensor | None = None
    token_index: torch.Tensor | None = None
    token_rows: torch.Tensor | None = None
    # Added tokens (a copy with more rows than the base vocabulary): how many the adapter adds, and this
    # rank's rows of them ``[n, H]`` in the module's added segment, from its local added column 0 on.
    added: int = 0
    added_rows: torch.Tensor | None = None

    @property
    def has_lora(self) -> bool:
        return self.lora_a is not None

    @property
    def is_empty(self) -> bool:
        return self.lora_a is None and self.copy is None and self.token_index is None

    def nbytes(self) -> int:
        """Bytes this rank holds for the adapter."""
        parts = (self.lora_a, self.lora_b, self.copy, self.token_index, self.token_rows, self.added_rows)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def to(self, device: torch.device) -> ShardAdapter:
        for key in ("lora_a", "lora_b", "copy", "token_index", "token_rows", "added_rows"):
            value = getattr(self, key)
            if value is not None:
                setattr(self, key, value.to(device))
        return self

    def describe(self) -> str:
        parts = ([f"LoRA r={self.rank} scaling={self.scaling:g}"] if self.has_lora else []) \
            + (["modules_to_save copy"] if self.copy is not None else []) \
            + ([f"{len(self.token_index)} trainable tokens"] if self.token_index is not None else []) \
            + ([f"{self.added} added tokens"] if self.added else [])
        return f"{self.name}: " + (", ".join(parts) or "nothing on this module")


@dataclass
class AdapterFile:
    """A PEFT adapter folder, config and header read (no tensor data): ``modules`` maps each vocabulary
    module path (``"lm_head"``, ``"model.embed_tokens"``) to its ``{kind: tensor name}``."""

    name: str
    folder: Path
    config: dict[str, Any]
    checkpoint: Checkpoint
    modules: dict[str, dict[str, str]] = field(default_factory=dict)
    others: list[str] = field(default_factory=list)

    @property
    def file(self) -> Path:
        return self.folder / WEIGHTS_FILE

    def _pattern(self, key: str, module: str, default: Any) -> Any:
        pattern = self.config.get(key) or {}
        if not isinstance(pattern, dict):
            raise AdapterError(f"{self.folder / CONFIG_FILE}: {key} must be an object, got {pattern!r}")
        for name, value in pattern.items():
            if not isinstance(name, str) or any(c in name for c in "*+?[](){}|^$\\"):
                raise AdapterError(f"{self.folder / CONFIG_FILE}: {key} key {name!r} is a regular expression; "
                                   "trtvocab matches module names literally (name or dotted suffix)")
            if module == name or module.endswith("." + name):
                return value
        return default

    def rank(self, module: str) -> int:
        r = self._pattern("rank_pattern", module, self.config.get("r", 8))
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise AdapterError(f"{self.folder / CONFIG_FILE}: r for {module} must be a positive int, got {r!r}")
        return r

    def scaling(self, module: str) -> float:
        """PEFT's scaling: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``; its magnitude
        at most :data:`MAX_SCALING` (``2**24``, the family factors' bound: a scaling of ``1e307`` turns every
        adapted logit into ``inf``)."""
        r = self.rank(module)
        missing = object()
        alpha = self._pattern("alpha_pattern", module, missing)
        field = "alpha_pattern" if alpha is not missing else "lora_alpha"
        if alpha is missing:
            alpha = self.config.get("lora_alpha", 8)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise AdapterError(f"{self.folder / CONFIG_FILE}: {field} for {module} must be a number, got {alpha!r:.80}")
        scaling = float(alpha) / (math.sqrt(r) if self.config.get("use_rslora") else r)
        if not abs(scaling) <= MAX_SCALING:
            over = "sqrt(r)" if self.config.get("use_rslora") else "r"
            raise AdapterError(f"{self.folder / CONFIG_FILE}: {field} for {module} is {alpha!r:.80}: the scaling "
                               f"lora_alpha / {over} = {scaling:.3g} is outside [-2^24, 2^24] (it would overflow "
                               "the adapted logits)")
        return scaling

    def token_indices(self, module: str) -> list[int] | None:
        """``trainable_token_indices`` of ``module`` (a list means the input embedding, as in PEFT)."""
        spec = self.config.get("trainable_token_indices")
        if spec is None:
            return None
        if isinstance(spec, list):
            return spec if module in EMBEDDING_MODULES else None
        if not isinstance(spec, dict):
            raise AdapterError(f"{self.folder / CONFIG_FILE}: trainable_token_indices must be a list or an object")
        for name, value in spec.items():
            if module == name or module.endswith("." + str(name)):
                return value
        return None


def open_adapter(path: str | Path, *, name: str | None = None,
                 other_modules: Literal["refuse", "ignore"] = "refuse") -> AdapterFile:
    """Read a PEFT adapter folder's config and safetensors header (no tensor data).

    ``other_modules``: ``"refuse"`` (default) raises :class:`AdapterError` when the adapter also targets
    modules other than the head and the input embedding (trtvocab would silently drop them);
    ``"ignore"`` is for a caller whose body applies them itself (``trtvocab generate`` refuses them: its body
    is the checkpoint's).
    """
    folder = Path(path)
    cfg_path = folder / CONFIG_FILE
    if not cfg_path.exists():
        raise AdapterError(f"{folder}: not a PEFT adapter folder (no {CONFIG_FILE})")
    # A regular file of bounded size, parsed strictly (the one opener of files trtvocab reads).
    config = load_json_file(cfg_path, "adapter config", max_bytes=1 << 20, error=AdapterError)
    if not isinstance(config, dict):
        raise AdapterError(f"{cfg_path}: expected a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{cfg_path}: peft_type {peft_type!r} is not LoRA; trtvocab applies LoRA adapters only")
    for key, what in REFUSED_FIELDS.items():
        if config.get(key):
            raise AdapterError(f"{cfg_path}: {key} is set: {what} is not supported (refused rather than "
                               "applied as plain LoRA)")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{cfg_path}: bias={config['bias']!r}: LoRA biases are not supported (bias='none' only)")
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        try:
            mode = weights.stat().st_mode
        except OSError:
            raise AdapterError(f"{folder}: no {WEIGHTS_FILE} (pickled adapter_model.bin files are never loaded)") \
                from None
        raise AdapterError(f"{weights}: is {file_kind(mode)}, expected a regular file")
    try:
        ckpt = Checkpoint(weights)
    except CheckpointError as exc:
        raise AdapterError(f"{weights}: {exc}") from None
    adapter = AdapterFile(name or folder.name, folder, config, ckpt)
    vocab_modules = (HEAD_MODULE, *EMBEDDING_MODULES)
    for tensor in ckpt.names():
        key = tensor[len(PREFIX):] if tensor.startswith(PREFIX) else tensor
        module, kind = _split(key, vocab_modules)
        if module is None:
            adapter.others.append(tensor)
            continue
        if "magnitude" in key:
            raise AdapterError(f"{weights}: tensor {tensor}: DoRA magnitude vectors are not supported")
        if kind is None:
            raise AdapterError(f"{weights}: tensor {tensor}: not a LoRA, modules_to_save or trainable-token "
                               f"tensor of {module} that trtvocab can apply")
        adapter.modules.setdefault(module, {})[kind] = tensor
    if adapter.others and other_modules == "refuse":
        shown = ", ".join(adapter.others[:4]) + (" ..." if len(adapter.others) > 4 else "")
        raise AdapterError(f"{weights}: targets modules other than the head and the input embedding ({shown}); "
                           "trtvocab applies only those two (other_modules='ignore' when the body applies the rest)")
    if not adapter.modules:
        raise AdapterError(f"{weights}: holds nothing for {HEAD_MODULE} or the input embedding")
    return adapter


def _split(key: str, modules: tuple[str, ...]) -> tuple[str | None, str | None]:
    """``(module, kind)`` of a tensor key relative to the model (``kind`` None: unknown suffix)."""
    for module in modules:
        if key.startswith(module + "."):
            return module, SUFFIXES.get(key[len(module) + 1:])
    return None, None


def _read(adapter: AdapterFile, tensor: str, shape: list[int] | None = None) -> torch.Tensor:
    info = adapter.checkpoint.info(tensor)
    if shape is not None and list(info.shape) != shape:
        raise AdapterError(f"{adapter.file}: tensor {tensor} is {list(info.shape)}, expected {shape}")
    return _finite(adapter, tensor, adapter.checkpoint.read(tensor))


def _finite(adapter: AdapterFile, tensor: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` if it is a float tensor PEFT writes (:data:`FACTOR_DTYPES`) whose values are finite in
    float32 (the dtype trtvocab computes LoRA in: a float64 ``1e300`` is ``inf`` there); else an
    :class:`AdapterError` naming the file and the tensor (integer, bool and float8 tensors included: none is
    converted silently)."""
    if value.dtype not in FACTOR_DTYPES:
        raise AdapterError(f"{adapter.file}: tensor {tensor} is stored as {value.dtype}; adapter tensors must be "
                           "float32, bfloat16, float16 or float64 (integer, bool and float8 tensors are not converted)")
    if not bool(torch.isfinite(value.float()).all()):
        raise AdapterError(f"{adapter.file}: tensor {tensor} holds NaN or inf (in float32)")
    return value


def _finite_as(adapter: AdapterFile, tensor: str, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value.to(dtype)``, refused when the cast overflows (a float32 copy of 1e5 in a float16 module)."""
    cast = value.to(dtype)
    if not bool(torch.isfinite(cast).all()):
        raise AdapterError(f"{adapter.file}: tensor {tensor} overflows the module's {dtype} (values out of its range)")
    return cast


def _rows(adapter: AdapterFile, tensor: str, shard: VocabShard, row_shape: tuple[int, ...], what: str,
          added: int = 0) -> torch.Tensor:
    """This shard's rows of a ``[V, ...]`` tensor (``[V + added, ...]``: a copy that adds tokens; only
    the shard's base rows are read here)."""
    info = adapter.checkpoint.info(tensor)
    expected = [shard.vocab_size + added, *row_shape]
    if list(info.shape) != expected:
        raise AdapterError(f"{adapter.file}: tensor {tensor} is {list(info.shape)}, expected {expected} ({what})")
    return _finite(adapter, tensor, adapter.checkpoint.get_slice(tensor)[shard.start:shard.end]
                   if added else read_rows(adapter.checkpoint.get_slice(tensor), tensor, shard, row_shape))


def _added_rows(adapter: AdapterFile, tensor: str, vocab: int, added: int, piece: VocabShard | None,
                hidden: int) -> torch.Tensor:
    """This rank's rows of the added segment of a ``[V + added, H]`` copy: added ids ``[piece.start,
    min(piece.end, added))`` (rows ``V + those``); ``[0, H]`` when it owns none of this adapter's."""
    if piece is None:
        raise AdapterError(f"{adapter.file}: tensor {tensor} adds {added} tokens, but the module has no added "
                           "segment to hold them")
    lo, hi = piece.start, min(piece.end, added)
    if hi <= lo:
        return torch.zeros(0, hidden)
    value = adapter.checkpoint.get_slice(tensor)[vocab + lo : vocab + hi]
    return _finite(adapter, tensor, value if isinstance(value, torch.Tensor) else torch.as_tensor(value))


def added_tokens(adapter: AdapterFile, vocab: int, hidden: int, *, tied: bool = False) -> int:
    """How many tokens ``adapter`` adds past the base vocabulary ``vocab`` (0: none), from the header.

    Tokens are added by ``modules_to_save`` copies of a resized ``embed_tokens`` / ``lm_head`` (PEFT saves
    them after ``model.resize_token_embeddings(V + k)``): ``[V + k, H]`` tables. Both ends must add the same
    ``k`` (a row that samples an added id embeds it on the next step), so an adapter that adds tokens on one
    module only -- or other counts on the two -- is refused, naming both tensors; so are LoRA factors and
    trainable tokens sized past ``V`` (their base rows for the added ids are not in the checkpoint). A tied
    model is no exception: PEFT's head keeps the resized base table, whose added rows no checkpoint holds.
    ``tied`` is accepted for symmetry with :func:`shard_adapter` and changes nothing here.
    """
    counts: dict[str, tuple[int, str]] = {}
    for which in ("embedding", "head"):
        module = module_of(adapter, which)  # type: ignore[arg-type]
        parts = adapter.modules.get(module, {}) if module is not None else {}
        for kind in ("copy", "base"):
            if kind in parts:
                shape = list(adapter.checkpoint.info(parts[kind]).shape)
                if len(shape) == 2 and shape[1] == hidden and shape[0] > vocab:
                    counts[which] = (shape[0] - vocab, parts[kind])
        for kind, axis in (("lora_B", 0), ("emb_A", 1)):
            if kind in parts:
                shape = list(adapter.checkpoint.info(parts[kind]).shape)
                if len(shape) == 2 and shape[axis] > vocab:
                    raise AdapterError(f"{adapter.file}: tensor {parts[kind]} has {shape[axis]} token rows, more than "
                                       f"the base vocabulary {vocab}: LoRA on a resized {module} is not supported "
                                       "(added tokens must come as a modules_to_save copy of the resized table)")
    if not counts:
        return 0
    emb, head = counts.get("embedding"), counts.get("head")
    if emb is None or head is None:
        have, tensor = next(iter(counts.items()))[0], next(iter(counts.values()))[1]
        other = "lm_head" if have == "embedding" else "embed_tokens"
        raise AdapterError(f"{adapter.file}: tensor {tensor} adds {counts[have][0]} tokens to the {have}, but "
                           f"the adapter has no [V + {counts[have][0]}, H] copy of {other} (an adapter that adds "
                           "tokens must add them to both ends)")
    if emb[0] != head[0]:
        raise AdapterError(f"{adapter.file}: tensor {emb[1]} adds {emb[0]} tokens but tensor {head[1]} adds "
                           f"{head[0]} (the embedding and the head must add the same tokens)")
    return emb[0]


def module_of(adapter: AdapterFile, which: Module, module: str | None = None) -> str | None:
    """The adapter's module path for the head or the input embedding (None: it has nothing there)."""
    if module is not None:
        return module if module in adapter.modules else None
    names = (HEAD_MODULE,) if which == "head" else EMBEDDING_MODULES
    found = [n for n in names if n in adapter.modules]
    return found[0] if found else None


def shard_adapter(adapter: AdapterFile, which: Module, shard: VocabShard, hidden: int, dtype: torch.dtype, *,
                  base: torch.Tensor | None = None, tied: bool = False,
                  added_shard: VocabShard | None = None) -> ShardAdapter:
    """One rank's part of ``adapter`` for the head or the input embedding (``shard``: its rows).

    ``base``: the module's dense ``[V_local, H]`` rows, to tell whether a saved ``base_layer.weight``
    is the base (ignored) or a different table (a copy); ``tied``: the head shares the embedding's
    table, so the embedding's trainable tokens apply to the head too (PEFT's tied adapter).
    ``added_shard``: this rank's piece of the module's added segment (:mod:`trtvocab.parallel.added_vocab`),
    for an adapter that adds tokens (:func:`added_tokens`); its rows past the base vocabulary are read there.
    """
    out = ShardAdapter(adapter.name, str(adapter.folder))
    out.added = added_tokens(adapter, shard.vocab_size, hidden, tied=tied)
    module = module_of(adapter, which)
    parts = dict(adapter.modules.get(module, {})) if module is not None else {}
    token_module = module
    if which == "head" and tied and "tokens" not in parts:
        emb = module_of(adapter, "embedding")
        if emb is not None and "tokens" in adapter.modules[emb]:
            parts["tokens"], token_module = adapter.modules[emb]["tokens"], emb
    if module is not None:
        _lora(adapter, which, module, parts, shard, hidden, out)
        for kind in ("copy", "base"):
            if kind in parts:
                rows = _rows(adapter, parts[kind], shard, (hidden,), "a full copy of the table", out.added)
                if kind == "base" and base is not None and torch.equal(rows.to(base.dtype), base.cpu()) \
                        and not out.added:
                    continue
                if out.copy is not None:
                    raise AdapterError(f"{adapter.file}: both {parts['copy']} and {parts['base']} replace {module}")
                out.copy = _finite_as(adapter, parts[kind], rows, dtype)
                if out.added:
                    out.added_rows = _finite_as(adapter, parts[kind], _added_rows(
                        adapter, parts[kind], shard.vocab_size, out.added, added_shard, hidden), dtype)
    if "tokens" in parts:
        assert token_module is not None
        _tokens(adapter, token_module, parts["tokens"], shard, hidden, dtype, out)
    return out


def _lora(adapter: AdapterFile, which: Module, module: str, parts: dict[str, str], shard: VocabShard, hidden: int,
          out: ShardAdapter) -> None:
    keys = ("lora_A", "lora_B") if which == "head" else ("emb_A", "emb_B")
    wrong = ("emb_A", "emb_B") if which == "head" else ("lora_A", "lora_B")
    for kind in wrong:
        if kind in parts:
            raise AdapterError(f"{adapter.file}: tensor {parts[kind]}: a {'embedding' if which == 'head' else 'linear'}"
                               f" LoRA tensor on {module}, which trtvocab runs as the {which}")
    present = [k for k in keys if k in parts]
    if not present:
        return
    if len(present) == 1:
        raise AdapterError(f"{adapter.file}: tensor {parts[present[0]]} has no {keys[1 - keys.index(present[0])]} "
                           "partner")
    r = adapter.rank(module)
    a_name, b_name = parts[keys[0]], parts[keys[1]]
    if which == "head":
        a_shape = list(adapter.checkpoint.info(a_name).shape)
        if a_shape != [r, hidden]:
            raise AdapterError(f"{adapter.file}: tensor {a_name} is {a_shape}, expected [r={r}, H={hidden}] "
                               "(rank mismatch with adapter_config.json r / rank_pattern, or another hidden size)")
        out.lora_a = _read(adapter, a_name).float()
        out.lora_b = _rows(adapter, b_name, shard, (r,), f"lora_B: one row per token id, r={r} columns").float()
    else:
        a_shape = list(adapter.checkpoint.info(a_name).shape)
        if a_shape != [r, shard.vocab_size]:
            raise AdapterError(f"{adapter.file}: tensor {a_name} is {a_shape}, expected [r={r}, V={shard.vocab_size}] "
                               "(PEFT's embedding layout; rank mismatch or another vocabulary)")
        # [r, V] is read whole (r * V values: small) and this shard's columns kept.
        a = _read(adapter, a_name).float()
        out.lora_a = a[:, shard.start:shard.end].t().contiguous()
        out.lora_b = _read(adapter, b_name, [hidden, r]).float()
    out.rank, out.scaling = r, adapter.scaling(module)
    # The product of checked factors, checked once: the delta of a hidden row of unit entries is at most
    # |s| * r * max|A| * max|B| (times H for the head's x @ A.T), which must stay finite in float32.
    width = hidden if which == "head" else 1
    bound = abs(out.scaling) * r * width * float(out.lora_a.abs().max()) * float(out.lora_b.abs().max()) \
        if out.lora_a.numel() and out.lora_b.numel() else 0.0
    if not bound <= torch.finfo(torch.float32).max:
        raise AdapterError(f"{adapter.file}: tensors {a_name} and {b_name} with scaling {out.scaling:g}: the LoRA "
                           f"delta of a unit hidden row can reach {bound:.3g}, past float32's range (the adapted "
                           "logits would be inf)")


def _tokens(adapter: AdapterFile, module: str, tensor: str, shard: VocabShard, hidden: int, dtype: torch.dtype,
            out: ShardAdapter) -> None:
    indices = adapter.token_indices(module)
    cfg = adapter.folder / CONFIG_FILE
    if indices is None:
        raise AdapterError(f"{adapter.file}: tensor {tensor} but {cfg} names no trainable_token_indices for {module}")
    if not isinstance(indices, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise AdapterError(f"{cfg}: trainable_token_indices of {module} must be a list of ints")
    bad = [i for i in indices if not 0 <= i < shard.vocab_size]
    if bad:
        raise AdapterError(f"{cfg}: trainable_token_indices {bad[:5]} outside the vocabulary [0, {shard.vocab_size}) "
                           "(trainable tokens past the base vocabulary are not supported: their base rows are not "
                           "in the checkpoint; an adapter adds tokens with modules_to_save copies of resized tables)")
    if len(set(indices)) != len(indices):
        raise AdapterError(f"{cfg}: trainable_token_indices of {module} repeat an index")
    delta = _read(adapter, tensor, [len(indices), hidden])
    index = torch.tensor(indices, dtype=torch.int64)
    mine = (index >= shard.start) & (index < shard.end)
    local = index[mine] - shard.start
    order = torch.argsort(local)
    out.token_index = local[order].contiguous()
    out.token_rows = _finite_as(adapter, tensor, delta[mine][order], dtype).contiguous()


# ---- applying adapters ---------------------------------------------------------------------------------
def check_adapter_ids(ids: Any, rows: int, count: int, what: str) -> str | None:
    """Why ``ids`` cannot pick adapters for ``rows`` rows among ``count`` adapters (None: it can)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool \
            or ids.is_complex():
        return f"{what}: expected an integer tensor of adapter indices, got {type(ids).__name__}"
    if ids.dim() != 1 or ids.shape[0] != rows:
        return f"{what}: expected shape [{rows}] (one adapter index per row), got {list(ids.shape)}"
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= count):
        return f"{what}: adapter indices must be -1 (none) or in [0, {count}), got [{int(ids.min())}, {int(ids.max())}]"
    return None


def groups(ids: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``(adapter index, row positions)`` for every adapter some row uses (-1 left out)."""
    out = []
    for k in torch.unique(ids).tolist():
        if k >= 0:
            out.append((int(k), (ids == k).nonzero().reshape(-1)))
    return out


def adapt_logits_(logits: torch.Tensor, hidden: torch.Tensor, adapters: list[ShardAdapter], ids: torch.Tensor,
                  lo: int, hi: int) -> torch.Tensor:
    """Each row's adapter on ``logits [N, hi - lo]`` = ``x @ W[lo:hi].T`` of the shard's columns ``[lo, hi)``
    (before the family's ops): a copy replaces the columns, trainable tokens replace single columns, LoRA
    adds ``s * (x @ A.T) @ B[lo:hi].T`` (float32). In place; returned."""
    for k, rows in groups(ids):
        a = adapters[k]
        if a.is_empty:
            continue
        x = hidden[rows].float()
        part = (x @ a.copy[lo:hi].float().t()) if a.copy is not None else logits[rows].float()
        if a.token_index is not None:
            first, last = torch.searchsorted(a.token_index, torch.tensor([lo, hi])).tolist()
            if last > first:
                part[:, a.token_index[first:last] - lo] = x @ a.token_rows[first:last].float().t()
        if a.lora_a is not None:
            assert a.lora_b is not None
            part += (x @ a.lora_a.t()) @ a.lora_b[lo:hi].t() * a.scaling
        logits[rows] = part.to(logits.dtype)
    return logits


def replace_rows_(rows: torch.Tensor, index: torch.Tensor, mine: torch.Tensor, adapters: list[ShardAdapter],
                  ids: torch.Tensor) -> None:
    """Copies and trainable tokens on a shard's looked-up ``rows [N, H]`` (``index``: local ids, ``mine``:
    owned), in place; unowned rows stay zero."""
    for k, pos in groups(ids):
        a = adapters[k]
        owned = pos[mine[pos]]
        if a.copy is not None:
            rows[owned] = a.copy[index[owned]].to(rows.dtype)
        if a.token_index is not None and a.token_index.numel():
            local = index[owned]
            slot = torch.searchsorted(a.token_index, local).clamp_(max=a.token_index.numel() - 1)
            hit = a.token_index[slot] == local
            rows[owned[hit]] = a.token_rows[slot[hit]].to(rows.dtype)


def lora_partial(index: torch.Tensor, mine: torch.Tensor, adapters: list[ShardAdapter],
                 ids: torch.Tensor) -> torch.Tensor:
    """This shard's ``A.T[ids]`` rows ``[N, r_max]`` (float32, zero where it owns no id or the row's
    adapter has no embedding LoRA): summed over the group, each element has one non-zero term."""
    width = max((a.rank for a in adapters if a.has_lora), default=0)
    out = torch.zeros(ids.shape[0], width, dtype=torch.float32, device=index.device)
    for k, pos in groups(ids):
        a = adapters[k]
        if a.lora_a is not None:
            owned = pos[mine[pos]]
            out[owned, : a.rank] = a.lora_a[index[owned]]
    return out


def lora_rows(partial: torch.Tensor, adapters: list[ShardAdapter],
              ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(row positions, delta rows [n, H] float32)`` of the embedding LoRA, from summed :func:`lora_partial`."""
    out = []
    for k, pos in groups(ids):
        a = adapters[k]
        if a.lora_a is not None:
            assert a.lora_b is not None
            out.append((pos, (partial[pos, : a.rank] @ a.lora_b.t()) * a.scaling))
    return out




def footprint(adapter: AdapterFile, shard: VocabShard, hidden: int, dtype_bytes: int, *, tied: bool = False,
              pad_to: int = 64) -> int:
    """Bytes one rank holds for ``adapter`` on both vocabulary modules, from the header alone (what
    :func:`shard_adapter` keeps: LoRA factors in float32, copies and trainable-token rows in the
    module dtype, ``dtype_bytes`` per element). A saved ``base_layer.weight`` is not counted (it is
    dropped when it equals the checkpoint's table). An adapter that adds tokens also holds, on each end, its
    rows of the added segment this rank's piece owns (``pad_to``: the padded layout's multiple)."""
    total = 0
    added = added_tokens(adapter, shard.vocab_size, hidden, tied=tied)
    if added:
        piece = vocab_shard(added, shard.tp_size, shard.rank, shard.layout, pad_to)
        total += 2 * max(0, min(piece.end, added) - piece.start) * hidden * dtype_bytes
    for which in ("head", "embedding"):
        module = module_of(adapter, which)  # type: ignore[arg-type]
        parts = adapter.modules.get(module, {}) if module is not None else {}
        if "lora_A" in parts or "emb_A" in parts:
            r = adapter.rank(module)  # type: ignore[arg-type]
            total += 4 * r * (shard.size + hidden)
        if "copy" in parts:
            total += shard.size * hidden * dtype_bytes
        token_module = module
        if which == "head" and tied and "tokens" not in parts:
            token_module = module_of(adapter, "embedding")
        indices = adapter.token_indices(token_module) if token_module is not None else None
        if indices and isinstance(indices, list):
            owned = sum(1 for i in indices if isinstance(i, int) and shard.start <= i < shard.end)
            total += owned * (hidden * dtype_bytes + 8)
    return total


__all__ = ["AdapterFile", "ShardAdapter", "adapt_logits_", "added_tokens", "check_adapter_ids", "footprint",
           "lora_partial", "lora_rows", "open_adapter", "replace_rows_", "shard_adapter"]
