"""Helpers of the hostile-input tests (``tests/<layer>/test_hostile_*.py``, ``tests/commands/test_cli_errors.py``).

The hostile tests live with the module they attack (docs/testing.md); what they share is here: a small
tp-2 artifact and the edits made to copies of it, the command line run in-process with the shape of its
error line (exit 2, one ``error:`` line, no ``Traceback``), and a deadline for calls that used to block.
Expectations stay written out in the tests (shard ranges, byte contents, field names), never
recomputed with the code under test.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save
from typer.testing import CliRunner

from trtvocab.artifact.recipe import parse_recipe
from trtvocab.commands.cli import app
from trtvocab.pipeline.build import build

V, H, TP = 101, 16, 2  # 101 = 51 + 50: rank 0 owns [0, 51), rank 1 [51, 101)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


# ---- a synthetic tp-2 artifact, and edits of its copies ----------------------------------------------------
def recipe_dict(out: Path, *, onnx: bool = True, **lm_head: Any) -> dict[str, Any]:
    return {"checkpoint": {"synthetic": {"vocab_size": V, "hidden_size": H, "seed": 3, "std": 0.5}},
            "mapping": {"tp_size": TP}, "lm_head": {"dtype": "float32", **lm_head},
            "output": {"dir": str(out), "onnx": onnx}}


def recipe_toml(path: Path, out: Path, *, onnx: bool = True) -> Path:
    path.write_text(f'[checkpoint.synthetic]\nvocab_size = {V}\nhidden_size = {H}\nseed = 3\nstd = 0.5\n'
                    f'[mapping]\ntp_size = {TP}\n[lm_head]\ndtype = "float32"\n'
                    f'[output]\ndir = "{out}"\nonnx = {"true" if onnx else "false"}\n')
    return path


def build_art(tmp_path_factory: pytest.TempPathFactory, name: str = "hostile") -> Path:
    """The artifact of :func:`recipe_dict` (ONNX graphs and fallback weights), for a module-scoped fixture."""
    out = tmp_path_factory.mktemp(name) / "art"
    root, manifest = build(parse_recipe(recipe_dict(out), f"{name}.toml"))
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


def set_field(path: str, value: Any) -> Any:
    """A manifest edit: the field at the dotted ``path`` (list items by index) set to ``value``."""
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


def both(*mutations: Any) -> Any:
    """The manifest edits ``mutations``, one after the other."""
    def mutate(m: dict[str, Any]) -> None:
        for f in mutations:
            f(m)
    return mutate


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def private_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_hidden(path: Path) -> Path:
    """A hidden-states file of two sequences (2 and 3 rows) for :data:`H`."""
    path.write_bytes(save({"hidden_states": torch.randn(5, H), "seq_lens": torch.tensor([2, 3], dtype=torch.int32)}))
    return path


def forbid_inference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the CLI runs inference: a refusal under test must come before it."""
    import trtvocab.pipeline.infer

    def ran(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("inference ran before the arguments were checked")

    monkeypatch.setattr(trtvocab.pipeline.infer, "infer", ran)


# ---- the command line, in this process -----------------------------------------------------------------------
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


# ---- calls that used to block ----------------------------------------------------------------------------------
class Hung(Exception):
    """Raised by :func:`deadline` in a call that did not return in time."""


@contextmanager
def deadline(seconds: float = 10.0) -> Iterator[None]:
    """Fail a blocked call (an ``open`` of a FIFO, a read of an endless file) after ``seconds``.

    SIGALRM interrupts the blocking system call and the handler raises :class:`Hung`; the
    timer that was running before (pytest-timeout's) is put back with its remaining time.
    """
    def on_alarm(signum: int, frame: Any) -> None:
        raise Hung(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if old_delay:
            left = max(old_delay - (time.monotonic() - started), 0.001)
            signal.setitimer(signal.ITIMER_REAL, left, old_interval)
