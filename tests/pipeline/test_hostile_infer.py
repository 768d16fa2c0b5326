"""What ``infer`` refuses (``trtvocab/pipeline/infer.py``): a manifest edited consistently everywhere still
disagrees with its ONNX graph; finite hidden rows whose logits overflow float32 are an error naming the row
in ``infer`` and ``compare``, not inf / nan printed with exit 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.hostile import H, assert_cli_error, both, build_art, cli, copy_art, edit_manifest, set_field
from tests.weights.hostile_files import dense_checkpoint
from trtvocab.errors import ArtifactError, RankFailures


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_art(tmp_path_factory)


@pytest.mark.ranks  # infer on the tp 2 artifact launches the ranks itself
def test_context_logits_edited_everywhere_is_caught_by_the_graph(art: Path, tmp_path: Path) -> None:
    from trtvocab.pipeline.infer import infer

    root = copy_art(art, tmp_path / "c")
    edit_manifest(root, both(set_field("head.context_logits", True), set_field("recipe.lm_head.context_logits", True)))
    with pytest.raises((ArtifactError, RankFailures)) as info:
        infer(root, torch.randn(4, H), torch.tensor([1, 3]), "onnx")
    text = str(info.value)
    assert "lm_head.onnx" in text and "context_logits" in text


def test_rule_infer_and_compare_refuse_logits_that_overflow_instead_of_printing_them(tmp_path: Path) -> None:
    """Finite hidden rows of 3e38 times finite weights overflow float32: ``infer`` and ``compare`` exit 2
    naming the row instead of printing ``inf`` / ``nan`` with exit 0."""
    recipe = tmp_path / "r.toml"
    recipe.write_text('[checkpoint.synthetic]\nvocab_size = 64\nhidden_size = 32\nseed = 3\nstd = 0.5\n'
                      '[mapping]\ntp_size = 1\n[lm_head]\ndtype = "float32"\n[output]\nonnx = false\n')
    art = tmp_path / "art"
    code, text = cli("build", str(recipe), "--out", str(art))
    assert code == 0, text
    hidden = torch.randn(4, 32)
    hidden[3] = 3e38  # finite; the last row: infer's one output row, compare's row 3
    save_file({"hidden_states": hidden}, str(tmp_path / "h.safetensors"))
    code, text = cli("infer", str(art), "--hidden", str(tmp_path / "h.safetensors"), "--backend", "torch")
    assert_cli_error(code, text, "InputError", "output row 0", "overflow float32")
    code, text = cli("compare", str(dense_checkpoint(tmp_path / "ck")), "--hidden", str(tmp_path / "h.safetensors"),
                     "--bootstrap", "0", "--simulate", "fp8")
    assert_cli_error(code, text, "InputError", "row 3", "overflow float32")
