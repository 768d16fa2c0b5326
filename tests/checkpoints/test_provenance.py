"""An artifact knows which checkpoint it was built from, and `generate` refuses another one's.

An artifact built from another checkpoint of the same shape (a synthetic 49152 x 576 head next to
SmolLM2) must not decode: the manifest records the head's digest
(:func:`trtvocab.checkpoints.provenance.head_digest`) and `generate` compares it with the model's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trtvocab.checkpoints.provenance import head_digest
from trtvocab.commands.cli import app
from trtvocab.errors import ArtifactError, CheckpointError

pytestmark = pytest.mark.model  # every test here (docs/testing.md)


def _build(recipe: dict, out: Path) -> Path:
    from trtvocab.artifact.recipe import parse_recipe
    from trtvocab.pipeline.build import build

    build(parse_recipe({**recipe, "output": {"onnx": False}}, "r.toml"), out)
    return out


def test_digest_is_the_stored_head_and_changes_with_one_byte(smollm2: Path, tmp_path: Path) -> None:
    from trtvocab.checkpoints.checkpoint import open_checkpoint

    digest = head_digest(smollm2)
    assert len(digest) == 64 and head_digest(smollm2) == digest
    copy = tmp_path / smollm2.name
    shutil.copyfile(smollm2, copy)
    assert head_digest(copy) == digest  # the bytes, not the path
    info = open_checkpoint(copy).info(open_checkpoint(copy).lm_head_name()[0])
    with copy.open("r+b") as fh:  # flip one byte inside the head's data
        fh.seek(info.offset + info.nbytes // 2)
        byte = fh.read(1)
        fh.seek(info.offset + info.nbytes // 2)
        fh.write(bytes([byte[0] ^ 0x01]))
    assert head_digest(copy) != digest
    with pytest.raises(CheckpointError, match="no tensor"):
        head_digest(smollm2, "no.such.tensor")


def test_generate_refuses_an_artifact_of_another_checkpoint(smollm2: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from trtvocab.artifact import store as artifacts
    from trtvocab.pipeline.generate import artifact_spec

    real = _build({"checkpoint": {"path": str(smollm2)}, "lm_head": {"dtype": "float32"}}, tmp_path / "real")
    assert artifacts.read_manifest(real).checkpoint_sha256 == head_digest(smollm2)
    assert artifact_spec(real, "torch", smollm2, None).note is None  # its own model: accepted
    fake = _build({"checkpoint": {"synthetic": {"vocab_size": 49152, "hidden_size": 576}},
                   "lm_head": {"dtype": "float32"}}, tmp_path / "fake")  # SmolLM2's shape, other weights
    assert artifacts.read_manifest(fake).checkpoint_sha256 is None
    with pytest.raises(ArtifactError, match=r"built from synthetic weights.*`allow_other_checkpoint`"):
        artifact_spec(fake, "torch", smollm2, None)
    allowed = artifact_spec(fake, "torch", smollm2, None, allow_other_checkpoint=True)
    assert allowed.note is not None and "WARNING" in allowed.note
    # Another real checkpoint of the same shape: SmolLM2 with one byte of its head changed.
    other = tmp_path / "other.gguf"
    shutil.copyfile(smollm2, other)
    from trtvocab.checkpoints.checkpoint import open_checkpoint

    ck = open_checkpoint(other)
    info = ck.info(ck.lm_head_name()[0])
    with other.open("r+b") as fh:
        fh.seek(info.offset + 7)
        byte = fh.read(1)
        fh.seek(info.offset + 7)
        fh.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ArtifactError, match=r"another checkpoint .*head sha256"):
        artifact_spec(real, "torch", other, None)
    res = CliRunner().invoke(app, ["generate", str(smollm2), "--prompt", "Hi", "--max-new-tokens", "1",
                                   "--artifact", str(fake)])
    assert res.exit_code != 0 and "synthetic weights" in res.output and "Traceback" not in res.output
