"""Hostile publication (``trtvocab/base/publish.py``): ``--force`` never replaces a folder this tool did not
write; two runs racing for one ``--out``, a crash between the renames, a failed rename, a full disk (ENOSPC,
EFBIG) leave the old artifact or the new one whole, print one error line and leave no private folder; every
published file and folder is fsynced.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from tests.hostile import (
    ENV,
    H,
    assert_cli_error,
    build_art,
    cli,
    copy_art,
    dead_pid,
    private_names,
    recipe_dict,
    recipe_toml,
    snapshot,
    write_hidden,
)
from trtvocab.artifact import store as artifacts
from trtvocab.artifact.recipe import parse_recipe
from trtvocab.base import publish
from trtvocab.errors import ArtifactError, WriteError
from trtvocab.pipeline.build import build


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_art(tmp_path_factory)


@pytest.fixture
def hidden_file(tmp_path: Path) -> Path:
    return write_hidden(tmp_path / "h.safetensors")


# ==== --force replaces only what this tool wrote ==============================================================
def test_build_force_keeps_a_foreign_web_app_byte_for_byte(tmp_path: Path) -> None:
    public = tmp_path / "webapp" / "public"
    public.mkdir(parents=True)
    (public / "manifest.json").write_text(json.dumps({"name": "My App", "start_url": "/", "display": "standalone"}))
    (public / "index.html").write_text("<!doctype html><title>app</title>")
    (public / "data.db").write_bytes(os.urandom(4096))
    (public / "assets").mkdir()
    (public / "assets" / "app.js").write_text("console.log(1)")
    before = snapshot(public)
    with pytest.raises(ArtifactError, match="not a folder this tool wrote") as info:
        build(parse_recipe(recipe_dict(public), "s.toml"), force=True)
    assert str(public) in str(info.value)
    assert snapshot(public) == before
    assert private_names(public.parent) == []


@pytest.mark.parametrize("marker", [
    '{"format": "trtvocab-artifact"',  # our name, but not JSON
    '["trtvocab-artifact"]',  # JSON, not an object
    '{"format": "trtvocab-artifacts", "format_version": 3}',  # another format name
])
def test_build_force_refuses_a_manifest_that_does_not_parse_as_ours(tmp_path: Path, marker: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text(marker)
    (out / "keep.bin").write_bytes(b"\x00\x01precious")
    before = snapshot(out)
    with pytest.raises(ArtifactError, match="not a folder this tool wrote"):
        build(parse_recipe(recipe_dict(out, onnx=False), "s.toml"), force=True)
    assert snapshot(out) == before


def test_build_force_replaces_our_own_artifact(art: Path, tmp_path: Path) -> None:
    out = copy_art(art, tmp_path / "mine")
    (out / "rank0" / "stale.txt").write_text("from the old build")
    _, manifest = build(parse_recipe(recipe_dict(out, onnx=False), "s.toml"), force=True)
    assert not (out / "rank0" / "stale.txt").exists()
    assert sorted(manifest.files) == ["rank0/weights.safetensors", "rank1/weights.safetensors"]
    assert private_names(tmp_path) == []


# ==== races, crashes and failed renames: the old artifact or the new one, whole ===============================
def test_concurrent_publication_exactly_one_wins(tmp_path: Path) -> None:
    """A second run publishes into ``out`` while the first is still building: the first must not
    replace it (the exists-check at the start is long past)."""
    out = tmp_path / "race"
    with pytest.raises(ArtifactError, match="appeared while this run was building") as info:
        with publish.staging(out, force=False, is_ours=artifacts.is_artifact) as first:
            (first / "who").write_text("first")
            with publish.staging(out, force=False, is_ours=artifacts.is_artifact) as second:
                (second / "who").write_text("second")
    assert str(out) in str(info.value)
    assert (out / "who").read_text() == "second"
    assert private_names(tmp_path) == []


@pytest.mark.subprocess
@pytest.mark.timeout(300)
def test_two_concurrent_cli_builds_one_wins(tmp_path: Path) -> None:
    out = tmp_path / "same"
    recipe = recipe_toml(tmp_path / "r.toml", out, onnx=False)
    cmd = [sys.executable, "-c", "from trtvocab.commands.cli import main; main()", "build", str(recipe)]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    results = [(p.wait(timeout=240), p.stdout.read()) for p in procs]  # type: ignore[union-attr]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(text for code, text in results if code == 2)
    assert "ArtifactError" in loser and str(out) in loser and "Traceback" not in loser
    artifacts.read_manifest(out)
    assert private_names(tmp_path) == []


@pytest.mark.subprocess
def test_stale_private_folders_of_ours_are_cleaned_and_nothing_else(tmp_path: Path) -> None:
    out = tmp_path / "a"
    host = publish._HOST
    gone = dead_pid()
    stale = tmp_path / f".a.building-{host}-{gone}-deadbeef"
    live = tmp_path / f".a.building-{host}-{os.getpid()}-cafef00d"
    other_host = tmp_path / f".a.building-{'0' * 8 if host != '0' * 8 else '1' * 8}-{gone}-00000000"
    not_ours = tmp_path / ".a.building-notes"
    other_name = tmp_path / f".b.building-{host}-{gone}-12345678"
    for folder in (stale, live, other_host, not_ours, other_name):
        folder.mkdir()
        (folder / "big.bin").write_bytes(b"x" * 1024)
    build(parse_recipe(recipe_dict(out, onnx=False), "s.toml"))
    left = set(private_names(tmp_path))
    assert stale.name not in left
    assert {live.name, other_host.name, not_ours.name, other_name.name} <= left


@pytest.mark.subprocess
def test_crash_between_the_fallback_renames_gives_the_old_artifact_back(art: Path, tmp_path: Path) -> None:
    """Killed between ``out -> .NAME.old-*`` and ``stage -> out``: the next run restores the old one."""
    hidden_old = tmp_path / f".a.old-{publish._HOST}-{dead_pid()}-0000abcd"
    copy_art(art, hidden_old)
    out = tmp_path / "a"
    with pytest.raises(ArtifactError, match="already exists"):
        build(parse_recipe(recipe_dict(out, onnx=False), "s.toml"))
    assert artifacts.read_manifest(out).files == artifacts.read_manifest(art).files
    assert private_names(tmp_path) == []


def test_force_publication_is_old_or_new_at_every_step(art: Path, tmp_path: Path, monkeypatch) -> None:
    out = copy_art(art, tmp_path / "a")
    real = publish._renameat2
    seen: list[bool] = []

    def spy(src: Path, dst: Path, flags: int) -> bool:
        seen.append(artifacts.is_artifact(out))
        done = real(src, dst, flags)
        seen.append(artifacts.is_artifact(out))
        return done

    monkeypatch.setattr(publish, "_renameat2", spy)
    build(parse_recipe(recipe_dict(out, onnx=False), "s.toml"), force=True)
    assert seen and all(seen)
    assert sorted(artifacts.read_manifest(out).files) == ["rank0/weights.safetensors", "rank1/weights.safetensors"]


def test_fallback_publication_failure_keeps_the_old_artifact(art: Path, tmp_path: Path, monkeypatch) -> None:
    """Without renameat2 (another OS or filesystem) publication takes two renames; a failure of the
    second puts the old artifact back."""
    out = copy_art(art, tmp_path / "a")
    monkeypatch.setattr(publish, "_renameat2", lambda src, dst, flags: False)
    real = publish._rename_noreplace

    def fail_publish(src: Path, dst: Path) -> None:
        if ".building-" in Path(src).name:
            raise OSError(5, "Input/output error", str(dst))
        real(src, dst)

    monkeypatch.setattr(publish, "_rename_noreplace", fail_publish)
    with pytest.raises(OSError, match="Input/output error"):
        build(parse_recipe(recipe_dict(out, onnx=False), "s.toml"), force=True)
    assert artifacts.read_manifest(out).files == artifacts.read_manifest(art).files
    assert private_names(tmp_path) == []


def test_published_files_and_folders_are_fsynced(tmp_path: Path, monkeypatch) -> None:
    files: list[str] = []
    folders: list[str] = []
    real_file, real_dir = publish.fsync_file, publish.fsync_dir
    monkeypatch.setattr(publish, "fsync_file", lambda p: (files.append(Path(p).name), real_file(p)))
    monkeypatch.setattr(publish, "fsync_dir", lambda p: (folders.append(str(p)), real_dir(p)))
    out = tmp_path / "a"
    build(parse_recipe(recipe_dict(out, onnx=False), "s.toml"))
    assert {"weights.safetensors", "manifest.json"} <= set(files)
    assert files.count("weights.safetensors") >= 2
    assert str(tmp_path) in folders  # the parent, after the publishing rename
    assert sum(1 for f in folders if Path(f).name in ("rank0", "rank1")) == 2


# ==== disk full, file too large: one WriteError, the old artifact kept ========================================
def _enospc_safetensors(monkeypatch) -> None:
    """``save_file`` as it fails on a full disk: a partial file, then safetensors' own error."""
    from safetensors import SafetensorError

    def full(tensors: Any, path: str, metadata: Any = None) -> None:
        Path(path).write_bytes(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("trtvocab.pipeline.build.save_file", full)


def _efbig_onnx(monkeypatch) -> None:
    import trtvocab.export.onnx as onnx_export

    def too_large(head: Any, path: Path, **kwargs: Any) -> None:
        Path(path).write_bytes(b"\0" * 100)
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(onnx_export, "export_onnx", too_large)


def _enospc_manifest(monkeypatch) -> None:
    real = open

    def full(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "manifest.json" in str(path) and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(publish, "open", full, raising=False)


DISK_FULL = {"weights ENOSPC": (_enospc_safetensors, "rank0/weights.safetensors", "No space left on device (ENOSPC)"),
             "onnx EFBIG": (_efbig_onnx, "", "File too large (EFBIG)"),
             "manifest ENOSPC": (_enospc_manifest, "manifest.json", "No space left on device (ENOSPC)")}


@pytest.mark.parametrize("force", [False, True], ids=["build", "build --force"])
@pytest.mark.parametrize("case", list(DISK_FULL))
def test_disk_full_during_build_is_one_error_line_and_keeps_the_old_artifact(art: Path, tmp_path: Path,
                                                                             monkeypatch, case: str,
                                                                             force: bool) -> None:
    """ENOSPC / EFBIG while building is a WriteError naming the artifact and the file (not a raw
    SafetensorError / OSError), the old artifact byte for byte as it was, no private folder left."""
    fail, file, why = DISK_FULL[case]
    out = copy_art(art, tmp_path / "a") if force else tmp_path / "a"
    before = snapshot(out) if force else None
    recipe = recipe_toml(tmp_path / "r.toml", out, onnx=True)
    fail(monkeypatch)
    code, output = cli("build", str(recipe), *(["--force"] if force else []))
    assert_cli_error(code, output, "WriteError", f"build --out {out}", why, "nothing was published")
    assert file in output
    if force:
        assert snapshot(out) == before
        assert f"{out} is as it was" in output.replace("\n", "")
    else:
        assert not out.exists()
    assert private_names(tmp_path) == []
    with pytest.raises(WriteError, match=r"nothing was published"):
        build(parse_recipe(recipe_dict(out), "r.toml"), force=force)
    assert private_names(tmp_path) == []


_LIMITED = textwrap.dedent("""
    import resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    from trtvocab.commands.cli import app
    app(sys.argv[2:], prog_name="trtvocab")
""")


def _limited_cli(limit: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _LIMITED, str(limit), *args], capture_output=True, text=True,
                          timeout=300, env=ENV)


@pytest.mark.subprocess
def test_file_size_limit_during_build_force_and_infer_out(art: Path, tmp_path: Path) -> None:
    """A real EFBIG (RLIMIT_FSIZE, in a child process): `build --force` keeps the old artifact and leaves no
    staging folder; `infer --out` keeps the old logits file; each prints one error line naming the path."""
    out = copy_art(art, tmp_path / "a")
    before = snapshot(out)
    recipe = recipe_toml(tmp_path / "r.toml", out, onnx=True)
    res = _limited_cli(2048, "build", str(recipe), "--force")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and "WriteError" in res.stderr and "File too large (EFBIG)" in res.stderr
    assert f"build --out {out}" in res.stderr.replace("\n", "")
    assert snapshot(out) == before and private_names(tmp_path) == []

    hidden = tmp_path / "h.safetensors"
    hidden.write_bytes(save({"hidden_states": torch.randn(2, H), "seq_lens": torch.tensor([1, 1], dtype=torch.int32)}))
    logits = tmp_path / "logits.safetensors"
    logits.write_bytes(b"the previous logits")
    res = _limited_cli(256, "infer", str(art), "--hidden", str(hidden), "--backend", "torch", "--out", str(logits))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and "WriteError" in res.stderr and "File too large (EFBIG)" in res.stderr
    assert str(logits) in res.stderr.replace("\n", "")
    assert logits.read_bytes() == b"the previous logits"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.ranks  # infer of the tp 2 artifact launches its ranks
def test_cli_infer_out_on_a_full_disk_is_one_error_line(art: Path, hidden_file: Path, tmp_path: Path,
                                                        monkeypatch) -> None:
    logits = tmp_path / "logits.safetensors"
    logits.write_bytes(b"old")
    real = open

    def full(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if Path(path).name.startswith(".logits.safetensors.") and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(publish, "open", full, raising=False)
    assert_cli_error(*cli("infer", str(art), "--hidden", str(hidden_file), "--backend", "torch", "--out", str(logits)),
                     "WriteError", str(logits), "No space left on device (ENOSPC)")
    assert logits.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
