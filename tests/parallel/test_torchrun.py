"""The head and `trtvocab infer` under torchrun (RANK / WORLD_SIZE from the environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trtvocab.parallel.launch import free_port

pytestmark = [pytest.mark.ranks, pytest.mark.subprocess]  # every test here (docs/testing.md)

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from trtvocab import LMHead, LogitsProcessor, Mapping
    from trtvocab.parallel.distributed import init_from_env

    rank, world = init_from_env(timeout_s=60)
    torch.manual_seed(0)
    w = torch.randn(1001, 32, dtype=torch.float64)
    x = torch.randn(7, 32, dtype=torch.float64)
    head = LMHead(1001, 32, dtype=torch.float32, mapping=Mapping(world_size=world, rank=rank, tp_size=world))
    head.load_weights({"weight": w.float()})
    logits = LogitsProcessor()(x.float(), head, seq_lens=[3, 4])
    want = x[[2, 6]] @ w.T
    err = (logits.double() - want).abs().max().item()
    single = ((x[[2, 6]].float() @ w.float().T).double() - want).abs().max().item()
    result = {"rank": rank, "world": world, "start": head.vocab_start, "end": head.vocab_end,
              "shape": list(logits.shape), "err": err, "single": single,
              "argmax_ok": bool(torch.equal(logits.argmax(-1), want.argmax(-1)))}
    open(f"rank{rank}.json", "w").write(json.dumps(result))
    torch.distributed.destroy_process_group()
    """
)


def _torchrun(args: list[str], tmp_path: Path, nproc: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "--master-addr=127.0.0.1", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def test_head_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    res = _torchrun([str(script)], tmp_path, 3)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["rank"] for r in rows] == [0, 1, 2] and all(r["world"] == 3 for r in rows)
    assert [(r["start"], r["end"]) for r in rows] == [(0, 334), (334, 668), (668, 1001)]
    for r in rows:
        assert r["shape"] == [2, 1001] and r["argmax_ok"]
        assert r["err"] <= 2 * r["single"] + 1e-5


def test_cli_infer_under_torchrun(tmp_path: Path) -> None:
    from trtvocab.artifact.recipe import parse_recipe
    from trtvocab.checkpoints.hidden_file import save_hidden
    from trtvocab.pipeline.build import build

    out = tmp_path / "art"
    build(parse_recipe({"checkpoint": {"synthetic": {"vocab_size": 501, "hidden_size": 16, "seed": 3}},
                        "mapping": {"tp_size": 2}, "lm_head": {"dtype": "float32"}, "output": {"dir": str(out)}}))
    save_hidden(tmp_path / "h.safetensors", torch.randn(4, 16), torch.tensor([1, 3], dtype=torch.int32))
    cli = Path(sys.executable).with_name("trtvocab")
    if not cli.exists():
        pytest.skip("trtvocab console script not installed next to this python")
    res = _torchrun(["--no-python", str(cli), "infer", str(out), "--hidden", str(tmp_path / "h.safetensors"),
                     "--backend", "torch", "--out", str(tmp_path / "l.safetensors")], tmp_path, 2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("backend: torch") == 1  # only rank 0 prints
    from safetensors.torch import load_file

    from trtvocab.pipeline.infer import infer

    got = load_file(str(tmp_path / "l.safetensors"))["logits"]
    want, _, _ = infer(out, load_file(str(tmp_path / "h.safetensors"))["hidden_states"], torch.tensor([1, 3]), "torch")
    torch.testing.assert_close(got, want)
    res = _torchrun(["--no-python", str(cli), "infer", str(out), "--hidden", str(tmp_path / "h.safetensors")],
                    tmp_path, 3)
    assert res.returncode != 0 and "built for tp 2, but torchrun started 3 processes" in res.stderr + res.stdout
