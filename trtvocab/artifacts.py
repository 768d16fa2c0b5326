"""Build artifacts on disk: layout, manifest, atomic publication, verification on load.

::

    OUT/manifest.json                 what was built, from what, with which versions;
                                      sha256 of every file; what was skipped and why
    OUT/rank{r}/weights.safetensors   the shard (+ scales): the PyTorch fallback's input
    OUT/rank{r}/lm_head.onnx          (+ lm_head.onnx.data when large) the graph TensorRT parses
    OUT/rank{r}/lm_head.plan          TensorRT engine, only where TensorRT and a suitable GPU exist

A build writes into a private sibling folder and publishes it with one rename
(:func:`trtvocab.fsutil.staging`), so a reader sees either the old artifact or the new
one, never a mix or a half. The manifest's schema is :class:`trtvocab.recipe.Manifest`;
this module is the only one that reads or writes the file.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import ValidationError

from trtvocab.errors import ArtifactError
from trtvocab.fsutil import atomic_write_bytes, sha256_file
from trtvocab.fsutil import staging as _staging
from trtvocab.recipe import FileRecord, Manifest
from trtvocab.version import __version__

MANIFEST = "manifest.json"
FORMAT = "trtvocab-artifact"
FORMAT_VERSION = 2  # 2: typed manifest (engine records nested under "build", weight_format names)


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


def _is_artifact(path: Path) -> bool:
    return (path / MANIFEST).is_file()


@contextmanager
def staging(out: Path, *, force: bool) -> Iterator[Path]:
    """Build into a private folder, publish it as ``out`` (see :func:`trtvocab.fsutil.staging`);
    ``force`` replaces only a folder that holds an artifact manifest."""
    with _staging(out, force=force, is_ours=_is_artifact) as stage:
        yield stage


def write_manifest(root: Path, manifest: Manifest) -> Manifest:
    """Add checksums of every file under ``root`` and write ``manifest.json`` atomically."""
    root = Path(root)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = manifest.model_copy(update={
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "files": {str(p.relative_to(root)): FileRecord(sha256=sha256_file(p), bytes=p.stat().st_size) for p in files},
    })
    atomic_write_bytes(root / MANIFEST, json.dumps(manifest.model_dump(mode="json"), indent=2, sort_keys=True).encode())
    return manifest


def read_manifest(root: Path, *, verify: bool = True) -> Manifest:
    """Load and check an artifact: format, version, schema, every rank present, every checksum."""
    root = Path(root)
    path = root / MANIFEST
    if not path.exists():
        raise ArtifactError(f"{path}: missing (not a trtvocab artifact, or an unfinished build)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise ArtifactError(f"{path}: not a trtvocab artifact (format {found!r})")
    if raw.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: artifact format version {raw.get('format_version')!r}, this trtvocab reads "
            f"version {FORMAT_VERSION}; rebuild it"
        )
    built = raw.get("versions", {}).get("trtvocab") if isinstance(raw.get("versions"), dict) else None
    if not isinstance(built, str) or built.split(".")[:2] != __version__.split(".")[:2]:
        raise ArtifactError(f"{path}: built by trtvocab {built}, this is {__version__}; rebuild it")
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ArtifactError(f"{path}: does not match the manifest schema ({len(exc.errors())} problem(s); "
                            f"first: {where}: {first['msg']})") from None
    for entry in manifest.ranks:
        if not rank_dir(root, entry.rank).is_dir():
            raise ArtifactError(f"{rank_dir(root, entry.rank)}: rank {entry.rank} of the artifact is missing")
    if verify:
        verify_files(root, manifest)
    return manifest


def verify_files(root: Path, manifest: Manifest) -> None:
    if not manifest.files:
        raise ArtifactError(f"{Path(root) / MANIFEST}: lists no files (a manifest from an unfinished or other build)")
    for rel, meta in manifest.files.items():
        path = Path(root) / rel
        if not path.exists():
            raise ArtifactError(f"{path}: listed in the manifest but missing")
        if path.stat().st_size != meta.bytes or sha256_file(path) != meta.sha256:
            raise ArtifactError(f"{path}: checksum mismatch (corrupt or modified since the build)")
