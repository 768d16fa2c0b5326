"""Hostile dense weights (``trtvocab/weights/dense.py``, and the load check every strategy shares in
``trtvocab/weights/base.py``): a NaN / inf row, in a state dict or a checkpoint, and a float32 value that
overflows a float16 head are refused naming the token id (and the rank's row); a meta tensor is a
CheckpointError.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import model_config, write_hf_dir
from tests.hostile import H, V
from trtvocab import LMHead
from trtvocab.errors import CheckpointError
from trtvocab.quant.gguf_blocks import GGUFConfig


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


def test_inf_in_a_checkpoint_is_refused(tmp_path: Path) -> None:
    from trtvocab import LMHead

    w = torch.randn(V, H)
    w[7] = float("inf")
    ckpt = write_hf_dir(tmp_path / "m", {"lm_head.weight": w}, model_config(V, H), n_files=1)
    with pytest.raises(CheckpointError, match="row 7"):
        LMHead.from_checkpoint(ckpt, dtype=torch.float32)


def test_h2_a_float32_checkpoint_that_overflows_a_float16_head_is_refused(tmp_path: Path) -> None:
    w = torch.randn(64, 32)
    w[11, 3] = 1e5  # finite in float32, inf in float16
    head = LMHead(64, 32, dtype=torch.float16)
    with pytest.raises(CheckpointError, match=r"row 11 .*once cast from torch.float32 to the head's torch.float16"):
        head.load_weights({"weight": w})


@pytest.mark.parametrize("config", [GGUFConfig(block_type="Q8_0"), None])
def test_low_a_meta_tensor_is_a_checkpoint_error(config: GGUFConfig | None) -> None:
    head = LMHead(64, 64, dtype=torch.float32, quant_config=config)
    dtype = torch.uint8 if config is not None else torch.float32
    width = 68 if config is not None else 64
    with pytest.raises(CheckpointError, match="meta tensor"):
        head.load_weights({"weight": torch.empty(64, width, dtype=dtype, device="meta")})
