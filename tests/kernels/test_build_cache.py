"""Building the kernels (``trtvocab/kernels/compile.py``, ``library.py``): a failed build falls back to torch
and says why; the build's name hashes every file under ``csrc/`` and the package ships them; the build
cache's stale locks, FIFOs, truncated or rewritten libraries are rebuilt, never loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.fused_reference import NVFP4, check, exact_weight, make_head, tensors_for
from trtvocab import kernels
from trtvocab.kernels import compile as kcompile
from trtvocab.kernels import library
from trtvocab.kernels.__main__ import main as kernels_main


# ---- building, disabling, failing ----------------------------------------------------------------------------
def test_build_failure_falls_back_and_says_why(monkeypatch, caplog):
    def broken(verbose: bool = False):
        raise RuntimeError("Error building extension 'trtvocab_fused': c++: not found")

    monkeypatch.delenv(library.ENV_VAR, raising=False)
    monkeypatch.setattr(library, "_loaded", None)
    monkeypatch.setattr(library, "_failure", None)
    monkeypatch.setattr(library, "_build", broken)
    with caplog.at_level("WARNING", logger=kernels.__name__):
        assert kernels.load() is None
        assert kernels.load() is None  # logged once, not per call
    assert "c++: not found" in (kernels.unavailable_reason() or "")
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1
    t = tensors_for(NVFP4, 40, 32)
    head = make_head(NVFP4, "static", 40, 32, t)
    check(head, torch.randn(2, 32).bfloat16(), exact_weight(NVFP4, t), fused_path=False)


def test_cli_build(capsys, monkeypatch):
    monkeypatch.setenv(library.ENV_VAR, "0")
    assert kernels_main(["--build"]) == 0
    assert "disabled" in capsys.readouterr().out
    monkeypatch.delenv(library.ENV_VAR)
    assert kernels_main(["--build"]) == 0
    out = capsys.readouterr().out
    assert ("self-check passed" in out) == kernels.available(), out


def test_source_ships_with_the_package():
    assert kcompile.SOURCE.is_file() and kcompile.SOURCE.parent.name == "csrc"
    assert kcompile.build_name().startswith("trtvocab_fused_")


def _included(source: Path) -> set[Path]:
    """The quoted ``#include`` files of ``source``, transitively (read from the text, not from build.py)."""
    found: set[Path] = set()
    for line in source.read_text().splitlines():
        if line.startswith('#include "'):
            header = (source.parent / line.split('"')[1]).resolve()
            found |= {header} | _included(header)
    return found


def test_build_name_hashes_every_file_under_csrc(tmp_path, monkeypatch):
    # A stale cached library must never be served: every header the translation units include is
    # among the hashed files, and editing, adding or renaming one changes the build's name.
    csrc = kcompile.CSRC
    hashed = {p.resolve() for p in kcompile.source_files()}
    units = sorted(csrc.glob("*.cpp"))
    assert units and {p.resolve() for p in units} <= hashed
    headers = set().union(*(_included(u) for u in units))
    assert headers and headers <= hashed, sorted(map(str, headers - hashed))
    copy = tmp_path / "csrc"
    shutil.copytree(csrc, copy)
    monkeypatch.setattr(kcompile, "CSRC", copy)
    base = kcompile.build_name()
    header = copy / "fused" / "vec8.h"
    text = header.read_bytes()
    header.write_bytes(text + b"// an edit\n")
    edited = kcompile.build_name()
    header.write_bytes(text)
    assert kcompile.build_name() == base != edited
    (copy / "fused" / "new.h").write_bytes(b"#pragma once\n")
    added = kcompile.build_name()
    (copy / "fused" / "new.h").rename(copy / "fused" / "other.h")
    assert len({base, edited, added, kcompile.build_name()}) == 4


def test_package_data_ships_every_file_under_csrc():
    import fnmatch

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["trtvocab"]
    package = kcompile.CSRC.parent.parent
    for path in kcompile.source_files():
        rel = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatchcase(rel, pat) and rel.count("/") == pat.count("/") for pat in patterns), rel


# ---- the build cache: stale locks, FIFOs, truncated or rewritten libraries are rebuilt, never loaded ---------
# Each load runs in a child process under a timeout (a regression hangs the child, not the suite)
# against a private copy of the cache (TRTVOCAB_KERNELS_DIR), so the user's cache is never touched.
CHILD_TIMEOUT_S = 600  # a cold compile on a slow machine; a hang is caught by the timeout, not by timing
LOAD_IN_CHILD = """
import json
from trtvocab import kernels
loaded = kernels.load()
print(json.dumps({"ok": loaded is not None, "reason": kernels.unavailable_reason(),
                  "path": loaded.path if loaded else None}))
"""


def load_in_child(cache: Path, lock_timeout_s: float = 60.0) -> tuple[dict, str]:
    env = {**os.environ, kcompile.CACHE_ENV_VAR: str(cache), kcompile.LOCK_TIMEOUT_ENV_VAR: str(lock_timeout_s)}
    env.pop(library.ENV_VAR, None)
    proc = subprocess.run([sys.executable, "-c", LOAD_IN_CHILD], env=env, capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0, f"the loading process died (status {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private cache root holding a built, recorded library (copied from the user's cache when
    it has this build, so only the link step runs)."""
    if library.disabled_reason() is None and not kernels.available():
        pytest.skip(f"fused kernels cannot be built here: {kernels.unavailable_reason()}")
    root = tmp_path_factory.mktemp("kernel_cache")
    mine = Path(kernels.load().path).parent if kernels.load() is not None else None
    if mine is not None and mine.is_dir():
        shutil.copytree(mine, root / mine.name, ignore=shutil.ignore_patterns(kcompile.LOCK_NAME, kcompile.TORCH_BATON))
    out, err = load_in_child(root)
    assert out["ok"], (out, err)
    return root


def _library_in(cache: Path) -> Path:
    return cache / kcompile.build_name() / f"{kcompile.build_name()}.so"


def _fresh_copy(warm: Path, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(warm, cache)
    return cache


@pytest.mark.subprocess
def test_stale_locks_of_a_killed_build_are_recovered(warm_cache: Path, tmp_path: Path) -> None:
    cache = _fresh_copy(warm_cache, tmp_path)
    build_dir = _library_in(cache).parent
    (build_dir / kcompile.TORCH_BATON).write_text("")  # torch's baton, left by a build killed mid-way
    (build_dir / kcompile.LOCK_NAME).write_text("999999\n")  # our lock file, its owner dead (no flock held)
    os.unlink(_library_in(cache))  # forces the build path, where torch would wait for its baton forever
    out, err = load_in_child(cache)
    assert out["ok"], (out, err)
    assert not (build_dir / kcompile.TORCH_BATON).exists()
    assert kcompile.cache_problem(_library_in(cache)) is None


@pytest.mark.subprocess
def test_a_lock_held_by_a_live_build_times_out_to_the_torch_path(warm_cache: Path, tmp_path: Path) -> None:
    cache = _fresh_copy(warm_cache, tmp_path)
    build_dir = _library_in(cache).parent
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(build_dir / kcompile.LOCK_NAME)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(120)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        out, err = load_in_child(cache, lock_timeout_s=1.0)
    finally:
        holder.kill()
        holder.wait()
    assert not out["ok"] and "TimeoutError" in out["reason"] and "held by a live process" in out["reason"], out
    assert err.count("using the torch path") == 1, err  # one log line


@pytest.mark.subprocess
@pytest.mark.parametrize("damage", ["fifo", "truncated", "rewritten", "no record", "symlink"])
def test_a_damaged_cached_library_is_rebuilt_never_opened(warm_cache: Path, tmp_path: Path, damage: str) -> None:
    cache = _fresh_copy(warm_cache, tmp_path)
    library = _library_in(cache)
    data = library.read_bytes()
    if damage == "fifo":
        library.unlink()
        os.mkfifo(library)
    elif damage == "truncated":  # dlopen of this would SIGBUS
        library.write_bytes(data[: len(data) // 3])
    elif damage == "rewritten":  # same size, one byte changed
        library.write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    elif damage == "no record":
        kcompile.record_path(library).unlink()
    else:
        elsewhere = tmp_path / "elsewhere.so"
        elsewhere.write_bytes(data)
        library.unlink()
        library.symlink_to(elsewhere)
    assert kcompile.cache_problem(library) is not None
    out, err = load_in_child(cache)
    assert out["ok"], (out, err)
    assert library.is_file() and not library.is_symlink() and library.read_bytes() == data  # rebuilt, same bits
    assert kcompile.cache_problem(library) is None


def test_cache_problem_names_what_is_wrong(tmp_path: Path) -> None:
    library = tmp_path / "lib.so"
    assert kcompile.cache_problem(library) == "not built yet"
    library.write_bytes(b"\x7fELF" + bytes(60))
    assert "no build record" in (kcompile.cache_problem(library) or "")
    kcompile.write_record(library)
    assert kcompile.cache_problem(library) is None
    library.write_bytes(b"\x7fELF" + bytes(30))
    assert "34 bytes, 64 were recorded at build" in (kcompile.cache_problem(library) or "")  # truncated
    kcompile.record_path(library).unlink()
    os.mkfifo(kcompile.record_path(library))  # a FIFO as the record: refused, not read
    assert "unreadable" in (kcompile.cache_problem(library) or "")


def test_lock_timeout_setting_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kcompile.LOCK_TIMEOUT_ENV_VAR, "2.5")
    assert kcompile.lock_timeout() == 2.5
    for bad in ("0", "-1", "inf", "soon"):
        monkeypatch.setenv(kcompile.LOCK_TIMEOUT_ENV_VAR, bad)
        with pytest.raises(ValueError, match=kcompile.LOCK_TIMEOUT_ENV_VAR):
            kcompile.lock_timeout()
