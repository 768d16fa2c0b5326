"""`LMHead.load_weights` takes real safetensors slices (docs/contract.md §2), scalars included."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trtvocab import LMHead, Mapping, QuantAlgo, QuantConfig
from trtvocab.quant.writer import quantize_head_tensors

V, H = 301, 64


@pytest.mark.parametrize("config", [None, QuantConfig(quant_algo=QuantAlgo.FP8, activation="static"),
                                    QuantConfig(quant_algo=QuantAlgo.NVFP4, activation="static")],
                         ids=["dense", "fp8", "nvfp4"])
def test_safetensors_slices_equal_tensors(tmp_path, config) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=gen)
    tensors = {"weight": weight} if config is None else quantize_head_tensors(weight, config, input_amax=4.0)
    save_file({f"lm_head.{k}": v.contiguous() for k, v in tensors.items()}, str(tmp_path / "m.safetensors"))
    x = torch.randn(5, H, generator=gen)
    for rank in range(3):  # uneven: 101, 100, 100 rows
        mapping = Mapping(world_size=3, rank=rank, tp_size=3)
        from_tensors = LMHead(V, H, dtype=torch.float32, mapping=mapping, quant_config=config)
        from_tensors.load_weights({f"lm_head.{k}": v for k, v in tensors.items()})
        from_slices = LMHead(V, H, dtype=torch.float32, mapping=mapping, quant_config=config)
        with safe_open(str(tmp_path / "m.safetensors"), "pt") as fh:
            from_slices.load_weights({name: fh.get_slice(name) for name in fh.keys()})
        a = from_tensors.local_logits(x)
        b = from_slices.local_logits(x)
        assert a.shape == (5, from_tensors.local_vocab_size)
        assert torch.equal(a, b)
