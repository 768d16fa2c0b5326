"""compressed-tensors (llm-compressor / vLLM) checkpoints: the head and the embedding.

Every checkpoint here is written by the compressed-tensors library itself (tests/quant/ct_writer.py:
its apply / calibrate / compress / update_config API on CPU); the reference for every value is
the library's own ``decompress`` (not transformers, which fails on mixed NVFP4-head +
FP8-embedding files and on NVFP4 embeddings).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("compressed_tensors")
from tests.quant import ct_writer as ctw
from trtvocab import LMHead, Mapping, VocabParallelEmbedding
from trtvocab.base.formats import Activation, Granularity, WeightFormat
from trtvocab.checkpoints.checkpoint import open_checkpoint
from trtvocab.embedding import load_tied
from trtvocab.errors import CheckpointError, QuantizationError
from trtvocab.quant.compressed_tensors import DecompressedRows, decompress_nvfp4
from trtvocab.quant.config import QuantAlgo, resolve_lm_head_quant
from trtvocab.weights.loader import open_embedding, open_head

V, H = 263, 64  # prime vocab: uneven tp 3 shards, padding at tp 4
SMOLLM2_V, SMOLLM2_H = 49152, 576
HEAD_CLS, EMBED_CLS = ("Linear",), ("Embedding",)
# preset -> (algo, activation the head runs with, granularity, notice expected)
EXPECTED = {
    "FP8": (QuantAlgo.FP8, Activation.STATIC, Granularity.PER_TENSOR, False),
    "FP8_TENSOR_DYNAMIC": (QuantAlgo.FP8, Activation.DYNAMIC, Granularity.PER_TENSOR, False),
    "FP8_DYNAMIC": (QuantAlgo.FP8, Activation.NONE, Granularity.PER_ROW, True),  # per-token: weight-only
    "FP8_W8A16_TENSOR": (QuantAlgo.FP8, Activation.NONE, Granularity.PER_TENSOR, False),
    "FP8_W8A16_CHANNEL": (QuantAlgo.FP8, Activation.NONE, Granularity.PER_ROW, False),
    "NVFP4": (QuantAlgo.NVFP4, Activation.STATIC, Granularity.PER_TENSOR, False),
    "NVFP4A16": (QuantAlgo.NVFP4, Activation.NONE, Granularity.PER_TENSOR, False),
}
PRESETS = list(EXPECTED)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def format_of(preset: str) -> WeightFormat:
    return WeightFormat.NVFP4 if preset.startswith("NVFP4") else WeightFormat.FP8


def hidden(n: int = 5, h: int = H, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, h, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.fixture(scope="module")
def ct_dir(tmp_path_factory: pytest.TempPathFactory):
    """preset -> a mixed file: the head and the embedding both quantized with ``preset`` (cached)."""
    root = tmp_path_factory.mktemp("ct")
    cache: dict[str, Path] = {}

    def make(preset: str) -> Path:
        if preset not in cache:
            cache[preset] = ctw.write_ct(root / preset, V, H, head=preset, embed=preset, seed=3)
        return cache[preset]

    return make


def quiet_head(path: Path, **kw) -> LMHead:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LMHead.from_checkpoint(path, **kw)


# ---- reading: the gating verdict -----------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_verdict_per_preset(ct_dir, preset: str) -> None:
    path = ct_dir(preset)
    decision = resolve_lm_head_quant(path)
    algo, activation, granularity, notice = EXPECTED[preset]
    assert decision.checkpoint_format == "compressed-tensors" and not decision.dequantize and not decision.tied
    assert decision.config is not None and decision.config.quant_algo is algo
    assert decision.stored is format_of(preset) and decision.config.weight_format is decision.stored
    assert decision.config.activation is activation and decision.config.granularity is granularity
    assert decision.tensor_name == ("lm_head.weight_packed" if algo is QuantAlgo.NVFP4 else "lm_head.weight")
    assert "config_groups['group_1'] (target 'lm_head')" in decision.reason
    assert (decision.notice is not None) == notice
    if notice:
        assert "per token" in decision.notice and "weight-only (W8A16)" in decision.notice
        with pytest.warns(UserWarning, match="weight-only"):
            LMHead.from_checkpoint(path)
    weight_only = resolve_lm_head_quant(path, weight_only=True)
    assert weight_only.config.activation is Activation.NONE and weight_only.notice is None
    source = open_head(path)
    assert (source.vocab_size, source.hidden_size) == (V, H)


def test_file_layout_is_what_the_report_says(ct_dir) -> None:
    """The library's own files: names, dtypes, shapes (guards the writer against library drift)."""
    ckpt = open_checkpoint(ct_dir("NVFP4"))
    got = {n: (ckpt.info(n).dtype, list(ckpt.info(n).shape)) for n in ckpt.names()}
    assert got == {"lm_head.weight_packed": ("U8", [V, H // 2]), "lm_head.weight_scale": ("F8_E4M3", [V, H // 16]),
                   "lm_head.weight_global_scale": ("F32", [1]), "lm_head.input_global_scale": ("F32", [1]),
                   "model.embed_tokens.weight_packed": ("U8", [V, H // 2]),
                   "model.embed_tokens.weight_scale": ("F8_E4M3", [V, H // 16]),
                   "model.embed_tokens.weight_global_scale": ("F32", [1]),
                   "model.embed_tokens.input_global_scale": ("F32", [1])}
    qc = ckpt.config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    ckpt = open_checkpoint(ct_dir("FP8_DYNAMIC"))
    assert ckpt.info("lm_head.weight_scale").dtype == "BF16" and list(ckpt.info("lm_head.weight_scale").shape) == [V, 1]


# ---- dequantized rows: bitwise compressed-tensors' decompress ---------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_dequantized_rows_equal_decompress(ct_dir, preset: str) -> None:
    path = ct_dir(preset)
    ckpt = open_checkpoint(path)
    for module, cls in ((ctw.HEAD, HEAD_CLS), (ctw.EMBED, EMBED_CLS)):
        ref = ctw.library_decompress(path, module, cls)
        ours = DecompressedRows(ckpt, module, format_of(preset), H)
        assert same_bits(ours[:], ref), module
        assert same_bits(ours[17:90], ref[17:90])
    # the head forced dense (quant='none'): its weight is decompress's, bit for bit, with a warning
    with pytest.warns(UserWarning, match="compressed-tensors' decompress"):
        head = LMHead.from_checkpoint(path, quant="none", dtype=torch.bfloat16)
    assert head.weight_format is WeightFormat.DENSE
    assert same_bits(head.weight, ctw.library_decompress(path, ctw.HEAD, HEAD_CLS))


@pytest.mark.parametrize("preset", PRESETS)
def test_embedding_rows_equal_decompress(ct_dir, preset: str) -> None:
    path = ct_dir(preset)
    ref = ctw.library_decompress(path, ctw.EMBED, EMBED_CLS)
    if format_of(preset) is WeightFormat.NVFP4:
        with pytest.warns(UserWarning, match="decompressed exactly"):
            emb = VocabParallelEmbedding.from_checkpoint(path, dtype=torch.bfloat16)
        assert emb.weight_format is WeightFormat.DENSE
    else:
        emb = VocabParallelEmbedding.from_checkpoint(path, dtype=torch.bfloat16)
        assert emb.weight_format is WeightFormat.FP8  # FP8 stays one byte per element
    ids = torch.tensor([[0, 5, V - 1, 77], [-1, V, 130, 5]])
    rows = emb(ids)
    assert same_bits(rows[0], ref[ids[0]])
    assert same_bits(rows[1, 2], ref[130]) and not bool(rows[1, :2].any())  # out-of-vocab ids: zero rows


def test_nvfp4_division_form_is_what_decompress_does() -> None:
    """The reciprocal form (ModelOpt's ``s * (1/g)``) is not decompress's; the division form is."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    gen = torch.Generator().manual_seed(5)
    rows, h = 512, 256
    packed = torch.randint(0, 256, (rows, h // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(rows, h // 16, generator=gen) * 400 + 0.01).to(torch.float8_e4m3fn)
    g = torch.tensor([1234.567], dtype=torch.float32)
    sch = preset_name_to_scheme("NVFP4A16", ["lm_head"])
    ref = NVFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scales,
                                            "weight_global_scale": g}, sch)["weight"]
    assert same_bits(decompress_nvfp4(packed, scales, g), ref)
    from trtvocab.quant.nvfp4 import dequantize_nvfp4

    reciprocal = dequantize_nvfp4(packed, scales, torch.ones(()) / g).bfloat16()
    assert not same_bits(reciprocal, ref)  # at least one bf16 value differs at this size


# ---- the quantized run: the same bytes as ModelOpt, the same logits -------------------------------------
def twin_heads(path: Path, twin: Path, **kw) -> tuple[LMHead, LMHead]:
    """The compressed-tensors head and its ModelOpt twin. ModelOpt's convention: FP8 without
    input_scale is dynamic W8A8; compressed-tensors writes weight-only FP8 as input_activations null
    (W8A16), so the twin of a weight-only head asks for weight-only."""
    ct_head = quiet_head(path, dtype=torch.bfloat16, **kw)
    weight_only = ct_head.quant_config.activation is Activation.NONE
    return ct_head, quiet_head(twin, dtype=torch.bfloat16, weight_only=weight_only)


@pytest.mark.parametrize("preset", PRESETS)
def test_modelopt_twin_gives_identical_logits(ct_dir, tmp_path: Path, preset: str) -> None:
    path = ct_dir(preset)
    twin = ctw.modelopt_twin(path, tmp_path / "modelopt", format_of(preset).value)
    kw = {"weight_only": True} if preset == "FP8_DYNAMIC" else {}
    ct_head, mo_head = twin_heads(path, twin, **kw)
    assert ct_head.quant_config == mo_head.quant_config
    assert mo_head.quant_decision.checkpoint_format == "modelopt"
    x = hidden()
    assert same_bits(ct_head(x), mo_head(x))
    for key, value in ct_head.weights.export_tensors().items():
        assert same_bits(value, mo_head.weights.export_tensors()[key]), key
    # Exact conversions: FP8 scales are the stored model-dtype values widened; NVFP4 global scales
    # are the float32 reciprocals of the stored ones.
    stored = ctw.module_tensors(path, ctw.HEAD)
    if format_of(preset) is WeightFormat.FP8:
        assert torch.equal(ct_head.weights.weight_scale.reshape(-1), stored["weight_scale"].float().reshape(-1))
    else:
        g = stored["weight_global_scale"].float().reshape(())
        assert same_bits(ct_head.weights.weight_scale_2, torch.ones(()) / g)


@pytest.mark.parametrize("preset", PRESETS)
def test_quantized_weights_are_the_stored_values(ct_dir, preset: str) -> None:
    """The quantized head's exact float32 weight vs decompress: FP8 equal after rounding to the scale's
    dtype (decompress rounds once there); NVFP4 within one bf16 rounding of the reciprocal form."""
    path = ct_dir(preset)
    head = quiet_head(path, dtype=torch.bfloat16)
    ref = ctw.library_decompress(path, ctw.HEAD, HEAD_CLS)
    dense = head.weights.dense_weight()[:V]
    if format_of(preset) is WeightFormat.FP8:
        assert same_bits(dense.to(ref.dtype), ref)
    else:
        assert torch.allclose(dense, ref.float(), rtol=2**-7, atol=0)


# ---- shards: uneven tp 3, padded tp 4 --------------------------------------------------------------------
def _head_shard(path: Path, tp: int, rank: int, layout: str, **kw) -> LMHead:
    mapping = Mapping(world_size=tp, rank=rank, tp_size=tp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source = open_head(path, mapping=mapping, **kw)
        head = LMHead(source.vocab_size, source.hidden_size, dtype=torch.bfloat16, mapping=mapping,
                      quant_config=source.quant_config, vocab_layout=layout, pad_to=16)
        head.load_weights(source.shard_tensors(head.shard))
    return head


def _embedding_shard(path: Path, tp: int, rank: int, layout: str) -> VocabParallelEmbedding:
    mapping = Mapping(world_size=tp, rank=rank, tp_size=tp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source = open_embedding(path)
    emb = VocabParallelEmbedding(source.vocab_size, source.hidden_size, dtype=torch.bfloat16, mapping=mapping,
                                 vocab_layout=layout, pad_to=16, quant_config=source.quant_config)
    emb.load_weights(source.tensors)
    return emb


def check_shards(path: Path, vocab: int, x: torch.Tensor) -> None:
    single = quiet_head(path, dtype=torch.bfloat16)
    single_dense = quiet_head(path, dtype=torch.bfloat16, quant="none")
    full = single.weights.dense_weight()[:vocab]
    logits = single(x)
    ids = torch.arange(vocab)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table_rows = VocabParallelEmbedding.from_checkpoint(path, dtype=torch.bfloat16)(ids)
    for tp, layout in ((3, "uneven"), (4, "padded")):
        for rank in range(tp):
            head = _head_shard(path, tp, rank, layout)
            s = head.shard
            assert torch.equal(head.weights.dense_weight()[: s.size], full[s.start : s.end])
            assert not bool(head.weights.dense_weight()[s.size :].any())  # padding rows stay zero
            local = head.local_logits(x)
            assert torch.equal(local[:, : s.size], logits[:, s.start : s.end])  # quantized GEMMs: partition-free
            if s.padding:
                assert bool(torch.isneginf(local[:, s.size :]).all())
            dense = _head_shard(path, tp, rank, layout, quant="none")
            assert same_bits(dense.weight, single_dense.weight[s.start : s.end])
            emb = _embedding_shard(path, tp, rank, layout)
            rows, scales = emb.local_rows(ids)
            part = emb.dequantize_rows(rows, scales)
            assert same_bits(part[s.start : s.end], table_rows[s.start : s.end])
            assert not bool(part[: s.start].any()) and not bool(part[s.end :].any())


@pytest.mark.parametrize("preset", ["FP8", "FP8_W8A16_CHANNEL", "NVFP4", "NVFP4A16"])
def test_shards_equal_single_device_rows(ct_dir, preset: str) -> None:
    check_shards(ct_dir(preset), V, hidden())


# ---- config forms: mixed precision, old files, class targets, single format ----------------------------------
def test_mixed_precision_nvfp4_head_fp8_embedding(tmp_path: Path) -> None:
    path = ctw.write_ct(tmp_path / "m", V, H, head="NVFP4", embed="FP8_W8A16_CHANNEL")
    assert ctw.read_config(path)["quantization_config"]["format"] == "mixed-precision"
    head = quiet_head(path)
    assert head.quant_config.quant_algo is QuantAlgo.NVFP4 and head.quant_config.activation is Activation.STATIC
    emb = VocabParallelEmbedding.from_checkpoint(path, dtype=torch.bfloat16)
    assert emb.weight_format is WeightFormat.FP8 and emb.weights.per_row
    ref = ctw.library_decompress(path, ctw.EMBED, EMBED_CLS)
    assert same_bits(emb(torch.arange(V)), ref)
    # load_tied on an untied file reads each matrix
    embedding, lm_head = load_tied(path, dtype=torch.bfloat16)
    assert lm_head.weight_format is WeightFormat.NVFP4 and embedding.weight_format is WeightFormat.FP8


def test_single_format_and_old_files_without_group_format(tmp_path: Path) -> None:
    path = ctw.write_ct(tmp_path / "single", V, H, head="NVFP4A16", embed="NVFP4A16")
    qc = ctw.read_config(path)["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized"
    ref = quiet_head(path)(hidden())
    # a pre-0.11 file: no per-group format, the top-level one applies
    ctw.edit_config(path, lambda q: [g.pop("format", None) for g in q["config_groups"].values()])
    assert same_bits(quiet_head(path)(hidden()), ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        emb = VocabParallelEmbedding.from_checkpoint(path)
    assert same_bits(emb(torch.arange(V)), ctw.library_decompress(path, ctw.EMBED, EMBED_CLS))


def test_class_and_regex_targets(tmp_path: Path) -> None:
    """llm-compressor's class target ``Linear`` quantizes HF's lm_head (vLLM's would not: the verdict
    says so); ``re:`` targets are regexes (re.match), not fnmatch patterns."""
    path = ctw.write_ct(tmp_path / "cls", V, H, head="FP8_W8A16_TENSOR", head_targets=["Linear"])
    decision = resolve_lm_head_quant(path)
    assert decision.config.quant_algo is QuantAlgo.FP8 and "vLLM would not quantize this head" in decision.reason
    path = ctw.write_ct(tmp_path / "re", V, H, head="NVFP4A16", head_targets=["re:.*lm_head"])
    decision = resolve_lm_head_quant(path)
    assert decision.config.quant_algo is QuantAlgo.NVFP4 and "vLLM" not in decision.reason


def test_dense_head_in_ignore_with_quantized_embedding(tmp_path: Path) -> None:
    """The usual release: lm_head in ``ignore`` (llm-compressor writes it there), stored dense."""
    path = ctw.write_ct(tmp_path / "ign", V, H, head=None, embed="FP8_W8A16_CHANNEL",
                        ignore=["lm_head"])
    decision = resolve_lm_head_quant(path)
    assert decision.config is None and decision.stored is None and not decision.dequantize
    head = LMHead.from_checkpoint(path, dtype=torch.bfloat16)
    assert same_bits(head.weight, ctw.module_tensors(path, ctw.HEAD)["weight"])


# ---- tied checkpoints ---------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["NVFP4", "FP8_W8A16_CHANNEL"])
def test_tied_config_with_a_stored_quantized_head_loads_the_head(tmp_path: Path, preset: str) -> None:
    """tie_word_embeddings true, but lm_head stored quantized: the head is the stored head, quantized,
    never the embedding."""
    path = ctw.write_ct(tmp_path / "t", V, H, head=preset, embed=None, tied=True)
    assert ctw.read_config(path)["tie_word_embeddings"] is True
    decision = resolve_lm_head_quant(path)
    assert not decision.tied and decision.tensor_name.startswith("lm_head.")
    assert decision.config is not None and decision.config.weight_format is format_of(preset)
    embedding, head = load_tied(path, dtype=torch.bfloat16)
    assert head.weight_format is format_of(preset)
    assert embedding.weights is not head.weights and embedding.weight_format is WeightFormat.DENSE
    assert same_bits(embedding(torch.arange(V)), ctw.module_tensors(path, ctw.EMBED)["weight"])


def test_tied_dense_head_uses_the_embedding(tmp_path: Path) -> None:
    path = ctw.write_ct(tmp_path / "t", V, H, head=None, embed=None, tied=True)
    # a compressed-tensors config that quantizes nothing here (lm_head absent, embedding not targeted)
    cfg = ctw.read_config(path)
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                  "quantization_status": "compressed", "ignore": ["lm_head"],
                                  "config_groups": {"group_0": {"targets": ["re:.*mlp.*"], "format": "float-quantized",
                                                                "weights": {"num_bits": 8, "type": "float",
                                                                            "strategy": "channel"}}}}
    (path / "config.json").write_text(json.dumps(cfg))
    decision = resolve_lm_head_quant(path)
    assert decision.tied and decision.tensor_name == "model.embed_tokens.weight" and decision.config is None
    embedding, head = load_tied(path, dtype=torch.bfloat16)
    assert embedding.weights is head.weights


# ---- refusals: config and tensors disagree ------------------------------------------------------------------
def _assert_names(exc: BaseException, *parts: str) -> None:
    text = str(exc)
    for part in parts:
        assert part in text, (part, text)


def test_refuses_target_naming_the_head_without_quantized_tensors(tmp_path: Path) -> None:
    path = ctw.write_ct(tmp_path / "r", V, H, head=None, embed="NVFP4A16")
    nvfp4 = ctw.read_config(path)["quantization_config"]["config_groups"]["group_0"]

    def add_head_group(qc: dict) -> None:
        qc["config_groups"]["group_9"] = {**nvfp4, "targets": ["lm_head"]}
    ctw.edit_config(path, add_head_group)
    with pytest.raises(QuantizationError) as err:
        LMHead.from_checkpoint(path)
    _assert_names(err.value, str(path / "model.safetensors"), "config_groups['group_9'] (target 'lm_head')",
                  "lm_head.weight_packed", "lm_head.weight is BF16")
    # packed bytes without their global scale
    shutil.rmtree(path)
    path = ctw.write_ct(tmp_path / "r2", V, H, head="NVFP4A16")
    ctw.rewrite_tensors(path, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight_global_scale"})
    with pytest.raises(QuantizationError) as err:
        LMHead.from_checkpoint(path)
    _assert_names(err.value, "lm_head.weight_global_scale is missing", "config_groups['group_0'] (target 'lm_head')")


def test_refuses_quantized_tensors_the_config_does_not_cover(tmp_path: Path) -> None:
    path = ctw.write_ct(tmp_path / "r", V, H, head="NVFP4A16")
    ctw.edit_config(path, lambda qc: qc.__setitem__("ignore", ["re:.*lm_head$"]))
    with pytest.raises(QuantizationError) as err:
        resolve_lm_head_quant(path)
    _assert_names(err.value, str(path / "model.safetensors"), "ignore entry 're:.*lm_head$'", "lm_head holds quantized",
                  "weight_packed U8")
    # and with quant='none' too: the tensors are not described, so not even dequantized
    with pytest.raises(QuantizationError):
        LMHead.from_checkpoint(path, quant="none")


def test_refuses_dense_frozen_checkpoint(tmp_path: Path) -> None:
    """save_compressed=False: dense bf16 weights with scales beside them. Refused (their values are not
    the quantized model's and the bytes are not codes); quant='none' loads the dense weights, saying so."""
    path = ctw.write_ct(tmp_path / "f", V, H, head="NVFP4", embed=None, save_compressed=False)
    qc = ctw.read_config(path)["quantization_config"]
    assert qc["format"] == "dense" and qc["quantization_status"] == "frozen"
    ckpt = open_checkpoint(path)
    assert ckpt.info("lm_head.weight").dtype == "BF16" and ckpt.has("lm_head.weight_global_scale")
    with pytest.raises(QuantizationError) as err:
        LMHead.from_checkpoint(path)
    _assert_names(err.value, str(path / "model.safetensors"), "config_groups['group_0'] (target 'lm_head')",
                  "format 'dense'", "quantization_status 'frozen'", "lm_head.weight is BF16",
                  "lm_head.weight_global_scale")
    with pytest.warns(UserWarning, match="scales beside them are not applied"):
        head = LMHead.from_checkpoint(path, quant="none", dtype=torch.bfloat16)
    assert same_bits(head.weight, ctw.module_tensors(path, ctw.HEAD)["weight"])


def test_refuses_bf16_scale_of_the_wrong_shape(tmp_path: Path) -> None:
    path = ctw.write_ct(tmp_path / "s", V, H, head="FP8_W8A16_CHANNEL")
    # the config says per-tensor, the file holds per-channel scales
    ctw.edit_config(path, lambda qc: qc["config_groups"]["group_0"]["weights"].__setitem__("strategy", "tensor"))
    with pytest.raises(QuantizationError) as err:
        LMHead.from_checkpoint(path)
    _assert_names(err.value, str(path / "model.safetensors"), "lm_head.weight_scale has shape [263, 1]",
                  "config_groups['group_0'] (target 'lm_head')", "per-tensor")
    path = ctw.write_ct(tmp_path / "s2", V, H, head="FP8_W8A16_CHANNEL")
    ctw.rewrite_tensors(path, lambda t: {**t, "lm_head.weight_scale": t["lm_head.weight_scale"][:100]})
    with pytest.raises(QuantizationError) as err:
        LMHead.from_checkpoint(path)
    _assert_names(err.value, "lm_head.weight_scale has shape [100, 1]", "[263, 1]")


def test_refuses_unsupported_schemes(tmp_path: Path) -> None:
    path = ctw.write_ct(tmp_path / "b", 256, 128, head="FP8_BLOCK")
    with pytest.raises(QuantizationError, match="strategy 'block' is not supported"):
        LMHead.from_checkpoint(path)
    path = ctw.write_ct(tmp_path / "x", V, H, head="FP8_W8A16_TENSOR")
    ctw.edit_config(path, lambda qc: qc.__setitem__("transform_config", {"config_groups": {"r": {"apply": [
        {"targets": ["Linear"], "location": "weight_input"}]}}}))
    with pytest.raises(QuantizationError, match="transform_config applies to lm_head"):
        LMHead.from_checkpoint(path)
    ctw.edit_config(path, lambda qc: qc.update(transform_config={}, config_groups={"g": {"targets": ["lm_head"],
                                                                                         "format": "bogus"}}))
    with pytest.raises(QuantizationError, match="lm_head holds quantized tensors"):
        LMHead.from_checkpoint(path)  # a group without weights quantizes nothing: the F8 bytes are not covered
    ctw.edit_config(path, lambda qc: qc.update(config_groups={"g": {"targets": 7}}))
    with pytest.raises(QuantizationError, match="not a valid compressed-tensors quantization_config"):
        LMHead.from_checkpoint(path)


def test_embedding_refusals(tmp_path: Path) -> None:
    path = ctw.write_ct(tmp_path / "e", V, H, head=None, embed="FP8_W8A16_CHANNEL")
    ctw.edit_config(path, lambda qc: qc.__setitem__("ignore", ["re:.*embed_tokens$", "lm_head"]))
    with pytest.raises(QuantizationError, match=r"model\.embed_tokens holds quantized tensors") as err:
        VocabParallelEmbedding.from_checkpoint(path)
    _assert_names(err.value, str(path / "model.safetensors"), "ignore entry 're:.*embed_tokens$'", "weight_scale")
    path = ctw.write_ct(tmp_path / "e2", V, H, head=None, embed="NVFP4A16")
    ctw.rewrite_tensors(path, lambda t: {k: v for k, v in t.items() if k != "model.embed_tokens.weight_scale"})
    with pytest.raises(QuantizationError, match=r"model\.embed_tokens\.weight_scale is missing"):
        VocabParallelEmbedding.from_checkpoint(path)
    with pytest.raises(CheckpointError, match="no input embedding"):
        open_embedding(_only_head(tmp_path))


def _only_head(tmp_path: Path) -> Path:
    path = ctw.write_ct(tmp_path / "h", V, H, head="FP8_W8A16_TENSOR")
    ctw.rewrite_tensors(path, lambda t: {k: v for k, v in t.items() if not k.startswith(ctw.EMBED)})
    return path


# ---- SmolLM2 size, real weights --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_table(smollm2: Path) -> torch.Tensor:
    """SmolLM2-135M's embedding table (its tied head), dequantized from the GGUF by trtvocab's reader."""
    ckpt = open_checkpoint(smollm2)
    table = ckpt.get_slice("model.embed_tokens.weight")[...].float()
    assert tuple(table.shape) == (SMOLLM2_V, SMOLLM2_H)
    return table


@pytest.mark.model
@pytest.mark.parametrize("head, embed", [("NVFP4", "FP8_W8A16_CHANNEL"), ("FP8_W8A16_CHANNEL", "NVFP4A16")])
def test_smollm2_size(smollm2_table: torch.Tensor, tmp_path: Path, head: str, embed: str) -> None:
    w = smollm2_table
    path = ctw.write_ct(tmp_path / "s", SMOLLM2_V, SMOLLM2_H, head=head, embed=embed, head_weight=w, embed_weight=w)
    ckpt = open_checkpoint(path)
    for module, cls, preset in ((ctw.HEAD, HEAD_CLS, head), (ctw.EMBED, EMBED_CLS, embed)):
        ref = ctw.library_decompress(path, module, cls)
        assert same_bits(DecompressedRows(ckpt, module, format_of(preset), SMOLLM2_H)[:], ref), module
    x = smollm2_table[torch.tensor([1, 500, 9000, 40000])].bfloat16()
    check_shards(path, SMOLLM2_V, x)
    twin = ctw.modelopt_twin(path, tmp_path / "mo", format_of(head).value)
    ct_head, mo_head = twin_heads(path, twin)
    assert same_bits(ct_head(x), mo_head(x))
