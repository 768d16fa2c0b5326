"""`trtvocab plan` figures against the DeepSeek-V4.1-Flash accounting (issue 2, item 8)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from trtvocab.cli import app
from trtvocab.plan import make_plan
from trtvocab.units import human_bytes as human

MIB, GIB = 2**20, 2**30


def test_deepseek_figures() -> None:
    p = make_plan(129280, 5120, 8, 256)
    # Figures from the published accounting, to the digits it gives.
    assert round(p.full_weight_bytes["bf16"] / GIB, 2) == 1.23
    assert all(round(r.weight_bytes["bf16"] / MIB, 1) == 157.8 for r in p.ranks)
    assert round(p.gathered_logits_bytes["bf16"] / MIB, 1) == 63.1
    assert round(p.gathered_logits_bytes["fp32"] / MIB, 1) == 126.2
    assert all(round(r.local_logits_bytes["bf16"] / MIB, 1) == 7.9 for r in p.ranks)
    # Per-rank figures add up to the whole.
    assert sum(r.rows for r in p.ranks) == 129280
    assert sum(r.local_logits_bytes["fp32"] for r in p.ranks) == p.gathered_logits_bytes["fp32"]


def test_quantized_bytes_ratios() -> None:
    p = make_plan(129280, 5120, 8, 1)
    w = p.full_weight_bytes
    assert w["fp8"] / w["bf16"] == pytest.approx(0.5, abs=1e-6)
    # 4 bits per value + one 8-bit scale per 16 values = 4.5 bits of 16.
    assert w["nvfp4"] / w["bf16"] == pytest.approx(4.5 / 16, abs=1e-6)


def test_uneven_allgather_pads_to_largest_shard() -> None:
    p = make_plan(10, 16, 3, 2)
    assert [r.rows for r in p.ranks] == [4, 3, 3]
    # every rank sends a piece as wide as the largest shard (gloo needs equal shapes)
    assert {r.allgather_send_bytes["bf16"] for r in p.ranks} == {2 * 4 * 2}
    assert p.ranks[1].allgather_recv_bytes["bf16"] == 2 * (2 * 4 * 2)


def test_human_units() -> None:
    assert human(1323827200) == "1.23 GiB"
    assert human(165478400) == "157.8 MiB"
    assert human(512) == "512 B"


def test_cli_plan_table_and_json() -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["plan", "--vocab", "129280", "--hidden", "5120", "--tp", "8", "--batch", "256"])
    assert res.exit_code == 0, res.output
    for figure in ("157.8 MiB", "1.23 GiB", "63.1 MiB", "126.2 MiB", "7.9 MiB"):
        assert figure in res.output
    res = runner.invoke(app, ["plan", "--vocab", "1000", "--hidden", "64", "--tp", "3", "--json"])
    data = json.loads(res.output)
    assert [r["rows"] for r in data["ranks"]] == [334, 333, 333]


def test_cli_plan_checkpoint(tmp_path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"lm_head.weight": torch.zeros(1001, 32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1001, "hidden_size": 32}))
    res = CliRunner().invoke(app, ["plan", str(tmp_path), "--tp", "4", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert (data["vocab_size"], data["hidden_size"]) == (1001, 32)
    assert [r["rows"] for r in data["ranks"]] == [251, 250, 250, 250]


def test_cli_plan_needs_shape() -> None:
    res = CliRunner().invoke(app, ["plan", "--tp", "2"])
    assert res.exit_code != 0
