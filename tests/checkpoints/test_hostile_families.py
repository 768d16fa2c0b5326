"""Hostile family fields (``trtvocab/checkpoints/families.py``): ``0``, ``False`` and ``True`` in
``config.json`` or in GGUF metadata are values, not "absent" -- a softcap, scale or multiplier that would
squash or zero the logits is an ArchitectureError naming the field; only ``None`` (or no key) is absent, and
neutral values load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.weights.hostile_files import dense_checkpoint, write_blocks_gguf
from trtvocab import ArchitectureError, LMHead, VocabParallelEmbedding


@pytest.mark.parametrize(("model_type", "field"), [
    ("gemma2", "final_logit_softcapping"), ("cohere", "logit_scale"), ("granite", "logits_scaling"),
    ("hyperclovax", "logits_scaling"), ("falcon_h1", "lm_head_multiplier"), ("minicpm3", "scale_emb"),
    ("my_new_arch", "logit_scale"), ("my_new_arch", "final_logit_softcapping"),
])
@pytest.mark.parametrize("value", [0, 0.0, -0.0, False, True])
def test_m1_zero_false_and_true_are_values_not_absent(tmp_path: Path, model_type: str, field: str,
                                                      value: Any) -> None:
    path = dense_checkpoint(tmp_path / "m", model_type=model_type, **{field: value})
    with pytest.raises(ArchitectureError, match=field):
        LMHead.from_checkpoint(path, dtype=torch.float32)
        VocabParallelEmbedding.from_checkpoint(path, dtype=torch.float32)  # minicpm3: the embedding's field


def test_m1_neutral_values_still_load(tmp_path: Path) -> None:
    path = dense_checkpoint(tmp_path / "n", model_type="my_new_arch", logits_scaling=1.0, logit_scale=1,
                            scale_embedding=False, final_logit_softcapping=None)
    assert LMHead.from_checkpoint(path, dtype=torch.float32).head_ops.is_identity
    with pytest.raises(ArchitectureError, match="final_logit_softcapping"):  # a cap of 1 squashes the logits
        LMHead.from_checkpoint(dense_checkpoint(tmp_path / "c", model_type="my_new_arch", final_logit_softcapping=1.0),
                               dtype=torch.float32)
    with pytest.raises(ArchitectureError, match="scale_embedding"):
        VocabParallelEmbedding.from_checkpoint(dense_checkpoint(tmp_path / "x", model_type="xglm", scale_embedding=1),
                                               dtype=torch.float32)


@pytest.mark.parametrize(("arch", "key", "kind", "value"), [
    ("gemma2", "final_logit_softcapping", "float32", 0.0), ("gemma2", "final_logit_softcapping", "float32", -0.0),
    ("gemma2", "final_logit_softcapping", "uint32", 0), ("gemma2", "final_logit_softcapping", "bool", False),
    ("command-r", "logit_scale", "float32", 0.0), ("granite", "logit_scale", "bool", False),
    ("newarch", "logit_scale", "bool", True),
])
def test_m1_gguf_metadata_zero_and_false_are_refused(tmp_path: Path, arch: str, key: str, kind: str,
                                                     value: Any) -> None:
    path = write_blocks_gguf(tmp_path / "f.gguf", "Q8_0", arch=arch, meta={key: (kind, value)})
    with pytest.raises(ArchitectureError, match=rf"{path.name} .*{arch}\.{key}"):
        LMHead.from_checkpoint(path, dtype=torch.float32)
