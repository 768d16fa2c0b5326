"""Hostile GGUF heads kept in their blocks (``trtvocab/weights/gguf.py``, ``trtvocab/quant/gguf_blocks.py``):
a NaN / inf fp16 block scale is refused at load naming the file, the tensor, the token and the scale (on
every rank of a tp 2 group, and by ``build`` before anything is published); finite extremes load as stored;
a bad ``GGUFConfig`` is a ConfigError, an integer bias a CheckpointError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tests.hostile import assert_cli_error, cli, deadline
from tests.weights.hostile_files import BAD_TOKEN, V, write_blocks_gguf
from trtvocab import CheckpointError, LMHead, Mapping, VocabParallelEmbedding
from trtvocab.errors import ConfigError
from trtvocab.quant.gguf_blocks import GGUFConfig

Q = gguf.GGMLQuantizationType
SCALES = {"Q8_0": (("d", 0),), "Q4_0": (("d", 0),), "Q5_0": (("d", 0),), "Q4_1": (("d", 0), ("m", 2)),
          "Q6_K": (("d", 208),), "Q4_K": (("d", 0), ("dmin", 2))}
SCALE_CASES = [(bt, name, at) for bt, scales in SCALES.items() for name, at in scales]
NAN, INF = 0x7E00, 0x7C00  # fp16 NaN, +inf


# ==== a non-finite block scale ================================================================================
@pytest.mark.parametrize(("block_type", "name", "at"), SCALE_CASES)
@pytest.mark.parametrize("bits", [NAN, INF, 0xFC00])
def test_h1_a_nonfinite_block_scale_is_refused_at_load_naming_file_tensor_token(
        tmp_path: Path, block_type: str, name: str, at: int, bits: int) -> None:
    path = write_blocks_gguf(tmp_path / "bad.gguf", block_type, bad=(at, bits))
    for mapping in (None, Mapping(world_size=2, rank=1, tp_size=2)):  # tp 1, and the rank owning the token
        with pytest.raises(CheckpointError) as err:
            LMHead.from_checkpoint(path, dtype=torch.float32, mapping=mapping)
        text = str(err.value)
        assert str(path) in text and "token_embd.weight" in text and f"token {BAD_TOKEN}," in text, text
        assert f"{block_type} fp16 block scale {name} is" in text, text
    # the embedding keeps the same blocks: the same refusal
    with pytest.raises(CheckpointError, match=f"token {BAD_TOKEN},"):
        VocabParallelEmbedding.from_checkpoint(path, dtype=torch.float32)
    # rank 0 at tp 2 does not hold the token: it loads (its peers refuse; see the tp 2 test)
    LMHead.from_checkpoint(path, dtype=torch.float32, mapping=Mapping(world_size=2, rank=0, tp_size=2))


def test_h1_dequantized_gguf_heads_name_the_file_too(tmp_path: Path) -> None:
    path = write_blocks_gguf(tmp_path / "bad.gguf", "Q8_0", bad=(0, NAN))
    with pytest.raises(CheckpointError, match=rf"{path.name}: token_embd.weight: row {BAD_TOKEN} .*NaN or inf"):
        LMHead.from_checkpoint(path, dtype=torch.float32, gguf_blocks=False)


def test_h1_finite_scale_extremes_still_load_and_match_gguf(tmp_path: Path) -> None:
    for bits in (0x7BFF, 0xFBFF, 0x0001, 0x8000):  # +-65504, a subnormal, -0: finite, kept as stored
        path = write_blocks_gguf(tmp_path / f"ok{bits}.gguf", "Q8_0", bad=(0, bits))
        head = LMHead.from_checkpoint(path, dtype=torch.float32)
        x = torch.randn(3, 64)
        raw = head.weights.blocks.numpy()
        w = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q8_0).astype(np.float64))
        bound = (x.double().abs() @ w.abs().t()) * 2.0**-18  # float32 summation order only
        assert bool(((head(x).double() - x.double() @ w.t()).abs() <= bound).all()), bits


def test_h1_api_rows_of_blocks_are_checked_too() -> None:
    raw = torch.from_numpy(gguf.quants.quantize(np.ones((V, 64), np.float32), Q.Q4_1))
    raw[7, 2:4] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # m = +inf
    head = LMHead(V, 64, dtype=torch.float32, quant_config=GGUFConfig(block_type="Q4_1"))
    with pytest.raises(CheckpointError, match=r"weight: token 7, block 0 \(values \[0, 32\)\): the Q4_1 .* m is inf"):
        head.load_weights({"weight": raw})


def _rank_load(rank: int, world: int, path: str) -> str:
    try:
        LMHead.from_checkpoint(path, dtype=torch.float32, mapping=Mapping(world_size=world, rank=rank, tp_size=world))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


@pytest.mark.ranks
def test_h1_a_bad_scale_in_one_rank_shard_stops_every_rank_tp2(tmp_path: Path, launch_ranks: Any) -> None:
    path = write_blocks_gguf(tmp_path / "bad.gguf", "Q6_K", bad=(208, NAN))
    with deadline(60):
        out = launch_ranks(_rank_load, 2, str(path), timeout_s=30)
    assert out[1].startswith("CheckpointError") and f"token {BAD_TOKEN}," in out[1], out
    assert out[0].startswith("PeerRankError"), out


def _recipe(path: Path, checkpoint: Path, onnx: bool) -> Path:
    path.write_text(f'name = "nan"\n[checkpoint]\npath = "{checkpoint}"\n[mapping]\ntp_size = 2\n'
                    '[lm_head]\ndtype = "float32"\ngguf_blocks = true\n'
                    '[profile]\nmin_tokens = 1\nopt_tokens = 4\nmax_tokens = 16\nmin_batch = 1\nopt_batch = 2\n'
                    f'max_batch = 4\n[output]\nonnx = {"true" if onnx else "false"}\n')
    return path


@pytest.mark.parametrize(("block_type", "onnx"), [("Q8_0", False), ("Q6_K", False), ("Q4_K", False),
                                                  ("Q8_0", True)])
def test_h1_cli_build_refuses_a_nan_scale_and_publishes_nothing(tmp_path: Path, block_type: str,
                                                                onnx: bool) -> None:
    at = SCALES[block_type][0][1]
    model = write_blocks_gguf(tmp_path / "nan.gguf", block_type, bad=(at, NAN))
    out = tmp_path / "art"
    code, text = cli("build", str(_recipe(tmp_path / "nan.toml", model, onnx)), "--out", str(out))
    assert_cli_error(code, text, "CheckpointError", "token_embd.weight", f"token {BAD_TOKEN},", "block scale d")
    assert "tolerance nan" not in text
    assert not out.exists()


# ==== the config and the bias =================================================================================
@pytest.mark.parametrize("kwargs", [{"block_type": "Q5_1"}, {"block_type": "q8_0"},
                                    {"block_type": "Q8_0", "extra": 1}, {"block_type": "Q8_0", "activation": "fp8"}])
def test_low_gguf_config_errors_are_config_errors(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match=r"GGUFConfig: (block_type|extra|activation)"):
        GGUFConfig(**kwargs)


def test_low_an_int32_gguf_bias_is_refused(tmp_path: Path) -> None:
    path = write_blocks_gguf(tmp_path / "b.gguf", "Q8_0", arch="phi2", bias=np.arange(V, dtype=np.int32))
    with pytest.raises(CheckpointError, match=r"b.gguf: lm_head.bias: the head's bias is stored as torch.int32"):
        LMHead.from_checkpoint(path, dtype=torch.float32)
