"""`generate --lora`: greedy decoding with a PEFT adapter on SmolLM2's embedding and head equals PEFT's own
greedy tokens, in one batch where one prompt uses the adapter and the other none (PEFT's adapter_names)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from trtvocab.commands.cli import app
from trtvocab.errors import AdapterError, ConfigError
from trtvocab.pipeline import generate as G

K = 6
PROMPTS = ["The capital of France is", "def add(a, b):"]


@pytest.fixture(scope="module")
def adapter_run(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    peft = pytest.importorskip("peft")
    loaded = G.load_model(smollm2)
    model = peft.get_peft_model(copy.deepcopy(loaded.model),
                                peft.LoraConfig(target_modules=["lm_head", "embed_tokens"], r=4, lora_alpha=8),
                                adapter_name="one")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name or "lora_embedding_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    folder = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(folder, save_embedding_layers=False)
    tok = loaded.tokenizer
    enc = tok(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    with torch.no_grad():
        out = model.eval().generate(**enc, do_sample=False, max_new_tokens=K, adapter_names=["one", "__base__"])
    eos = loaded.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    reference = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        reference.append(row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))])
    with torch.no_grad():
        plain = loaded.model.generate(**enc, do_sample=False, max_new_tokens=K)
    return {"folder": folder / "one", "reference": reference, "loaded": loaded, "model": smollm2,
            "plain": plain[0, enc["input_ids"].shape[1]:].tolist()}


@pytest.mark.model
def test_greedy_with_an_adapter_equals_peft_at_tp_1_and_2(adapter_run: dict[str, Any]) -> None:
    assert adapter_run["reference"][0] != adapter_run["plain"][: len(adapter_run["reference"][0])]  # it matters
    for tp in (1, 2):
        spec, _ = G.prepare(adapter_run["model"], PROMPTS, tp=tp, max_new_tokens=K,
                            loras={"one": adapter_run["folder"]}, lora_for={0: "one"})
        report = G.generate(spec, adapter_run["loaded"])
        assert [r.token_ids for r in report.results] == adapter_run["reference"], tp


@pytest.mark.model
def test_cli_lora_flags(adapter_run: dict[str, Any]) -> None:
    result = CliRunner().invoke(app, ["generate", str(adapter_run["model"]), "--prompt", PROMPTS[0], "--prompt",
                                      PROMPTS[1], "--max-new-tokens", str(K), "--lora", f"one={adapter_run['folder']}",
                                      "--lora-for", "0", "--json"])
    assert result.exit_code == 0, result.output
    rows = [r["token_ids"] for r in json.loads(result.stdout)["results"]]
    assert rows == adapter_run["reference"]


def test_lora_plan_refusals(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"artifact": None, "attention_dp": False, "deterministic": False}
    with pytest.raises(ConfigError, match="expected NAME=DIR"):
        G.lora_plan(["one"], None, 2, **kw)
    with pytest.raises(ConfigError, match="give the adapters with `loras`"):
        G.lora_plan(None, ["0"], 2, **kw)
    with pytest.raises(AdapterError, match="not a PEFT adapter folder"):
        G.lora_plan([f"one={tmp_path}"], None, 2, **kw)
    with pytest.raises(ConfigError, match="built without adapters"):
        G.lora_plan([f"one={tmp_path}"], None, 2, **{**kw, "artifact": "x"})
    with pytest.raises(ConfigError, match="`attention_dp`"):
        G.lora_plan([f"one={tmp_path}"], None, 2, **{**kw, "attention_dp": True})
    assert G.lora_plan(None, None, 2, **kw) == ((), ())


@pytest.mark.parametrize("lora_for", [["0=one", "0=one"], ["1", "+1=one"], ["0=one", " 0=one"]])
def test_lora_plan_refuses_a_prompt_index_given_twice(tmp_path: Path, lora_for: list[str]) -> None:
    """API callers get the command line's refusal: one adapter per prompt (the last would win without a word),
    before any adapter folder is read."""
    kw: dict[str, Any] = {"artifact": None, "attention_dp": False, "deterministic": False}
    with pytest.raises(ConfigError, match=r"`lora_for`: prompt index \d is given twice"):
        G.lora_plan([f"one={tmp_path}"], lora_for, 2, **kw)
    with pytest.raises(ConfigError, match=r"`lora_for`: prompt index \d is given twice"):
        G.GenerateOptions(prompts=("a", "b"), loras=[f"one={tmp_path}"], lora_for=lora_for)
