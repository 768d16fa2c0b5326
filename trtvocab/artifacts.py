"""Build artifacts on disk: layout, manifest, atomic publication, verification on load.

::

    OUT/manifest.json                 what was built, from what, with which versions;
                                      sha256 of every file; what was skipped and why
    OUT/rank{r}/weights.safetensors   the shard (+ scales): the PyTorch fallback's input
    OUT/rank{r}/lm_head.onnx          (+ lm_head.onnx.data when large) the graph TensorRT parses
    OUT/rank{r}/lm_head.plan          TensorRT engine, only where TensorRT and a suitable GPU exist

A build writes into a private sibling folder and publishes it with one rename, so a
reader sees either the old artifact or the new one, never a mix or a half.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trtvocab.errors import ArtifactError
from trtvocab.fsutil import atomic_write_bytes, sha256_file

MANIFEST = "manifest.json"
FORMAT = "trtvocab-artifact"
FORMAT_VERSION = 1


def versions() -> dict[str, str]:
    import torch

    import trtvocab

    out = {"trtvocab": trtvocab.__version__, "torch": torch.__version__, "python": platform.python_version()}
    for mod in ("onnx", "onnxruntime", "tensorrt", "modelopt"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # not installed (or broken): record its absence, don't fail
            continue
    return out


def rank_dir(root: Path, rank: int) -> Path:
    return Path(root) / f"rank{rank}"


@contextmanager
def staging(out: Path, *, force: bool, marker: str = MANIFEST) -> Iterator[Path]:
    """Yield a private folder to build into; on success publish it as ``out`` atomically.

    An existing ``out`` is refused unless ``force``; then it is swapped out by rename and
    deleted only after the new artifact is in place. ``force`` replaces only what this
    tool wrote (a folder holding ``marker``) or an empty folder: never a folder of
    something else that a mistyped ``--out`` points at. On failure the staging folder is
    removed and ``out`` is untouched.
    """
    out = Path(out)
    if out.exists() and not force:
        raise ArtifactError(f"{out} already exists; pass --force to replace it (atomically)")
    if out.exists() and not (out.is_dir() and ((out / marker).exists() or not any(out.iterdir()))):
        raise ArtifactError(f"{out} exists and is not a folder this tool wrote (no {marker}); "
                            "refusing to replace it even with --force")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.with_name(f".{out.name}.building-{uuid.uuid4().hex[:8]}")
    stage.mkdir()
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    if out.exists():
        os.replace(out, old)
    os.replace(stage, out)
    shutil.rmtree(old, ignore_errors=True)


def write_manifest(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Add checksums of every file under ``root`` and write ``manifest.json`` atomically."""
    root = Path(root)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {**manifest, "format": FORMAT, "format_version": FORMAT_VERSION,
                "files": {str(p.relative_to(root)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                          for p in files}}
    atomic_write_bytes(root / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
    return manifest


def read_manifest(root: Path, *, verify: bool = True) -> dict[str, Any]:
    """Load and check an artifact: format, version, every rank present, every checksum."""
    root = Path(root)
    path = root / MANIFEST
    if not path.exists():
        raise ArtifactError(f"{path}: missing (not a trtvocab artifact, or an unfinished build)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path}: not valid JSON ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a trtvocab artifact (format {manifest.get('format')!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: artifact format version {manifest.get('format_version')!r}, this trtvocab reads "
            f"version {FORMAT_VERSION}; rebuild it"
        )
    built = manifest.get("versions", {}).get("trtvocab")
    import trtvocab

    if built is None or built.split(".")[:2] != trtvocab.__version__.split(".")[:2]:
        raise ArtifactError(f"{path}: built by trtvocab {built}, this is {trtvocab.__version__}; rebuild it")
    for entry in manifest.get("ranks", []):
        if not rank_dir(root, entry["rank"]).is_dir():
            raise ArtifactError(f"{rank_dir(root, entry['rank'])}: rank {entry['rank']} of the artifact is missing")
    if verify:
        verify_files(root, manifest)
    return manifest


def verify_files(root: Path, manifest: dict[str, Any]) -> None:
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise ArtifactError(f"{Path(root) / MANIFEST}: lists no files (a manifest from an unfinished or other build)")
    for rel, meta in files.items():
        path = Path(root) / rel
        if not path.exists():
            raise ArtifactError(f"{path}: listed in the manifest but missing")
        if path.stat().st_size != meta["bytes"] or sha256_file(path) != meta["sha256"]:
            raise ArtifactError(f"{path}: checksum mismatch (corrupt or modified since the build)")
