"""Files that are not regular files (``trtvocab/base/safe_read.py``): a FIFO or ``/dev/zero`` where a reader
expects a file -- a hidden-states file, a recipe, a manifest, an artifact's files, a hash, a safetensors
header -- is a typed error naming it, never a blocked read. The cases run in a child process under a
timeout, so a regression fails instead of stalling the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.hostile import ENV, assert_cli_error, build_art


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_art(tmp_path_factory)


HANG_SCRIPT = textwrap.dedent("""
    import json, os, shutil, sys
    from pathlib import Path
    from trtvocab.errors import TrtVocabError
    art, work = Path(sys.argv[1]), Path(sys.argv[2])

    def case(name, fn):
        try:
            fn()
            print(f"CASE {name} | no error", flush=True)
        except TrtVocabError as exc:
            print(f"CASE {name} | {type(exc).__name__} | {exc}".replace("\\n", " "), flush=True)

    def fifo(path):
        if os.path.lexists(path):
            os.remove(path)
        os.mkfifo(path)
        return path

    def redigest(root, mutate):
        from trtvocab.artifact.store import body_digest
        m = json.loads((root / "manifest.json").read_text())
        mutate(m)
        m["digest"] = body_digest(m)
        (root / "manifest.json").write_text(json.dumps(m))

    from trtvocab.checkpoints.hidden_file import load_hidden, load_last_tokens
    from trtvocab.artifact.store import read_manifest
    from trtvocab.artifact.recipe import load_recipe
    case("hidden fifo", lambda: load_hidden(fifo(work / "h.safetensors")))
    case("last_tokens fifo", lambda: load_last_tokens(work / "h.safetensors"))
    case("recipe fifo", lambda: load_recipe(fifo(work / "r.toml")))

    a = work / "a"; shutil.copytree(art, a)
    fifo(a / "rank1" / "lm_head.onnx")
    case("artifact file fifo", lambda: read_manifest(a))

    b = work / "b"; shutil.copytree(art, b)
    fifo(b / "manifest.json")
    case("manifest fifo", lambda: read_manifest(b))

    c = work / "c"; shutil.copytree(art, c)
    os.remove(c / "rank0" / "lm_head.onnx"); os.symlink("/dev/zero", c / "rank0" / "lm_head.onnx")
    empty = {"sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", "bytes": 0}
    redigest(c, lambda m: m["files"].update({"rank0/lm_head.onnx": empty}))
    case("onnx symlink to /dev/zero, bytes 0", lambda: read_manifest(c))

    d = work / "d"; shutil.copytree(art, d)
    os.remove(d / "rank0" / "weights.safetensors"); os.symlink("/dev/zero", d / "rank0" / "weights.safetensors")
    redigest(d, lambda m: m["files"].update({"rank0/weights.safetensors": empty}))
    case("weights symlink to /dev/zero", lambda: read_manifest(d))

    from trtvocab.base.safe_read import sha256_file
    from trtvocab.base.safetensors_header import read_safetensors_header
    from trtvocab.errors import InputError
    case("hash of /dev/zero, 0 bytes recorded", lambda: sha256_file("/dev/zero", limit=0))
    case("safetensors header of /dev/zero", lambda: read_safetensors_header("/dev/zero", "hidden states", InputError))
    print("DONE", flush=True)
""")
HANG_EXPECT = {  # case -> (error type, text its message contains)
    "hidden fifo": ("InputError", "h.safetensors: is a FIFO"),
    "last_tokens fifo": ("InputError", "h.safetensors: is a FIFO"),
    "recipe fifo": ("ConfigError", "r.toml: is a FIFO"),
    "artifact file fifo": ("ArtifactError", "rank1/lm_head.onnx: is a FIFO"),
    "manifest fifo": ("ArtifactError", "manifest.json: is a FIFO"),
    "onnx symlink to /dev/zero, bytes 0": ("ArtifactError", "'rank0/lm_head.onnx' leads outside the artifact "
                                                            "(to /dev/zero)"),
    "weights symlink to /dev/zero": ("ArtifactError", "'rank0/weights.safetensors' leads outside the artifact"),
    "hash of /dev/zero, 0 bytes recorded": ("ArtifactError", "/dev/zero: is a character device"),
    "safetensors header of /dev/zero": ("InputError", "/dev/zero: is a character device"),
}


@pytest.fixture(scope="module")
def hang_results(art: Path, tmp_path_factory) -> dict[str, str]:
    work = tmp_path_factory.mktemp("hang")
    try:
        res = subprocess.run([sys.executable, "-c", HANG_SCRIPT, str(art), str(work)], env=ENV, timeout=120,
                             capture_output=True, text=True)
        out = res.stdout + res.stderr
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        out += "\nHUNG"
    return {line.split(" | ")[0][5:]: line for line in out.splitlines() if line.startswith("CASE ")} | {"_": out}


@pytest.mark.subprocess
@pytest.mark.parametrize("case", sorted(HANG_EXPECT))
def test_nothing_blocks_on_fifos_or_endless_files(hang_results: dict[str, str], case: str) -> None:
    line = hang_results.get(case)
    assert line is not None, f"case {case!r} did not finish (hung?):\n{hang_results['_']}"
    kind, text = HANG_EXPECT[case]
    assert f"| {kind} |" in line and text in line, line


@pytest.mark.subprocess
@pytest.mark.timeout(180)
def test_cli_infer_with_a_fifo_as_hidden_returns(art: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "hidden.safetensors"
    os.mkfifo(fifo)
    # no hang: subprocess.run's timeout raises TimeoutExpired (a wall-clock bound on a fresh interpreter's
    # start-up would depend on the machine's load)
    res = subprocess.run([sys.executable, "-c", "from trtvocab.commands.cli import main; main()", "infer", str(art),
                          "--hidden", str(fifo), "--backend", "torch"], env=ENV, timeout=120,
                         capture_output=True, text=True)
    assert_cli_error(res.returncode, res.stdout + res.stderr, "InputError", str(fifo), "FIFO")
