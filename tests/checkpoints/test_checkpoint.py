"""Checkpoint reading (docs/checkpoint_formats.md) on real safetensors files written by the tests."""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import trtvocab.base.safetensors_header as st_header
import trtvocab.checkpoints.checkpoint as ckpt_mod
from tests.conftest import model_config, peak_load, write_single
from trtvocab import LMHead, Mapping
from trtvocab.base import safe_read
from trtvocab.base.safetensors_header import read_safetensors_header
from trtvocab.checkpoints.checkpoint import Checkpoint
from trtvocab.errors import CheckpointError
from trtvocab.parallel.sharding import vocab_shard

V, H = 203, 24  # prime vocab: uneven shards at every tp


@pytest.fixture
def w(head_matrix: Callable[..., torch.Tensor]) -> torch.Tensor:
    return head_matrix(V, H)


def _others() -> dict[str, torch.Tensor]:
    return {"model.norm.weight": torch.ones(H), "model.layers.0.mlp.up_proj.weight": torch.randn(8, H)}


# ---- layouts on disk --------------------------------------------------------------------------------
def test_hf_dir_with_index_over_two_files(hf_checkpoint, w: torch.Tensor) -> None:
    tensors = {"model.embed_tokens.weight": torch.randn(V, H), "lm_head.weight": w, **_others()}
    path = hf_checkpoint(tensors, model_config(V, H, tie_word_embeddings=False))
    ckpt = Checkpoint(path)
    assert len(ckpt.files) == 2
    # the head and the embedding really live in different files (round-robin placement)
    assert ckpt.info("lm_head.weight").file != ckpt.info("model.embed_tokens.weight").file
    head = LMHead.from_checkpoint(path, dtype=torch.float32)
    assert (head.vocab_size, head.hidden_size) == (V, H)
    assert torch.equal(head.weights.weight, w)


def test_hf_dir_without_index(hf_checkpoint, w: torch.Tensor) -> None:
    path = hf_checkpoint({"lm_head.weight": w, **_others()}, model_config(V, H), index=False)
    assert torch.equal(LMHead.from_checkpoint(path, dtype=torch.float32).weights.weight, w)


def test_single_file(single_checkpoint, w: torch.Tensor) -> None:
    path = single_checkpoint({"lm_head.weight": w.to(torch.bfloat16)})
    head = LMHead.from_checkpoint(path)  # bf16 default
    assert head.dtype == torch.bfloat16 and torch.equal(head.weights.weight, w.to(torch.bfloat16))
    # a float32 head from a bf16 file converts exactly
    assert torch.equal(LMHead.from_checkpoint(path, dtype=torch.float32).weights.weight,
                       w.to(torch.bfloat16).float())


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "embeddings.word_embeddings.weight",
                                  "transformer.wte.weight"])
@pytest.mark.parametrize("config_says", [True, None])  # None: key absent, transformers' default is True
def test_tied_embeddings(hf_checkpoint, w: torch.Tensor, name: str, config_says: bool | None) -> None:
    config = model_config(V, H) if config_says is None else model_config(V, H, tie_word_embeddings=config_says)
    path = hf_checkpoint({name: w, **_others()}, config)
    head = LMHead.from_checkpoint(path, dtype=torch.float32)
    assert torch.equal(head.weights.weight, w)
    assert head.quant_decision.tensor_name == name and "tied" in head.quant_decision.reason


def test_user_given_tensor_name(hf_checkpoint, w: torch.Tensor) -> None:
    path = hf_checkpoint({"decoder.output_projection.weight": w, **_others()}, model_config(V, H))
    head = LMHead.from_checkpoint(path, dtype=torch.float32, tensor_name="decoder.output_projection.weight")
    assert torch.equal(head.weights.weight, w)
    with pytest.raises(CheckpointError, match=re.escape("no tensor 'decoder.nope.weight'")):
        LMHead.from_checkpoint(path, tensor_name="decoder.nope.weight")


def test_lm_head_preferred_over_embedding(hf_checkpoint, w: torch.Tensor) -> None:
    path = hf_checkpoint({"model.embed_tokens.weight": torch.zeros(V, H), "lm_head.weight": w},
                         model_config(V, H, tie_word_embeddings=True))
    assert torch.equal(LMHead.from_checkpoint(path, dtype=torch.float32).weights.weight, w)


def test_untied_config_without_lm_head_is_an_error(hf_checkpoint, w: torch.Tensor) -> None:
    path = hf_checkpoint({"model.embed_tokens.weight": w, **_others()},
                         model_config(V, H, tie_word_embeddings=False))
    with pytest.raises(CheckpointError, match="tie_word_embeddings=false"):
        LMHead.from_checkpoint(path)


# ---- header-only probes ---------------------------------------------------------------------------
def test_header_probe_reads_only_the_header(single_checkpoint, w: torch.Tensor) -> None:
    """Cut the file right after its header: every probe still works, a data read fails."""
    path = single_checkpoint({"lm_head.weight": w, "lm_head.weight_scale": torch.tensor(1.0)})
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
    os.truncate(path, 8 + length)
    ckpt = Checkpoint(path)
    assert ckpt.names() == ["lm_head.weight", "lm_head.weight_scale"]
    info = ckpt.info("lm_head.weight")
    assert (info.dtype, info.shape, info.nbytes) == ("F32", (V, H), V * H * 4)
    assert ckpt.lm_head_name() == ("lm_head.weight", False)
    header = read_safetensors_header(path, "safetensors file", CheckpointError)
    assert set(header) == {"lm_head.weight", "lm_head.weight_scale"}
    with pytest.raises(CheckpointError, match="truncated"):
        ckpt.get_slice("lm_head.weight")[0:2]


class _CountingOpen:
    """Stands in for ``open_regular`` where checkpoints read files and counts the bytes read."""

    def __init__(self) -> None:
        self.bytes_read = 0

    def __call__(self, *args, **kwargs):
        fh = safe_read.open_regular(*args, **kwargs)  # handed back to the caller's with-block
        counter = self

        class Wrapped:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                fh.close()

            def read(self, n=-1):
                data = fh.read(n)
                counter.bytes_read += len(data)
                return data

            def readinto(self, buf):
                got = fh.readinto(buf)
                counter.bytes_read += got or 0
                return got

            def fileno(self):
                return fh.fileno()

            def seek(self, *a):
                return fh.seek(*a)

        return Wrapped()


@pytest.mark.parametrize("layout", ["uneven", "padded"])
@pytest.mark.parametrize("tp", [3, 8])
def test_each_rank_loads_and_reads_only_its_rows(hf_checkpoint, w: torch.Tensor, monkeypatch, layout: str,
                                                 tp: int) -> None:
    path = hf_checkpoint({"lm_head.weight": w, **_others()}, model_config(V, H, tie_word_embeddings=False))
    header_bytes = sum(8 + struct.unpack("<Q", f.read_bytes()[:8])[0] for f in Checkpoint(path).files)
    for rank in range(tp):
        counter = _CountingOpen()
        monkeypatch.setattr(ckpt_mod, "open_regular", counter)
        monkeypatch.setattr(st_header, "open_regular", counter)
        head = LMHead.from_checkpoint(path, mapping=Mapping(world_size=tp, rank=rank, tp_size=tp),
                                      dtype=torch.float32, vocab_layout=layout, pad_to=4)
        monkeypatch.undo()
        shard = vocab_shard(V, tp, rank, layout, 4)
        assert (head.vocab_start, head.vocab_end) == (shard.start, shard.end)
        stored = head.weights.weight
        assert stored.shape == (shard.width, H)
        assert torch.equal(stored[: shard.size], w[shard.start : shard.end])
        assert torch.equal(stored[:, 0][: shard.size], torch.arange(shard.start, shard.end, dtype=torch.float32))
        assert not stored[shard.size :].any()  # padding rows are zero
        # headers (each read at most twice) + exactly this rank's rows, nothing else
        data = counter.bytes_read - header_bytes
        assert shard.size * H * 4 <= data <= shard.size * H * 4 + header_bytes, (rank, counter.bytes_read)




@pytest.mark.subprocess
def test_rank_peak_memory_stays_near_its_shard(tmp_path: Path) -> None:
    """A rank's RSS while loading its 1/8 of a 32000 x 1024 float32 head grows by ~1/8 of it.

    Measured in a fresh subprocess: RSS after imports vs the kernel's high-water mark
    (VmHWM, reset through /proc/self/clear_refs) after ``from_checkpoint``. The shard is
    0.125 of the matrix; allocator and Python overhead add a little; a loader that
    mapped or read the whole tensor would be at >= 1.0.
    """
    vocab, hidden, tp = 32000, 1024, 8
    full = torch.randn(vocab, hidden)
    path = write_single(tmp_path / "big.safetensors", {"lm_head.weight": full})
    full_bytes = full.numel() * 4
    del full
    for rank in (0, tp - 1):
        rec = peak_load(path, tp, rank)
        shard_bytes = full_bytes // tp
        assert rec["resident"] == shard_bytes
        ratio = rec["peak_delta"] / full_bytes
        assert ratio < 0.3, f"rank {rank}: peak RSS grew by {ratio:.3f} x the full matrix ({rec})"
        # DenseWeight adopts the rows it read instead of copying them into a second buffer
        assert rec["peak_delta"] < 1.5 * shard_bytes + 8 * 2**20, f"rank {rank}: two shard-sized buffers? {rec}"


def test_loading_never_aliases_a_callers_tensor(w: torch.Tensor) -> None:
    head = LMHead(V, H, dtype=torch.float32)
    assert not head.weights.weight.any()  # an unloaded head is all zeros
    shard_rows = w.clone()
    head.load_weights({"weight": shard_rows})
    shard_rows.zero_()
    assert torch.equal(head.weights.weight, w)


def test_adopted_rows_are_the_shard_only(single_checkpoint, w: torch.Tensor) -> None:
    """The buffer a lazy read hands over holds exactly the shard (no view into a bigger storage)."""
    path = single_checkpoint({"lm_head.weight": w})
    head = LMHead.from_checkpoint(path, mapping=Mapping(world_size=4, rank=2, tp_size=4), dtype=torch.float32)
    buf = head.weights.weight
    assert buf.untyped_storage().nbytes() == head.local_vocab_size * H * 4
    assert torch.equal(buf, w[head.vocab_start : head.vocab_end])


# ---- refusals and typed errors ------------------------------------------------------------------
def test_pickles_are_refused(tmp_path: Path, monkeypatch) -> None:
    def no_torch_load(*args, **kwargs):
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", no_torch_load)
    model = tmp_path / "pickled"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(model_config(V, H)))
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="pickles"):
        LMHead.from_checkpoint(model)
    with pytest.raises(CheckpointError, match=re.escape("only .safetensors")):
        LMHead.from_checkpoint(model / "pytorch_model.bin")
    pt = tmp_path / "head.pt"
    pt.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="pickles are never loaded"):
        Checkpoint(pt)


@pytest.mark.parametrize(("config", "match"), [
    (model_config(V + 1, H), f"has {V} rows but config.json vocab_size is {V + 1}"),
    (model_config(V, H + 8), f"hidden size {H} but config.json hidden_size is {H + 8}"),
    ({"text_config": {"vocab_size": V - 1, "hidden_size": H}}, "vocab_size"),  # multimodal configs nest it
])
def test_wrong_shape_against_config(hf_checkpoint, w: torch.Tensor, config: dict, match: str) -> None:
    path = hf_checkpoint({"lm_head.weight": w}, config)
    with pytest.raises(CheckpointError, match=match):
        LMHead.from_checkpoint(path)


def test_missing_tensors(hf_checkpoint, tmp_path: Path, w: torch.Tensor) -> None:
    path = hf_checkpoint(_others(), model_config(V, H), name="no_head")
    with pytest.raises(CheckpointError, match=re.escape("no 'lm_head.weight'")):
        LMHead.from_checkpoint(path)
    # the index names a shard file that is not there
    path = hf_checkpoint({"lm_head.weight": w, **_others()}, model_config(V, H), name="lost_shard")
    next(path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="do not exist"):
        LMHead.from_checkpoint(path)
    with pytest.raises(CheckpointError, match="no such file"):
        LMHead.from_checkpoint(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=re.escape("no .safetensors")):
        LMHead.from_checkpoint(empty)


def test_corrupt_files(tmp_path: Path, single_checkpoint, w: torch.Tensor) -> None:
    path = single_checkpoint({"lm_head.weight": w})
    data = path.read_bytes()
    (tmp_path / "short.safetensors").write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="shorter than 8 bytes"):
        Checkpoint(tmp_path / "short.safetensors")
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(CheckpointError, match="implausible"):
        Checkpoint(tmp_path / "huge.safetensors")
    (tmp_path / "notjson.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(CheckpointError, match="not JSON"):
        Checkpoint(tmp_path / "notjson.safetensors")
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated"):
        LMHead.from_checkpoint(tmp_path / "cut.safetensors")


def test_wrong_rank_of_tensor(single_checkpoint) -> None:
    path = single_checkpoint({"lm_head.weight": torch.randn(V)})
    with pytest.raises(CheckpointError, match="2-D"):
        LMHead.from_checkpoint(path)


def test_integer_tensor_is_not_read_as_dense(single_checkpoint) -> None:
    path = single_checkpoint({"lm_head.weight": torch.ones(V, H, dtype=torch.int32)})
    with pytest.raises(CheckpointError, match="dense LM head needs"):
        LMHead.from_checkpoint(path)
