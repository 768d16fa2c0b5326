"""Build artifacts on disk: layout, manifest, atomic publication, verification on load.

::

    OUT/manifest.json                 what was built, from what, with which versions; sha256 of
                                      every file; what was skipped and why; a digest of its body
    OUT/rank{r}/weights.safetensors   the shard (+ scales): the PyTorch fallback's input
    OUT/rank{r}/lm_head.onnx          (+ lm_head.onnx.data when large) the graph TensorRT parses
    OUT/rank{r}/lm_head.plan          TensorRT engine, only where TensorRT and a suitable GPU exist

A build writes into a private sibling folder and publishes it atomically
(:func:`trtvocab.base.publish.staging`): a reader sees the old artifact or the new one, never a
mix. The schema is :class:`trtvocab.artifact.manifest.Manifest`; this module is the only reader
and writer of the file. What loading checks (:func:`read_manifest`): the section below.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import ValidationError

from trtvocab.artifact.manifest import FileRecord, Manifest, RankEntry
from trtvocab.base.publish import atomic_write_bytes
from trtvocab.base.publish import staging as _staging
from trtvocab.base.safe_read import load_json_file, parse_json, read_regular, sha256_file
from trtvocab.base.safetensors_header import read_safetensors_header
from trtvocab.errors import ArtifactError, TrtVocabError
from trtvocab.parallel.sharding import vocab_shard
from trtvocab.quant import gguf_blocks
from trtvocab.version import __version__

# ---- what loading checks (read_manifest) ----------------------------------------------------------
# Each refusal is an ArtifactError naming the file or the field: the manifest is a regular UTF-8
# JSON file of bounded size; its format, version and trtvocab version; its digest; the schema,
# parsed strictly (a ``"0"`` is not ``0``, ``true`` is not ``1``); that it agrees with itself and
# with the shard math (check_consistency: every rank's ``[start, end)`` and width are
# trtvocab.parallel.sharding.vocab_shard of the recorded vocab, tp, layout and pad_to); that every
# path in it is relative, normalized and inside the artifact; that every file a rank's runtime
# opens is listed; that each ``weights.safetensors`` header agrees with the manifest
# (check_rank_headers: dtype, rows, shape, the rank/start/end it records); and, unless told not
# to, every listed file's size and sha256 (verify_files), reading no more bytes than the manifest
# records and opening only regular files.


MANIFEST = "manifest.json"
FORMAT = "trtvocab-artifact"
FORMAT_VERSION = 3  # 3: manifest digest; 2: typed manifest (engine records nested under "build", weight_format names)
MAX_MANIFEST_BYTES = 64 << 20
_ST_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1}


def versions() -> dict[str, str]:
    import torch

    out = {"trtvocab": __version__, "torch": torch.__version__, "python": platform.python_version()}
    for mod in ("onnx", "onnxruntime", "tensorrt", "modelopt"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # not installed (or broken): record its absence, don't fail
            continue
    return out


def rank_dir(root: Path, rank: int) -> Path:
    return Path(root) / f"rank{rank}"


def is_artifact(path: Path) -> bool:
    """Whether ``path`` holds a manifest of ours: a regular ``manifest.json`` that parses as a JSON
    object with ``"format": "trtvocab-artifact"`` (any version). The only test ``force`` trusts."""
    try:
        raw = load_json_file(Path(path) / MANIFEST, "manifest", max_bytes=MAX_MANIFEST_BYTES)
    except TrtVocabError:
        return False
    return isinstance(raw, dict) and raw.get("format") == FORMAT


@contextmanager
def staging(out: Path, *, force: bool) -> Iterator[Path]:
    """Build into a private folder, publish it as ``out`` (see :func:`trtvocab.base.publish.staging`);
    ``force`` replaces only an empty folder or one that :func:`is_artifact` recognizes."""
    with _staging(out, force=force, is_ours=is_artifact) as stage:
        yield stage


def body_digest(body: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON without its ``digest`` key (sorted keys, no spaces)."""
    rest = {k: v for k, v in body.items() if k != "digest"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(root: Path, manifest: Manifest) -> Manifest:
    """Add checksums of every file under ``root`` and the body digest; write ``manifest.json`` atomically."""
    root = Path(root)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = manifest.model_copy(update={
        "format": FORMAT, "format_version": FORMAT_VERSION, "digest": None,
        "files": {p.relative_to(root).as_posix(): FileRecord(sha256=sha256_file(p), bytes=p.stat().st_size)
                  for p in files},
    })
    body = manifest.model_dump(mode="json")
    manifest = manifest.model_copy(update={"digest": body_digest(body)})
    atomic_write_bytes(root / MANIFEST, json.dumps(manifest.model_dump(mode="json"), indent=2,
                                                   sort_keys=True).encode())
    return manifest


def _schema_error(path: Path, exc: ValidationError) -> ArtifactError:
    errors = exc.errors()
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    return ArtifactError(f"{path}: does not match the manifest schema ({len(errors)} problem(s); "
                         f"first: {where}: {first['msg']})")


def read_manifest(root: Path, *, verify: bool = True) -> Manifest:
    """Load and check an artifact (everything in the section "what loading checks"); ``verify=False`` skips
    only the per-file size and sha256 pass."""
    root = Path(root)
    path = root / MANIFEST
    if not os.path.lexists(path):
        raise ArtifactError(f"{path}: missing (not a trtvocab artifact, or an unfinished build)")
    data = read_regular(path, "artifact manifest", max_bytes=MAX_MANIFEST_BYTES)
    raw = parse_json(data, str(path), ArtifactError)
    text = data.decode("utf-8")  # valid: parse_json decoded it already
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise ArtifactError(f"{path}: not a trtvocab artifact (format {found!r})")
    if raw.get("format_version") != FORMAT_VERSION or isinstance(raw.get("format_version"), bool):
        raise ArtifactError(
            f"{path}: artifact format version {raw.get('format_version')!r}, this trtvocab reads "
            f"version {FORMAT_VERSION}; rebuild it"
        )
    built = raw.get("versions", {}).get("trtvocab") if isinstance(raw.get("versions"), dict) else None
    if not isinstance(built, str) or built.split(".")[:2] != __version__.split(".")[:2]:
        raise ArtifactError(f"{path}: built by trtvocab {built}, this is {__version__}; rebuild it")
    if not isinstance(raw.get("digest"), str):
        raise ArtifactError(f"{path}: field digest: missing (every manifest trtvocab {__version__} writes has one)")
    if raw["digest"] != body_digest(raw):
        raise ArtifactError(f"{path}: field digest: does not match the manifest's body (edited or corrupted "
                            "after the build)")
    try:
        manifest = Manifest.model_validate_json(text, strict=True)
    except ValidationError as exc:
        raise _schema_error(path, exc) from None
    check_consistency(root, manifest)
    for entry in manifest.ranks:
        if not rank_dir(root, entry.rank).is_dir():
            raise ArtifactError(f"{rank_dir(root, entry.rank)}: rank {entry.rank} of the artifact is missing")
    check_rank_headers(root, manifest)
    if verify:
        verify_files(root, manifest)
    return manifest


# ---- the manifest agrees with itself and with the shard math ---------------------------------------
def _bad(root: Path, field: str, why: str) -> ArtifactError:
    return ArtifactError(f"{Path(root) / MANIFEST}: field {field}: {why}")


def check_path(root: Path, rel: str, field: str) -> Path:
    """``root / rel`` for a manifest path that is relative, normalized (no ``.``, ``..``, empty or
    backslash parts) and, with symlinks resolved, inside ``root``; ArtifactError naming ``field``."""
    pure = PurePosixPath(rel)
    if (not rel or pure.is_absolute() or "\\" in rel or pure.as_posix() != rel
            or any(part in ("", ".", "..") for part in rel.split("/"))):
        raise _bad(root, field, f"{rel!r} is not a normalized relative path inside the artifact")
    path = Path(root) / rel
    inside = Path(root).resolve()
    resolved = path.resolve()
    if resolved != inside and inside not in resolved.parents:
        raise _bad(root, field, f"{rel!r} leads outside the artifact (to {resolved})")
    return path


def check_consistency(root: Path, m: Manifest) -> None:
    """Refuse a manifest that disagrees with itself or with :func:`trtvocab.parallel.sharding.vocab_shard`."""
    recipe, head = m.recipe, m.head
    for key in type(recipe.lm_head).model_fields:
        if getattr(head, key) != getattr(recipe.lm_head, key):
            raise _bad(root, f"head.{key}", f"{getattr(head, key)!r}, but recipe.lm_head.{key} is "
                                             f"{getattr(recipe.lm_head, key)!r}")
    if m.mapping != recipe.mapping:
        raise _bad(root, "mapping", "differs from recipe.mapping")
    if m.profile != recipe.profile:
        raise _bad(root, "profile", "differs from recipe.profile")
    syn = recipe.checkpoint.synthetic
    if (m.checkpoint == "synthetic") != (syn is not None):
        raise _bad(root, "checkpoint", f"{m.checkpoint!r} disagrees with recipe.checkpoint")
    if syn is not None and (syn.vocab_size, syn.hidden_size) != (head.vocab_size, head.hidden_size):
        raise _bad(root, "head.vocab_size", f"[{head.vocab_size}, {head.hidden_size}], but the synthetic "
                                            f"weights are [{syn.vocab_size}, {syn.hidden_size}]")
    if head.tensor != recipe.checkpoint.tensor:
        raise _bad(root, "head.tensor", "differs from recipe.checkpoint.tensor")
    tp = m.mapping.tp_size
    built = m.ranks_built
    if built != sorted(set(built)) or not built or not all(0 <= r < tp for r in built):
        raise _bad(root, "ranks_built", f"{built} is not a non-empty increasing list of ranks in [0, {tp})")
    if [e.rank for e in m.ranks] != built:
        raise _bad(root, "ranks", f"ranks {[e.rank for e in m.ranks]} differ from ranks_built {built}")
    try:
        split = m.mapping.lm_head_is_split
    except TrtVocabError as exc:
        raise _bad(root, "mapping", str(exc)) from None
    for i, e in enumerate(m.ranks):
        where = f"ranks[{i}]"
        try:
            want = vocab_shard(head.vocab_size, tp if split else 1, e.rank if split else 0, head.vocab_layout,
                               head.pad_to)
        except TrtVocabError as exc:
            raise _bad(root, where, str(exc)) from None
        for key in ("start", "end", "width"):
            if getattr(e, key) != getattr(want, key):
                raise _bad(root, f"{where}.{key}", f"{getattr(e, key)}, but the shard math (vocab {head.vocab_size}, "
                                                  f"tp {tp if split else 1}, layout {head.vocab_layout}, pad_to "
                                                  f"{head.pad_to}) gives [{want.start}, {want.end}) of width "
                                                  f"{want.width} for rank {e.rank}")
        _check_entry(root, m, e, where)
    if m.backends.onnx != all(e.files.onnx is not None for e in m.ranks):
        raise _bad(root, "backends.onnx", f"{m.backends.onnx}, but the ranks' onnx files say otherwise")
    if m.backends.tensorrt != all(e.files.plan is not None for e in m.ranks):
        raise _bad(root, "backends.tensorrt", f"{m.backends.tensorrt}, but the ranks' plan files say otherwise")
    for rel in m.files:
        check_path(root, rel, f"files[{rel!r}]")


def _check_entry(root: Path, m: Manifest, e: RankEntry, where: str) -> None:
    q = e.quant
    if q != m.quant:
        raise _bad(root, f"{where}.quant", "differs from the manifest's quant")
    if e.weight_format != q.weight_format:
        raise _bad(root, f"{where}.weight_format", f"{e.weight_format}, but its quant says {q.weight_format}")
    if (q.config is None) != (q.weight_format == "dense"):
        raise _bad(root, f"{where}.quant.config", f"does not fit weight format {q.weight_format}")
    if q.config is not None and q.config.weight_format != q.weight_format:
        raise _bad(root, f"{where}.quant.config", f"is {q.config.weight_format}, the weights are {q.weight_format}")
    prefix = f"rank{e.rank}/"
    expected = {"weights": f"{prefix}weights.safetensors", "onnx": f"{prefix}lm_head.onnx",
                "plan": f"{prefix}lm_head.plan", "embedding_onnx": f"{prefix}embedding.onnx"}
    for key, name in expected.items():
        rel = getattr(e.files, key)
        if rel is None:
            continue
        if rel != name:
            raise _bad(root, f"{where}.files.{key}", f"{rel!r}; a build writes {name!r}")
        if rel not in m.files:
            raise _bad(root, f"{where}.files.{key}", f"{rel!r} is not listed in files (it would be used unverified)")
    engine = e.engine
    if engine.built != (engine.build is not None) or engine.built != (e.files.plan is not None):
        raise _bad(root, f"{where}.engine", "built, build and files.plan disagree")
    if engine.build is not None:
        b = engine.build
        for key in ("plan_path", "onnx_path"):
            name = getattr(b, key)
            if "/" in name or "\\" in name or name in ("", ".", ".."):
                raise _bad(root, f"{where}.engine.build.{key}", f"{name!r} is not a file name in the rank folder")
        rec = m.files[expected["plan"]]
        if (b.sha256, b.bytes) != (rec.sha256, rec.bytes):
            raise _bad(root, f"{where}.engine.build.sha256", "differs from the plan's entry in files")
        if b.weight_format != e.weight_format:
            raise _bad(root, f"{where}.engine.build.weight_format", f"{b.weight_format}, the rank is {e.weight_format}")


# ---- the rank files agree with the manifest --------------------------------------------------------
def check_rank_headers(root: Path, m: Manifest) -> None:
    """Each ``weights.safetensors`` header (header only, no tensor bytes) against its manifest entry:
    the rank / start / end it records, the weight's dtype and shape ``[end - start, H]`` (``H / 2``
    packed FP4), and the weight's byte span."""
    h = m.head
    for e in m.ranks:
        path = check_path(root, e.files.weights, f"ranks[{e.rank}].files.weights")
        header = read_safetensors_header(path, "rank weights")
        meta = header.get("__metadata__", {})
        for key in ("rank", "start", "end"):
            if meta.get(key) != str(getattr(e, key)):
                raise ArtifactError(f"{path}: records {key} {meta.get(key)!r}, the manifest says {getattr(e, key)} "
                                    f"(field ranks[{e.rank}].{key})")
        weight = header.get("weight")
        rows = e.end - e.start
        fmt = str(e.weight_format)
        if e.weight_format.is_gguf:  # the rows of blocks as stored: uint8 [rows, H / block * type size]
            block = gguf_blocks.of_format(e.weight_format)
            want = ("U8", [rows, h.hidden_size // block.values * block.bytes])
        else:
            want = {"dense": (_ST_DTYPE[h.dtype], [rows, h.hidden_size]), "FP8": ("F8_E4M3", [rows, h.hidden_size]),
                    "NVFP4": ("U8", [rows, h.hidden_size // 2])}[fmt]
        if not isinstance(weight, dict):
            raise ArtifactError(f"{path}: holds no 'weight' tensor")
        if (weight["dtype"], weight["shape"]) != want:
            raise ArtifactError(f"{path}: weight is {weight['dtype']} {weight['shape']}, the manifest says "
                                f"{want[0]} {want[1]} (fields head.dtype, head.hidden_size, ranks[{e.rank}] "
                                f"start/end, weight_format)")
        lo, hi = weight["data_offsets"]
        count = 1
        for d in weight["shape"]:
            count *= d
        if hi - lo != count * _ITEMSIZE[weight["dtype"]]:
            raise ArtifactError(f"{path}: weight's data span is {hi - lo} bytes, its shape needs "
                                f"{count * _ITEMSIZE[weight['dtype']]}")


# What earlier runners wrote beside a TensorRT-RTX plan after its first run. trtvocab never opens them
# (runtime caches live outside the artifact: trtvocab.backends.tensorrt.runtime_cache_path), so they
# are the one unlisted thing a rank folder may hold: an artifact run once is not refused.
LEGACY_RUNTIME_CACHES = frozenset({"lm_head.plan.runtime-cache", "embedding.plan.runtime-cache"})


def verify_files(root: Path, manifest: Manifest) -> None:
    """Every listed file: a regular file inside the artifact, of the recorded size and sha256 (reading
    at most one byte more than recorded); every file in a rank folder: listed (but for
    :data:`LEGACY_RUNTIME_CACHES`, never opened)."""
    root = Path(root)
    if not manifest.files:
        raise ArtifactError(f"{root / MANIFEST}: lists no files (a manifest from an unfinished or other build)")
    for entry in manifest.ranks:
        folder = rank_dir(root, entry.rank)
        for dirpath, _dirs, names in os.walk(folder):
            for name in names:
                rel = (Path(dirpath) / name).relative_to(root).as_posix()
                if rel not in manifest.files and not (name in LEGACY_RUNTIME_CACHES and Path(dirpath) == folder):
                    raise ArtifactError(f"{root / rel}: not listed in the manifest's files (the runtime could "
                                        "open it unverified)")
    for rel, meta in manifest.files.items():
        path = check_path(root, rel, f"files[{rel!r}]")
        if not os.path.lexists(path):
            raise ArtifactError(f"{path}: listed in the manifest but missing")
        if sha256_file(path, limit=meta.bytes, what="artifact file") != meta.sha256 or \
                os.stat(path).st_size != meta.bytes:
            raise ArtifactError(f"{path}: checksum mismatch (corrupt or modified since the build)")
