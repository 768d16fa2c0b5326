"""Hostile inputs: no data loss, no hang, no silent wrong answer, no traceback.

Grouped by family. Every case asserts the error's type and that its message names the
input; CLI cases assert exit code 2, one ``error:`` line and no ``Traceback``; cases that
used to hang run in a subprocess with a timeout, so a regression fails instead of
stalling CI. Expectations are written out here (shard ranges, byte contents, field
names), never recomputed with the code under test.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save, save_file
from typer.testing import CliRunner

from tests.conftest import model_config, write_hf_dir
from trtvocab.artifact import store as artifacts
from trtvocab.artifact.recipe import load_recipe, parse_recipe
from trtvocab.base import publish
from trtvocab.commands.cli import app
from trtvocab.errors import (
    ArtifactError,
    CheckpointError,
    ConfigError,
    InputError,
    PeerRankError,
    QuantizationError,
    RankFailures,
    RankMismatchError,
    WriteError,
)
from trtvocab.pipeline.build import build

V, H, TP = 101, 16, 2  # 101 = 51 + 50: rank 0 owns [0, 51), rank 1 [51, 101)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def recipe_dict(out: Path, *, onnx: bool = True, **lm_head: Any) -> dict[str, Any]:
    return {"checkpoint": {"synthetic": {"vocab_size": V, "hidden_size": H, "seed": 3, "std": 0.5}},
            "mapping": {"tp_size": TP}, "lm_head": {"dtype": "float32", **lm_head},
            "output": {"dir": str(out), "onnx": onnx}}


def recipe_toml(path: Path, out: Path, *, onnx: bool = True) -> Path:
    path.write_text(f'[checkpoint.synthetic]\nvocab_size = {V}\nhidden_size = {H}\nseed = 3\nstd = 0.5\n'
                    f'[mapping]\ntp_size = {TP}\n[lm_head]\ndtype = "float32"\n'
                    f'[output]\ndir = "{out}"\nonnx = {"true" if onnx else "false"}\n')
    return path


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "art"
    root, manifest = build(parse_recipe(recipe_dict(out), "hostile.toml"))
    assert [(e.start, e.end) for e in manifest.ranks] == [(0, 51), (51, 101)]
    return root


def copy_art(art: Path, dst: Path) -> Path:
    shutil.copytree(art, dst, symlinks=True)
    return dst


def edit_manifest(root: Path, mutate: Any, *, redigest: bool = True) -> None:
    """Apply ``mutate`` to the manifest's JSON; ``redigest``: as an editor who also updates the digest
    would (so that the checks behind the digest are what is tested)."""
    path = root / "manifest.json"
    m = json.loads(path.read_text())
    mutate(m)
    if redigest and isinstance(m, dict):
        m["digest"] = hashlib.sha256(json.dumps({k: v for k, v in m.items() if k != "digest"}, sort_keys=True,
                                                separators=(",", ":")).encode()).hexdigest()
    path.write_text(json.dumps(m))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def cli(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.output


def assert_cli_error(code: int, output: str, *needles: str) -> None:
    assert code == 2, output
    assert "Traceback" not in output, output
    lines = [ln for ln in output.splitlines() if "error:" in ln]
    assert len(lines) == 1, output
    for needle in needles:
        assert needle in output, (needle, output)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def private_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# ==== data loss ==========================================================================================
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


def _foreign_modelopt(folder: Path) -> dict[str, bytes]:
    folder.mkdir(parents=True)
    (folder / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.31.0"}, "quantization": {"quant_algo": "FP8"}}))
    (folder / "config.json").write_text(json.dumps(model_config(V, H)))
    save_file({"lm_head.weight": torch.randn(V, H).to(torch.float8_e4m3fn)},
              str(folder / "model-00001-of-00001.safetensors"))
    return snapshot(folder)


@pytest.mark.model
def test_quantize_force_keeps_a_foreign_modelopt_checkpoint(tmp_path: Path) -> None:
    from trtvocab.quant.quantize import quantize_checkpoint

    source = write_hf_dir(tmp_path / "dense", {"lm_head.weight": torch.randn(V, H)}, model_config(V, H))
    foreign = tmp_path / "their-fp8"
    before = _foreign_modelopt(foreign)
    with pytest.raises(ArtifactError, match="not a folder this tool wrote") as info:
        quantize_checkpoint(source, foreign, algo="fp8", force=True)
    assert str(foreign) in str(info.value)
    assert snapshot(foreign) == before


@pytest.mark.model
def test_quantize_writes_a_marker_and_force_replaces_only_that(tmp_path: Path) -> None:
    pytest.importorskip("modelopt")
    from trtvocab.quant.quantize import MARKER, quantize_checkpoint

    source = write_hf_dir(tmp_path / "dense", {"lm_head.weight": torch.randn(V, H)}, model_config(V, H))
    out = tmp_path / "q"
    quantize_checkpoint(source, out, algo="fp8")
    marker = json.loads((out / MARKER).read_text())
    assert marker["format"] == "trtvocab-quantized-checkpoint" and marker["format_version"] == 1
    quantize_checkpoint(source, out, algo="fp8", force=True)  # ours: replaced
    (out / MARKER).write_text(json.dumps({"format": "someone-else"}))
    with pytest.raises(ArtifactError, match="not a folder this tool wrote"):
        quantize_checkpoint(source, out, algo="fp8", force=True)


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


# ==== hangs (subprocesses with timeouts) =================================================================
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


def fail_or_block(rank: int, world: int, stamp: str) -> None:
    """Rank 1 fails outside any handshake (writing ``time.monotonic()``, system-wide on Linux, to
    ``stamp`` first); rank 0 is stuck (as in a collective of a subgroup the failed rank never enters,
    or a long local step) and would not return for minutes."""
    if rank == 1:
        Path(stamp).write_text(repr(time.monotonic()))
        raise InputError("seq_lens: rank 1 was handed a bad batch before the handshake")
    time.sleep(600)
    dist.barrier()


@pytest.mark.ranks
@pytest.mark.timeout(180)
def test_run_ranks_returns_once_a_peer_failed(tmp_path: Path) -> None:
    from trtvocab.parallel.launch import run_ranks

    stamp = tmp_path / "failed_at"
    with pytest.raises(RankFailures) as info:
        run_ranks(fail_or_block, 2, str(stamp), timeout_s=90)  # the old launcher waited 2 * 90 + 60 s
    elapsed = time.monotonic() - float(stamp.read_text())  # from the failure, not from the ranks' start-up
    assert elapsed < 45, elapsed
    assert isinstance(info.value.errors[1], InputError) and "seq_lens" in str(info.value.errors[1])
    assert "rank 0 exited without a result" in str(info.value)  # stopped once the outcome was known
    assert "Traceback" not in str(info.value)  # a typed error carries no traceback


# ==== silent wrong answers: the manifest must agree with the shard math, the files and itself ============
def _set(path: str, value: Any) -> Any:
    def mutate(m: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = m
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return mutate


def _both(*mutations: Any) -> Any:
    def mutate(m: dict[str, Any]) -> None:
        for f in mutations:
            f(m)
    return mutate


MANIFEST_CASES: dict[str, tuple[Any, bool, str]] = {  # case -> (edit, redigest, text the error contains)
    "end + 1 (shifted ids)": (_set("ranks.0.end", 52), True, "field ranks[0].end: 52"),
    "start - 1": (_set("ranks.1.start", 50), True, "field ranks[1].start: 50"),
    "overlapping ranges": (_both(_set("ranks.0.end", 60), _set("ranks.0.width", 60)), True, "field ranks[0].end"),
    "vocab edited with the ranges": (_both(_set("head.vocab_size", 102), _set("recipe.checkpoint.synthetic.vocab_size",
                                                                               102),
                                           _set("ranks.1.end", 102), _set("ranks.1.width", 51)),
                                     True, "records end '101', the manifest says 102"),
    "head dtype edited (with the recipe)": (_both(_set("head.dtype", "bfloat16"), _set("recipe.lm_head.dtype",
                                                                                        "bfloat16")),
                                            True, "weight is F32 [51, 16], the manifest says BF16"),
    "head dtype edited alone": (_set("head.dtype", "bfloat16"), True, "field head.dtype"),
    "context_logits edited alone": (_set("head.context_logits", True), True, "field head.context_logits"),
    "weights dropped from files": (lambda m: m["files"].pop("rank0/weights.safetensors"), True,
                                   "field ranks[0].files.weights: 'rank0/weights.safetensors' is not listed"),
    "rank file pointing at another rank": (_set("ranks.0.files.weights", "rank1/weights.safetensors"), True,
                                           "field ranks[0].files.weights"),
    "absolute path in files": (lambda m: m["files"].update({"/etc/passwd": {"sha256": "0" * 64, "bytes": 1}}), True,
                               "field files['/etc/passwd']: '/etc/passwd' is not a normalized relative path"),
    "dot-dot path in files": (lambda m: m["files"].update({"rank0/../../x": {"sha256": "0" * 64, "bytes": 1}}), True,
                              "field files['rank0/../../x']"),
    "start as a string": (_set("ranks.0.start", "0"), True, "ranks.0.start"),
    "tp_size true": (_both(_set("mapping.tp_size", True), _set("recipe.mapping.tp_size", True)), True,
                     "mapping.tp_size"),
    "huge vocab": (_set("head.vocab_size", 10**23), True, "head.vocab_size"),
    "files entry {}": (lambda m: m["files"].__setitem__("rank0/weights.safetensors", {}), True,
                       "files.rank0/weights.safetensors"),
    "key missing": (lambda m: m.pop("head"), True, "does not match the manifest schema"),
    "edited without updating the digest": (_set("ranks.0.end", 52), False, "field digest: does not match"),
    "digest removed": (lambda m: m.pop("digest"), False, "field digest: missing"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_edited_manifest_is_refused_naming_the_field(art: Path, tmp_path: Path, case: str) -> None:
    root = copy_art(art, tmp_path / "c")
    mutate, redigest, text = MANIFEST_CASES[case]
    edit_manifest(root, mutate, redigest=redigest)
    with pytest.raises(ArtifactError) as info:
        artifacts.read_manifest(root)
    assert text in str(info.value), str(info.value)
    assert "manifest.json" in str(info.value) or "weights.safetensors" in str(info.value)


@pytest.mark.parametrize("content, text", [
    (b"[1, 2, 3]", "not a trtvocab artifact (format 'list')"),
    (b'{"format": "trtvocab-artifact", "name": "\xff\xfe"}', "not UTF-8"),
    (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
])
def test_manifest_that_is_not_a_manifest(art: Path, tmp_path: Path, content: bytes, text: str) -> None:
    root = copy_art(art, tmp_path / "c")
    (root / "manifest.json").write_bytes(content)
    with pytest.raises(ArtifactError, match=r"manifest\.json") as info:
        artifacts.read_manifest(root)
    assert text in str(info.value)


def test_unlisted_file_in_a_rank_folder_is_refused(art: Path, tmp_path: Path) -> None:
    root = copy_art(art, tmp_path / "c")
    (root / "rank0" / "lm_head.onnx.data").write_bytes(b"\x00" * 64)
    with pytest.raises(ArtifactError, match=r"rank0/lm_head\.onnx\.data: not listed in the manifest"):
        artifacts.read_manifest(root)


def test_listed_symlink_leading_outside_is_refused(art: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    root = copy_art(art, tmp_path / "c")
    os.symlink(secret, root / "link.txt")
    record = {"sha256": hashlib.sha256(secret.read_bytes()).hexdigest(), "bytes": secret.stat().st_size}
    edit_manifest(root, lambda m: m["files"].update({"link.txt": record}))
    with pytest.raises(ArtifactError, match=r"field files\['link.txt'\]: 'link.txt' leads outside the artifact"):
        artifacts.read_manifest(root)


@pytest.mark.ranks  # infer on the tp 2 artifact launches the ranks itself
def test_context_logits_edited_everywhere_is_caught_by_the_graph(art: Path, tmp_path: Path) -> None:
    from trtvocab.pipeline.infer import infer

    root = copy_art(art, tmp_path / "c")
    edit_manifest(root, _both(_set("head.context_logits", True), _set("recipe.lm_head.context_logits", True)))
    with pytest.raises((ArtifactError, RankFailures)) as info:
        infer(root, torch.randn(4, H), torch.tensor([1, 3]), "onnx")
    text = str(info.value)
    assert "lm_head.onnx" in text and "context_logits" in text


def test_cli_inspect_of_an_edited_manifest_is_one_error_line(art: Path, tmp_path: Path) -> None:
    root = copy_art(art, tmp_path / "c")
    edit_manifest(root, _set("ranks.0.end", 52))
    assert_cli_error(*cli("inspect", str(root)), "ArtifactError", "ranks[0].end")


def test_cli_infer_after_a_dtype_edit_has_no_traceback(art: Path, tmp_path: Path) -> None:
    root = copy_art(art, tmp_path / "c")
    edit_manifest(root, _both(_set("head.dtype", "bfloat16"), _set("recipe.lm_head.dtype", "bfloat16")))
    hidden = tmp_path / "h.safetensors"
    hidden.write_bytes(save({"hidden_states": torch.randn(3, H)}))
    assert_cli_error(*cli("infer", str(root), "--hidden", str(hidden), "--backend", "torch"), "ArtifactError",
                     "weights.safetensors")


# ==== NaN / inf ==========================================================================================
def test_nan_weight_row_is_refused_at_load() -> None:
    from trtvocab import LMHead, Mapping

    w = torch.randn(V, H)
    w[60, 5] = float("nan")
    with pytest.raises(CheckpointError, match=r"weight: row 60 .*NaN or inf"):
        LMHead(V, H, dtype=torch.float32).load_weights({"lm_head.weight": w})
    # rank 1 owns [51, 101): the message names the token id, not the local row
    head = LMHead(V, H, dtype=torch.float32, mapping=Mapping(world_size=2, rank=1, tp_size=2))
    with pytest.raises(CheckpointError, match=r"row 60 \(token id; row 9 of this rank's shard \[51, 101\)\)"):
        head.load_weights({"weight": w})
    rank0 = LMHead(V, H, dtype=torch.float32, mapping=Mapping(world_size=2, rank=0, tp_size=2))
    rank0.load_weights({"weight": w})  # its rows [0, 51) are finite
    opted_out = LMHead(V, H, dtype=torch.float32)
    opted_out.weights.check_finite = False
    opted_out.load_weights({"weight": w})


def _quant_tensors(algo: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    if algo == "FP8":
        codes = torch.randint(0, 0x7F, (V, 32), dtype=torch.uint8, generator=gen)
        return {"weight": codes.view(torch.float8_e4m3fn), "weight_scale": torch.tensor(0.01),
                "input_scale": torch.tensor(0.02)}
    return {"weight": torch.randint(0, 256, (V, 16), dtype=torch.uint8, generator=gen),
            "weight_scale": torch.full((V, 2), 0.5).to(torch.float8_e4m3fn), "weight_scale_2": torch.tensor(0.01),
            "input_scale": torch.tensor(0.02)}


@pytest.mark.parametrize("algo,key", [("FP8", "weight_scale"), ("FP8", "input_scale"), ("FP8", "per-row"),
                                      ("NVFP4", "weight_scale_2"), ("NVFP4", "input_scale")])
@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 1e36, -1.0, 0.0])
def test_scales_that_would_give_inf_logits_are_refused(algo: str, key: str, bad: float) -> None:
    """Every per-tensor / per-row scale a quantized head multiplies by is finite, > 0, and small
    enough that scale * the largest code (6 * 448) stays finite: 1e36 passes a finiteness check
    but turns 448 into inf (and then the GEMM into NaN logits)."""
    from trtvocab import LMHead, QuantAlgo, QuantConfig
    from trtvocab.errors import QuantizationError

    gen = torch.Generator().manual_seed(0)
    tensors = _quant_tensors(algo, gen)
    granularity = "per_row" if key == "per-row" else "per_tensor"
    if key == "per-row":
        tensors["weight_scale"] = torch.full((V, 1), 0.01)
        tensors["weight_scale"][40] = bad
    else:
        tensors[key] = torch.tensor(bad)
    config = QuantConfig(quant_algo=QuantAlgo(algo), activation="static", granularity=granularity)
    head = LMHead(V, 32, dtype=torch.float32, quant_config=config)
    with pytest.raises(QuantizationError, match=r"weight_scale|input_scale"):
        head.load_weights(tensors)


def test_inf_in_a_checkpoint_is_refused(tmp_path: Path) -> None:
    from trtvocab import LMHead

    w = torch.randn(V, H)
    w[7] = float("inf")
    ckpt = write_hf_dir(tmp_path / "m", {"lm_head.weight": w}, model_config(V, H), n_files=1)
    with pytest.raises(CheckpointError, match="row 7"):
        LMHead.from_checkpoint(ckpt, dtype=torch.float32)


def test_nan_hidden_states_are_refused_by_head_processor_and_runtime(art: Path) -> None:
    from trtvocab import LMHead, LogitsProcessor
    from trtvocab.pipeline.infer import infer

    head = LMHead(V, H, dtype=torch.float32)
    head.load_weights({"weight": torch.randn(V, H)})
    x = torch.randn(5, H)
    x[2, 3] = float("nan")
    with pytest.raises(InputError, match=r"hidden_states: contains NaN or inf \(first at row 2, column 3"):
        head(x)
    with pytest.raises(InputError, match="NaN or inf"):
        LogitsProcessor()(x, head, seq_lens=[3, 2])  # row 2 is the last row of sequence 0
    head.check_finite = False  # the caller validated already: the switch skips the scan
    assert torch.isnan(head(x)[2]).all()
    x[2, 3] = float("inf")
    with pytest.raises(InputError, match="row 2, column 3"):
        infer(art, x, torch.tensor([3, 2]), "torch")


def test_nan_in_a_hidden_file_is_refused_by_infer_and_compare(art: Path, tmp_path: Path) -> None:
    from trtvocab.checkpoints.hidden_file import load_hidden

    x = torch.randn(6, H)
    x[3, 0] = float("nan")
    path = tmp_path / "nan.safetensors"
    path.write_bytes(save({"hidden_states": x}))
    with pytest.raises(InputError, match=r"nan\.safetensors: hidden_states: contains NaN or inf \(first at row 3"):
        load_hidden(path)
    assert_cli_error(*cli("infer", str(art), "--hidden", str(path)), "InputError", "row 3")
    assert_cli_error(*cli("compare", str(tmp_path / "any-baseline"), "--hidden", str(path)), "InputError", "row 3")


# ==== cross-rank values in the handshake =================================================================
def cross_rank_cases(rank: int, world: int) -> dict[str, tuple[str, str]]:
    from trtvocab import LMHead, Mapping, sampling

    def catch(fn: Any) -> tuple[str, str]:
        try:
            fn()
            return ("ok", "")
        except Exception as exc:
            return (type(exc).__name__, str(exc))

    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(V, H, generator=gen), torch.randn(3, H, generator=gen)
    head = LMHead(V, H, dtype=torch.float32, mapping=Mapping(world_size=world, rank=rank, tp_size=world))
    head.load_weights({"weight": w})
    local = head.local_logits(x)
    ids = torch.tensor([[1, 2], [3, 4], [5, 6 if rank == 0 else 7]])
    adp = rank == 0  # rank 0 built with attention DP + LM-head TP, rank 1 plain TP: both split
    mixed = LMHead(V, H, dtype=torch.float32, mapping=Mapping(world_size=world, rank=rank, tp_size=world,
                                                              enable_attention_dp=adp, enable_lm_head_tp_in_adp=adp))
    mixed.load_weights({"weight": w})
    return {
        "top_p equal": catch(lambda: sampling.top_p_mask(local, head, 0.9)),
        "top_p differs": catch(lambda: sampling.top_p_mask(local, head, 0.9 if rank == 0 else 0.5)),
        "top_p [B] differs": catch(lambda: sampling.top_p_mask(local, head, torch.tensor([0.9, 0.8, 0.7 + rank / 10]))),
        "min_p differs": catch(lambda: sampling.min_p_mask(local, head, 0.1 if rank == 0 else 0.2)),
        "logprobs ids differ": catch(lambda: sampling.logprobs(local, head, ids)),
        "mapping differs": catch(lambda: mixed(x)),
        "after the mismatches": catch(lambda: sampling.greedy(local, head)),  # the group still works
    }


@pytest.fixture(scope="module")
def cross_rank() -> list[dict[str, tuple[str, str]]]:
    from trtvocab.parallel.launch import run_ranks

    return run_ranks(cross_rank_cases, TP, timeout_s=60)


@pytest.mark.ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, field", [
    ("top_p differs", "argument digest"), ("top_p [B] differs", "argument digest"),
    ("min_p differs", "argument digest"), ("logprobs ids differ", "argument digest"),
    ("mapping differs", "ranks disagree on mapping: ['attention DP + LM-head TP', 'tensor parallel']"),
])
def test_values_that_must_match_across_ranks_are_compared(cross_rank, case: str, field: str) -> None:
    for rank in range(TP):
        kind, text = cross_rank[rank][case]
        assert kind == RankMismatchError.__name__ and field in text, (rank, kind, text)


@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_equal_values_pass_the_handshake(cross_rank) -> None:
    for rank in range(TP):
        assert cross_rank[rank]["top_p equal"] == ("ok", "")
        assert cross_rank[rank]["after the mismatches"] == ("ok", "")


# ==== type strictness and bounds =========================================================================
@pytest.mark.parametrize("section, key, value, text", [
    ("mapping", "tp_size", True, "[mapping] tp_size: Input should be a valid integer (got True)"),
    ("mapping", "tp_size", "4", "[mapping] tp_size: Input should be a valid integer (got '4')"),
    ("mapping", "tp_size", 10**18, "allowed: [1, 4096]"),
    ("mapping", "tp_size", 10**23, "allowed: [1, 4096]"),
    ("lm_head", "pad_to", 1e12, "[lm_head] pad_to: Input should be a valid integer"),
    ("lm_head", "pad_to", 10**12, "[lm_head] pad_to: Input should be less than or equal to 1048576"),
    ("checkpoint.synthetic", "vocab_size", 1e12, "[checkpoint.synthetic] vocab_size: Input should be a valid integer"),
    ("checkpoint.synthetic", "vocab_size", 10**12, "allowed: [1, 2147483647]"),
    ("checkpoint.synthetic", "seed", -1, "[checkpoint.synthetic] seed"),
    ("checkpoint.synthetic", "std", float("inf"), "[checkpoint.synthetic] std"),
    ("lm_head", "gather_output", 1, "[lm_head] gather_output: Input should be a valid boolean"),
])
def test_recipe_values_are_typed_and_bounded(section: str, key: str, value: Any, text: str) -> None:
    data = recipe_dict(Path("o"))
    node = data
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[key] = value
    with pytest.raises(ConfigError) as info:
        parse_recipe(data, "hostile.toml")
    assert "hostile.toml" in str(info.value) and text in str(info.value), str(info.value)


def test_recipe_padded_past_the_vocab_limit_is_refused() -> None:
    data = recipe_dict(Path("o"), vocab_layout="padded", pad_to=2**20)
    data["mapping"]["tp_size"] = 4096
    data["checkpoint"]["synthetic"]["vocab_size"] = 4096
    with pytest.raises(ConfigError, match="pads the vocab past 2147483647"):
        parse_recipe(data, "x.toml")


@pytest.mark.parametrize("content, text", [
    (b'[checkpoint]\npath = "caf\xe9"\n', "not UTF-8"),
    (b"a = " + b"[" * 50_000 + b"]" * 50_000 + b"\n", "not a TOML file trtvocab can read"),
    (b"[mapping]\ntp_size = 1" + b"0" * 5000 + b"\n", "r.toml"),
])
def test_recipe_files_that_are_not_recipes(tmp_path: Path, content: bytes, text: str) -> None:
    path = tmp_path / "r.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    assert str(path) in str(info.value) and text in str(info.value)


def _fp8_checkpoint(folder: Path, quantization: dict[str, Any]) -> Path:
    folder.mkdir(parents=True)
    save_file({"lm_head.weight": (torch.randn(V, H) * 0.1).to(torch.float8_e4m3fn),
               "lm_head.weight_scale": torch.tensor(0.01)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(model_config(V, H)))
    (folder / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
                                                             "quantization": quantization}))
    return folder


@pytest.mark.parametrize("quantization, text", [
    ({"quant_algo": "FP8", "exclude_modules": "lm_head"}, "exclude_modules must be a list of module-name patterns"),
    ({"quant_algo": "FP8", "exclude_modules": 5}, "exclude_modules must be a list"),
    ({"quant_algo": "FP8", "ignore": [1, 2]}, "ignore must be a list of module-name patterns (strings)"),
    ({"quant_algo": "FP8", "group_size": "abc"}, "group_size must be an int in [1, 65536], got 'abc'"),
    ({"quant_algo": "FP8", "group_size": True}, "group_size must be an int"),
    ({"quant_algo": 8}, "unknown quant_algo 8"),
    ({"quant_algo": "MIXED_PRECISION", "quantized_layers": ["lm_head"]}, "quantized_layers must be an object"),
])
def test_hf_quant_config_values_are_typed(tmp_path: Path, quantization: dict[str, Any], text: str) -> None:
    from trtvocab.quant.config import resolve_lm_head_quant

    folder = _fp8_checkpoint(tmp_path / "fp8", quantization)
    with pytest.raises(QuantizationError) as info:
        resolve_lm_head_quant(folder)
    assert text in str(info.value) and str(folder) in str(info.value), str(info.value)


def test_seq_lens_whose_int64_sum_wraps_are_refused() -> None:
    from trtvocab import LMHead, LogitsProcessor
    from trtvocab.base.inputs import last_token_rows

    wrapping = [2**62, 2**62, 2**62, 2**62 + 6]  # sums to 6 modulo 2**64
    with pytest.raises(InputError, match=r"seq_lens: length 4611686018427387904 \(sequence 0\) is longer .* T = 6"):
        last_token_rows(torch.tensor(wrapping), 6)
    head = LMHead(V, H, dtype=torch.float32)
    with pytest.raises(InputError, match="seq_lens: length"):
        LogitsProcessor()(torch.randn(6, H), head, seq_lens=wrapping)


# ==== CLI ================================================================================================
@pytest.fixture
def no_inference(monkeypatch) -> None:
    """Fail the test if the CLI runs inference: every refusal below must come before it."""
    import trtvocab.pipeline.infer

    def ran(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("inference ran before the arguments were checked")

    monkeypatch.setattr(trtvocab.pipeline.infer, "infer", ran)


@pytest.fixture
def hidden_file(tmp_path: Path) -> Path:
    path = tmp_path / "h.safetensors"
    path.write_bytes(save({"hidden_states": torch.randn(5, H), "seq_lens": torch.tensor([2, 3], dtype=torch.int32)}))
    return path


@pytest.mark.parametrize("args, text", [
    (["--top-k", "0"], "--top-k: must be >= 1"),
    (["--top-k", "-1"], "--top-k: must be >= 1"),
    (["--seq-lens", "99999999999999999999999"], "--seq-lens: 99999999999999999999999 is out of range"),
    (["--seq-lens", "2,x"], "--seq-lens: expected comma-separated integers"),
])
def test_cli_infer_refuses_bad_options_before_inference(art: Path, hidden_file: Path, no_inference, args: list[str],
                                                        text: str) -> None:
    assert_cli_error(*cli("infer", str(art), "--hidden", str(hidden_file), *args), "InputError", text)


def test_cli_infer_refuses_bad_outputs_before_inference(art: Path, hidden_file: Path, tmp_path: Path,
                                                        no_inference) -> None:
    assert_cli_error(*cli("infer", str(art), "--hidden", str(hidden_file), "--out", str(tmp_path)),
                     "InputError", f"--out {tmp_path}: is a folder")
    missing = tmp_path / "no" / "such" / "logits.safetensors"
    assert_cli_error(*cli("infer", str(art), "--hidden", str(hidden_file), "--out", str(missing)),
                     "InputError", "does not exist")


def test_cli_infer_refuses_last_tokens_that_are_not_json(art: Path, tmp_path: Path, no_inference) -> None:
    path = tmp_path / "h.safetensors"
    path.write_bytes(save({"hidden_states": torch.randn(2, H)}, metadata={"last_tokens": "['not', json"}))
    assert_cli_error(*cli("infer", str(art), "--hidden", str(path)), "InputError",
                     "metadata last_tokens is not JSON")


@pytest.mark.ranks  # infer on the tp 2 artifact launches the ranks itself
def test_cli_infer_prints_tokens_as_text_not_markup(art: Path, tmp_path: Path) -> None:
    path = tmp_path / "h.safetensors"
    path.write_bytes(save({"hidden_states": torch.randn(5, H), "seq_lens": torch.tensor([2, 3], dtype=torch.int32)},
                          metadata={"last_tokens": json.dumps(["[lowercase]", "[/bold]"])}))
    code, out = cli("infer", str(art), "--hidden", str(path), "--backend", "torch")
    assert code == 0, out
    assert "[lowercase]" in out and "[/bold]" in out


def test_cli_quantize_batch_rows_zero(tmp_path: Path) -> None:
    assert_cli_error(*cli("quantize", str(tmp_path), "--algo", "fp8", "--out", str(tmp_path / "q"), "--batch-rows",
                          "0"), "ConfigError", "--batch-rows", "got 0")


def test_cli_hidden_refuses_folders_without_tokenizer_or_with_only_pickles(tmp_path: Path) -> None:
    no_tok = tmp_path / "no-tokenizer"
    no_tok.mkdir()
    (no_tok / "config.json").write_text(json.dumps(model_config(V, H)))
    save_file({"lm_head.weight": torch.randn(V, H)}, str(no_tok / "model.safetensors"))
    assert_cli_error(*cli("hidden", str(no_tok), "--out", str(tmp_path / "h.safetensors")), "CheckpointError",
                     str(no_tok), "has no tokenizer")
    pickles = tmp_path / "pickles"
    pickles.mkdir()
    (pickles / "config.json").write_text(json.dumps(model_config(V, H)))
    (pickles / "vocab.txt").write_text("[PAD]\nhello\n")
    (pickles / "pytorch_model.bin").write_bytes(b"\x80\x04 a pickle that must never be loaded")
    assert_cli_error(*cli("hidden", str(pickles), "--out", str(tmp_path / "h.safetensors")), "CheckpointError",
                     "only pickle weights (pytorch_model.bin)")
    assert not (tmp_path / "h.safetensors").exists()


def test_cli_messages_are_text_not_markup(tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text('[checkpoint]\npath = "."\n[output]\ndirr = "x"\n')
    assert_cli_error(*cli("build", str(recipe)), "ConfigError", "[output] dirr: unknown key")
    weird = tmp_path / "we[/bold]ird[red].toml"
    assert_cli_error(*cli("build", str(weird)), "ConfigError", "we[/bold]ird[red].toml", "no such file")


def test_cli_prints_a_rank_failure_as_the_failing_ranks_typed_error(capsys) -> None:
    from trtvocab.commands.cli import _fail

    exc = RankFailures("2 of 2 ranks failed:\nrank 0: PeerRankError: ...\nrank 1: ArtifactError: ...\n"
                       "--- traceback of rank 1 ---\nTraceback (most recent call last): ...",
                       {0: PeerRankError("infer: rank(s) [1] of the group rejected their input"),
                        1: ArtifactError("/a/rank1/weights.safetensors: checksum mismatch [bold]")})
    assert _fail(exc).exit_code == 2
    err = capsys.readouterr().err
    assert_cli_error(2, err, "ArtifactError: /a/rank1/weights.safetensors: checksum mismatch [bold]", "(rank 1;")


# ==== disk full, file too large: one WriteError, the old artifact kept ===================================
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


# ==== compare options: bounded before any work ===========================================================
@pytest.mark.parametrize("args, text", [
    (["--bootstrap", "1000000000"], "--bootstrap: resamples must be an int in [0, 100000]"),
    (["--bootstrap", "-1"], "--bootstrap: resamples must be an int in [0, 100000]"),
    (["--seed", "-1"], "--seed: the bootstrap seed must be an int in [0, 2**63 - 1]"),
    (["--seed", str(2**63)], "--seed: the bootstrap seed must be an int in [0, 2**63 - 1]"),
])
def test_cli_compare_bounds_bootstrap_and_seed(tmp_path: Path, args: list[str], text: str) -> None:
    """--bootstrap 1000000000 (74.5 GiB of resamples) and --seed -1 are ConfigErrors naming the option and
    its range, before any work (not an ArrayMemoryError or a ValueError traceback)."""
    ckpt = tmp_path / "base.safetensors"
    save_file({"lm_head.weight": torch.randn(V, H)}, str(ckpt))
    hidden = tmp_path / "h.safetensors"
    ids = torch.tensor([5, 7, 9, 11])
    hidden.write_bytes(save({"hidden_states": torch.randn(4, H), "seq_lens": torch.tensor([4], dtype=torch.int32),
                             "input_ids": ids, "next_token_ids": torch.tensor([7, 9, 11, -1])}))
    assert_cli_error(*cli("compare", str(ckpt), "--hidden", str(hidden), "--simulate", "fp8", *args),
                     "ConfigError", text)


def test_llamacpp_stats_bounds_bootstrap_and_seed() -> None:
    from trtvocab.accuracy.stats import MAX_BOOTSTRAP, check_bootstrap

    check_bootstrap(MAX_BOOTSTRAP, 2**63 - 1)
    for bootstrap, seed in ((MAX_BOOTSTRAP + 1, 0), (True, 0), (10, -1), (10, 1.5), (10, 2**63)):
        with pytest.raises(ConfigError, match=r"`bootstrap`|`seed`"):
            check_bootstrap(bootstrap, seed)


# ==== hidden files: the teacher-forced relation ==========================================================
def _tf_file(path: Path, input_ids: list[int], next_ids: list[int], seq_lens: list[int] | None) -> Path:
    tensors = {"hidden_states": torch.randn(len(input_ids), H), "input_ids": torch.tensor(input_ids),
               "next_token_ids": torch.tensor(next_ids)}
    if seq_lens is not None:
        tensors["seq_lens"] = torch.tensor(seq_lens, dtype=torch.int32)
    path.write_bytes(save(tensors))
    return path


@pytest.mark.parametrize("input_ids, next_ids, seq_lens, text", [
    # inside a sequence: the next id is not the input id of the row after it
    ([1, 2, 3, 4, 5], [2, 9, 4, -1, -1], [4, 1], r"next_token_ids\[1\] = 9 but input_ids\[2\] = 3"),
    # the last row of sequence 0 points at sequence 1's first id
    ([1, 2, 3, 4, 5], [2, 3, 4, 5, -1], [4, 1], r"next_token_ids\[3\] = 5 at the last row of sequence 0"),
    # no seq_lens: one sequence, whose last row must be -1
    ([1, 2, 3], [2, 3, 4], None, r"next_token_ids\[2\] = 4 at the last row of sequence 0"),
])
def test_hidden_files_must_hold_the_teacher_forced_relation(tmp_path: Path, input_ids, next_ids, seq_lens,
                                                            text: str) -> None:
    """A hidden file whose next_token_ids disagree with its input_ids is refused, naming the row."""
    from trtvocab.checkpoints.hidden_file import load_hidden_file

    path = _tf_file(tmp_path / "h.safetensors", input_ids, next_ids, seq_lens)
    with pytest.raises(InputError, match=text):
        load_hidden_file(path)
    ckpt = tmp_path / "base.safetensors"
    save_file({"lm_head.weight": torch.randn(V, H)}, str(ckpt))
    assert_cli_error(*cli("compare", str(ckpt), "--hidden", str(path), "--simulate", "fp8"), "InputError",
                     str(path), "next_token_ids[")


def test_hidden_files_holding_the_relation_load(tmp_path: Path) -> None:
    from trtvocab.checkpoints.hidden_file import load_hidden_file

    # -1 inside a sequence is a row without a target (not scored); seq_lens that do not tile are left to
    # the reader that uses them
    good = _tf_file(tmp_path / "g.safetensors", [1, 2, 3, 4, 5], [2, -1, 4, -1, -1], [4, 1])
    assert load_hidden_file(good).next_token_ids.tolist() == [2, -1, 4, -1, -1]
    assert load_hidden_file(_tf_file(tmp_path / "one.safetensors", [1, 2, 3], [2, 3, -1], None)).seq_lens is None
