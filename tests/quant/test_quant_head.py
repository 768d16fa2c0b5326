"""The quantized LM head: gating over real checkpoint directories, loading, TP parity, references.

References are independent of trtvocab's numerics: ModelOpt's ``QTensor.dequantize`` for the
weights and ModelOpt's ``quantize`` for activation quantization, multiplied in float64.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import trtvocab.base.safetensors_header as st_header
import trtvocab.checkpoints.checkpoint as ckpt_mod
from tests.conftest import modelopt_qtensor
from tests.quant import quant_rank_fns
from trtvocab import LMHead, LogitsProcessor, Mapping, QuantAlgo, QuantConfig, resolve_lm_head_quant
from trtvocab.base import safe_read
from trtvocab.base.formats import WeightFormat
from trtvocab.checkpoints.checkpoint import Checkpoint
from trtvocab.errors import CheckpointError, QuantizationError
from trtvocab.parallel.launch import run_ranks
from trtvocab.parallel.sharding import vocab_shard
from trtvocab.quant.writer import quantize_head_tensors
from trtvocab.weights.loader import dequantize_stored

F8 = torch.float8_e4m3fn
V, H = 1009, 64  # prime vocab: uneven shards for every tp > 1
FP8 = QuantAlgo.FP8
NVFP4 = QuantAlgo.NVFP4


# ---- checkpoint writing ----------------------------------------------------------------------------
def head_weight(v: int = V, h: int = H, seed: int = 0) -> torch.Tensor:
    return torch.randn(v, h, generator=torch.Generator().manual_seed(seed)) * 0.05


def quantized(algo: QuantAlgo, w: torch.Tensor, *, static: bool = True, per_row: bool = False,
              prefix: str = "lm_head.") -> dict[str, torch.Tensor]:
    config = QuantConfig(quant_algo=algo, activation="static" if static else "none",
                         granularity="per_row" if per_row else "per_tensor")
    tensors = quantize_head_tensors(w, config, input_amax=3.0 if static else None)
    return {prefix + k: v for k, v in tensors.items()}


def write_ckpt(path: Path, tensors: dict[str, torch.Tensor], *, config: dict | None = None,
               hf_quant: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    cfg = {"tie_word_embeddings": False, **(config or {})}
    (path / "config.json").write_text(json.dumps(cfg))
    if hf_quant is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return path


def hf_quant(algo: str | None, exclude: list[str] | None = None, **extra: Any) -> dict:
    return {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": algo, "exclude_modules": exclude or [],
                                                              **extra}}


def embed(v: int = V, h: int = H) -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": head_weight(v, h, seed=7).bfloat16()}


# ---- independent references --------------------------------------------------------------------------
def ref_weight(tensors: dict[str, torch.Tensor], prefix: str = "lm_head.") -> torch.Tensor:
    """ModelOpt's dequantization of a stored head, float32 [V, H]."""
    w, ws = tensors[prefix + "weight"], tensors[prefix + "weight_scale"]
    if w.dtype == F8:
        scale = ws.reshape(-1, 1) if ws.numel() > 1 else ws
        return modelopt_qtensor().FP8QTensor(w.shape, torch.float32, w).dequantize(dtype=torch.float32, scale=scale)
    shape = torch.Size([w.shape[0], w.shape[1] * 2])
    return modelopt_qtensor().NVFP4QTensor(shape, torch.float32, w).dequantize(
        dtype=torch.float32, scale=ws, double_scale=tensors[prefix + "weight_scale_2"], block_sizes={-1: 16})


def ref_activation(x: torch.Tensor, algo: QuantAlgo, mode: str, input_scale: torch.Tensor | None) -> torch.Tensor:
    xf = x.float()
    if mode == "none":
        return xf
    if algo is FP8:
        amax = xf.abs().amax()
        scale = input_scale if mode == "static" else (amax / 448 if amax > 0 else torch.tensor(1.0))
        q, _ = modelopt_qtensor().FP8QTensor.quantize(xf, scales=scale)
        return q.dequantize(dtype=torch.float32, scale=scale)
    qt, bs, g = modelopt_qtensor().NVFP4QTensor.quantize(xf, 16, weights_scaling_factor_2=input_scale)
    return qt.dequantize(dtype=torch.float32, scale=bs, double_scale=g, block_sizes={-1: 16})


def ref_logits(x: torch.Tensor, tensors: dict[str, torch.Tensor], algo: QuantAlgo, mode: str) -> torch.Tensor:
    x_dq = ref_activation(x, algo, mode, tensors.get("lm_head.input_scale"))
    return x_dq.double() @ ref_weight(tensors).double().t()


def hidden(n: int = 6, h: int = H, dtype: torch.dtype = torch.bfloat16, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, h, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---- gating decision table ----------------------------------------------------------------------------
def _fp8(static=True, per_row=False):
    return quantized(FP8, head_weight(40, 32), static=static, per_row=per_row)


def _nvfp4(static=True):
    return quantized(NVFP4, head_weight(40, 32), static=static)


def _dense():
    return {"lm_head.weight": head_weight(40, 32).bfloat16()}


GATING = [
    # id, tensors, config.json extra, hf_quant_config, mapping, quant -> (algo, activation, granularity, dequantize)
    ("fp8-static", _fp8, {}, hf_quant("FP8"), None, "auto", ("FP8", "static", "per_tensor", False)),
    ("fp8-dynamic", lambda: _fp8(static=False), {}, hf_quant("FP8"), None, "auto", ("FP8", "dynamic", "per_tensor",
                                                                                    False)),
    ("fp8-per-row", lambda: _fp8(per_row=True), {}, hf_quant("FP8"), None, "auto", ("FP8", "static", "per_row",
                                                                                    False)),
    ("global-no-head-scale", _dense, {}, hf_quant("FP8"), None, "auto", (None, None, None, False)),
    ("nvfp4-w4a4", _nvfp4, {}, hf_quant("NVFP4", group_size=16), None, "auto", ("NVFP4", "static", "per_tensor",
                                                                                 False)),
    ("nvfp4-w4a16", lambda: _nvfp4(static=False), {}, hf_quant("NVFP4"), None, "auto", ("NVFP4", "none",
                                                                                        "per_tensor", False)),
    ("config-json-nvfp4", _nvfp4, {"quantization_config": {"quant_algo": "NVFP4", "ignore": []}}, None, None, "auto",
     ("NVFP4", "static", "per_tensor", False)),
    ("excluded-exact-dense", _dense, {}, hf_quant("FP8", ["lm_head"]), None, "auto", (None, None, None, False)),
    ("excluded-exact-stored-fp8", _fp8, {}, hf_quant("FP8", ["lm_head"]), None, "auto", (None, None, None, True)),
    ("excluded-wildcard-stored-nvfp4", _nvfp4, {}, hf_quant("NVFP4", ["*head*"]), None, "auto",
     (None, None, None, True)),
    ("ignore-config-json", _dense, {"quantization_config": {"quant_algo": "FP8", "ignore": ["lm_head"]}}, None, None,
     "auto", (None, None, None, False)),
    ("mixed-with-entry", _nvfp4, {}, hf_quant("MIXED_PRECISION", quantized_layers={"lm_head": {"quant_algo": "NVFP4"}}),
     None, "auto", ("NVFP4", "static", "per_tensor", False)),
    ("mixed-without-entry-dense", _dense, {},
     hf_quant("MIXED_PRECISION", quantized_layers={"model.layers.0.mlp.up_proj": {"quant_algo": "FP8"}}), None,
     "auto", (None, None, None, False)),
    ("mixed-without-entry-stored-fp8", _fp8, {},
     hf_quant("MIXED_PRECISION", quantized_layers={"model.layers.0.mlp.up_proj": {"quant_algo": "FP8"}}), None,
     "auto", (None, None, None, True)),
    ("not-quantized", _dense, {}, None, None, "auto", (None, None, None, False)),
    ("tied-embeddings", lambda: embed(40, 32), {"tie_word_embeddings": True}, hf_quant("FP8"), None, "auto",
     (None, None, None, False)),
    ("adp-lm-head-tp-stored-fp8", _fp8, {}, hf_quant("FP8"),
     Mapping(world_size=2, rank=0, tp_size=2, enable_attention_dp=True, enable_lm_head_tp_in_adp=True), "auto",
     (None, None, None, True)),
    ("adp-replicated-stays-quantized", _fp8, {}, hf_quant("FP8"),
     Mapping(world_size=2, rank=1, tp_size=2, enable_attention_dp=True), "auto", ("FP8", "static", "per_tensor",
                                                                                 False)),
    ("quant-none-stored-nvfp4", _nvfp4, {}, hf_quant("NVFP4"), None, "none", (None, None, None, True)),
]


@pytest.mark.parametrize("case", GATING, ids=[c[0] for c in GATING])
def test_gating_decision_table(tmp_path, case):
    _, make, config, quant, mapping, mode, (algo, activation, granularity, dequantize) = case
    path = write_ckpt(tmp_path / "ckpt", make(), config=config, hf_quant=quant)
    decision = resolve_lm_head_quant(Checkpoint(path), mapping=mapping, quant=mode)
    assert decision.dequantize is dequantize, decision.reason
    if algo is None:
        assert decision.config is None, decision.reason
    else:
        assert decision.config is not None, decision.reason
        assert (decision.config.quant_algo.value, decision.config.activation, decision.config.granularity) == (
            algo, activation, granularity)
    assert (decision.warning is not None) is dequantize
    # The stored bytes' format is a WeightFormat (FP8 / NVFP4) whether the head runs quantized or dense.
    head_dtype = Checkpoint(path).info(decision.tensor_name).dtype
    assert decision.stored is {"F8_E4M3": WeightFormat.FP8, "U8": WeightFormat.NVFP4}.get(head_dtype)


def test_gating_weight_only_and_errors(tmp_path):
    path = write_ckpt(tmp_path / "a", _fp8(), hf_quant=hf_quant("FP8"))
    decision = resolve_lm_head_quant(Checkpoint(path), weight_only=True)
    assert decision.config.activation == "none" and decision.config.label == "FP8 W8A16"
    # A per-layer entry that names the head, but dense bytes: a typed error, not a silent dense head.
    path = write_ckpt(tmp_path / "b", _dense(),
                      hf_quant=hf_quant("MIXED_PRECISION", quantized_layers={"lm_head": {"quant_algo": "FP8"}}))
    with pytest.raises(QuantizationError, match="stored dense"):
        resolve_lm_head_quant(Checkpoint(path))
    # Packed FP4 without its global scale.
    tensors = _nvfp4()
    del tensors["lm_head.weight_scale_2"]
    path = write_ckpt(tmp_path / "c", tensors, hf_quant=hf_quant("NVFP4"))
    with pytest.raises(QuantizationError, match="weight_scale_2 is missing"):
        resolve_lm_head_quant(Checkpoint(path))
    # The stored format disagrees with the named algo.
    path = write_ckpt(tmp_path / "d", _fp8(), hf_quant=hf_quant("NVFP4"))
    with pytest.raises(QuantizationError, match="stored as FP8"):
        resolve_lm_head_quant(Checkpoint(path))


# ---- the header probe reads no tensor data ---------------------------------------------------------------
class _CountingFile:
    def __init__(self, fh: Any, log: list[int]) -> None:
        self._fh, self._log = fh, log

    def read(self, *args: Any) -> bytes:
        data = self._fh.read(*args)
        self._log.append(len(data))
        return data

    def readinto(self, buf: Any) -> int:
        n = self._fh.readinto(buf)
        self._log.append(n)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)

    def __enter__(self) -> _CountingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._fh.close()


def test_header_probe_reads_no_tensor_data(tmp_path, monkeypatch):
    path = write_ckpt(tmp_path / "ckpt", {**_nvfp4(), **embed(40, 32)}, hf_quant=hf_quant("NVFP4"))
    st = path / "model.safetensors"
    header_bytes = 8 + int.from_bytes(st.read_bytes()[:8], "little")
    # 1) Count every byte read through open_regular (the one opener) while gating runs: only the headers.
    log: list[int] = []
    real_open = safe_read.open_regular

    def counting(f: Any, *a: Any, **k: Any) -> Any:
        return _CountingFile(real_open(f, *a, **k), log) if str(f).endswith(".safetensors") else real_open(f, *a, **k)

    for module in (st_header, ckpt_mod):
        monkeypatch.setattr(module, "open_regular", counting)
    decision = resolve_lm_head_quant(Checkpoint(path))
    monkeypatch.undo()
    assert decision.config is not None and decision.config.quant_algo is NVFP4
    assert 0 < sum(log) <= 2 * header_bytes  # the header (read by two helpers), never the data
    # 2) Cut the data region off entirely: the probe still decides, a row read then fails loudly.
    with open(st, "r+b") as fh:
        fh.truncate(header_bytes)
    ckpt = Checkpoint(path)
    decision = resolve_lm_head_quant(ckpt)
    assert decision.config.quant_algo is NVFP4 and decision.config.activation == "static"
    with pytest.raises(CheckpointError, match="truncated"):
        ckpt.get_slice("lm_head.weight")[0:4]


# ---- forced dense over stored quantized bytes: exact dequantization with a warning -------------------------
@pytest.mark.model
@pytest.mark.parametrize("algo,per_row", [(FP8, False), (FP8, True), (NVFP4, False)])
def test_excluded_stored_quantized_head_is_dequantized_exactly(tmp_path, algo, per_row):
    tensors = quantized(algo, head_weight(), per_row=per_row)
    path = write_ckpt(tmp_path / "ckpt", tensors, hf_quant=hf_quant(algo.value, ["*lm_head*"]))
    with pytest.warns(UserWarning, match="dequantizing it exactly"):
        head = LMHead.from_checkpoint(path, dtype=torch.float32)
    assert head.weight_format == "dense" and head.quant_decision.dequantize
    assert torch.equal(head.weights.weight, ref_weight(tensors))
    with pytest.warns(UserWarning, match="dequantizing"):
        head16 = LMHead.from_checkpoint(path, dtype=torch.bfloat16)
    assert torch.equal(head16.weights.weight, ref_weight(tensors).bfloat16())


@pytest.mark.model
def test_adp_lm_head_tp_dequantizes_this_ranks_rows(tmp_path):
    tensors = quantized(NVFP4, head_weight())
    path = write_ckpt(tmp_path / "ckpt", tensors, hf_quant=hf_quant("NVFP4"))
    want = ref_weight(tensors)
    for rank in (0, 1):
        mapping = Mapping(world_size=2, rank=rank, tp_size=2, enable_attention_dp=True, enable_lm_head_tp_in_adp=True)
        with pytest.warns(UserWarning, match="attention DP"):
            head = LMHead.from_checkpoint(path, mapping=mapping, dtype=torch.float32)
        assert head.is_split and head.weight_format == "dense"
        assert torch.equal(head.weights.weight, want[head.vocab_start : head.vocab_end])


@pytest.mark.model
def test_dequantize_stored_reads_only_the_shard(tmp_path):
    tensors = quantized(FP8, head_weight())
    path = write_ckpt(tmp_path / "ckpt", tensors, hf_quant=hf_quant("FP8"))
    ckpt = Checkpoint(path)
    lazy = {k.split(".")[-1]: ckpt.get_slice(k) for k in tensors}
    shard = vocab_shard(V, 3, 2)
    got = dequantize_stored(WeightFormat.FP8, lazy, shard, H)
    assert torch.equal(got, ref_weight(tensors)[shard.start : shard.end])
    with pytest.raises(QuantizationError, match="cannot dequantize"):
        dequantize_stored(WeightFormat.DENSE, lazy, shard, H)


# ---- forward: logits against a float64 reference, resident bytes -------------------------------------------
CASES = [  # (id, algo, static checkpoint, per_row, weight_only, expected mode)
    ("fp8-static", FP8, True, False, False, "static"),
    ("fp8-dynamic", FP8, False, False, False, "dynamic"),
    ("fp8-weight-only", FP8, True, False, True, "none"),
    ("fp8-per-row", FP8, True, True, False, "static"),
    ("nvfp4-w4a4", NVFP4, True, False, False, "static"),
    ("nvfp4-w4a16", NVFP4, False, False, False, "none"),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("quant_ckpts")
    out = {}
    for cid, algo, static, per_row, _, _ in CASES:
        tensors = quantized(algo, head_weight(seed=3), static=static, per_row=per_row)
        out[cid] = (write_ckpt(root / cid, tensors, hf_quant=hf_quant(algo.value)), tensors)
    return out


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.model
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_single_device_logits_match_float64_reference(checkpoints, case):
    cid, algo, _, per_row, weight_only, mode = case
    path, tensors = checkpoints[cid]
    head = LMHead.from_checkpoint(path, weight_only=weight_only)
    assert head.quant_decision.config.activation == mode and head.weight_format == algo.value
    assert head.quant_decision.config.granularity == ("per_row" if per_row else "per_tensor")
    x = hidden()
    y = head(x)
    assert y.dtype == torch.float32 and y.shape == (6, V)
    ref = ref_logits(x, tensors, algo, mode)
    assert rel_error(y, ref) < 1e-6
    assert torch.equal(head.weights.dense_weight(), ref_weight(tensors))
    # The LogitsProcessor's last-token rows see the same numbers (dynamic FP8 scales depend
    # on which rows are in the batch, so compare against a head call on the same rows).
    seq_lens = torch.tensor([2, 1, 3])
    logits = LogitsProcessor()(x, head, seq_lens)
    assert torch.equal(logits, head(x[[1, 2, 5]]))


def test_resident_bytes_stay_quantized():
    v, h = 512, 1024
    w = head_weight(v, h)
    dense = LMHead(v, h, dtype=torch.bfloat16)
    dense.load_weights({"weight": w.bfloat16()})
    for algo, per_row, bound in ((FP8, False, 0.51), (FP8, True, 0.51), (NVFP4, False, 0.29)):
        config = QuantConfig(quant_algo=algo, activation="static", granularity="per_row" if per_row else "per_tensor")
        head = LMHead(v, h, quant_config=config)
        head.load_weights(quantize_head_tensors(w, config, input_amax=2.0))
        ratio = head.resident_bytes() / dense.resident_bytes()
        assert ratio <= bound, (algo, per_row, ratio)
        assert all(b.dtype in (F8, torch.uint8, torch.float32) for b in head.weights.buffers())


@pytest.mark.model
def test_forward_chunks_keep_temporaries_small(monkeypatch):
    from trtvocab.weights import quantized as methods

    monkeypatch.setattr(methods, "CHUNK_ELEMENTS", 64 * 7)  # 7 rows per chunk: many uneven chunks
    w = head_weight(101, 64)
    x = hidden(3)
    for algo in (FP8, NVFP4):
        config = QuantConfig(quant_algo=algo, activation="static")
        tensors = quantize_head_tensors(w, config, input_amax=3.0)
        head = LMHead(101, 64, quant_config=config)
        head.load_weights(tensors)
        assert head.weights.rows_per_chunk == 7
        ref = ref_logits(x, {"lm_head." + k: t for k, t in tensors.items()}, algo, "static")
        assert rel_error(head(x), ref) < 1e-6


def test_padded_rows_stay_zero_and_export_is_trimmed():
    w = head_weight(50, 32)
    for algo in (FP8, NVFP4):
        config = QuantConfig(quant_algo=algo, activation="none")
        tensors = quantize_head_tensors(w, config)
        head = LMHead(50, 32, quant_config=config, vocab_layout="padded", pad_to=64)
        head.load_weights(tensors)
        assert head.shard.width == 64 and head.shard.size == 50
        dense = head.weights.dense_weight()
        assert not bool(dense[50:].any())
        assert torch.isfinite(head.weights.weight_scale.float()).all()
        exported = head.weights.export_tensors()
        assert all(t.shape[0] == 50 for k, t in exported.items() if t.dim() > 0)
        for key, value in tensors.items():
            assert torch.equal(exported[key].view(torch.uint8) if value.dtype == F8 else exported[key],
                               value.view(torch.uint8) if value.dtype == F8 else value.reshape(exported[key].shape))
        local = head.weights(hidden(2, 32))
        assert local.shape == (2, 64) and not bool(local[:, 50:].any())


# ---- quantized TP parity over real gloo process groups ------------------------------------------------------
@pytest.mark.ranks
@pytest.mark.model
def test_quantized_tp_parity_uneven_and_padded(checkpoints):
    x = hidden(5, seed=4)
    cases = [(str(checkpoints[c[0]][0]), c[4]) for c in CASES]
    uneven = [(path, weight_only, "uneven") for path, weight_only in cases]
    padded = [(path, weight_only, "padded") for path, weight_only in cases]
    single = quant_rank_fns.quantized_tp_logits(0, 1, uneven, x)
    refs = [ref_logits(x, checkpoints[c[0]][1], c[1], c[5]) for c in CASES]
    # One launch per tp size (spawning costs seconds); tp 3 also runs the padded layout.
    runs = {tp: run_ranks(quant_rank_fns.quantized_tp_logits, tp, uneven + (padded if tp == 3 else []), x)
            for tp in (2, 3, 5)}
    for tp, per_rank in runs.items():
        layouts = ["uneven"] * len(CASES) + (["padded"] * len(CASES) if tp == 3 else [])
        for j, layout in enumerate(layouts):
            i = j % len(CASES)
            case = CASES[i]
            base, base_bytes, label = single[i]
            base_err = float((base.double() - refs[i]).abs().max())
            for rank in range(tp):
                got, _, rank_label = per_rank[rank][j]
                assert rank_label == label and got.dtype == torch.float32 and got.shape == (5, V)
                assert torch.equal(got, per_rank[0][j][0]), "gathered logits differ between ranks"
            got = per_rank[0][j][0]
            err = float((got.double() - refs[i]).abs().max())
            assert err <= 2 * base_err + 1e-7, (case[0], tp, layout, err, base_err)
            assert torch.equal(got.argmax(-1), base.argmax(-1)), (case[0], tp, layout)
            # The shards together hold the single-device bytes: scalars repeat on every rank,
            # padded rows add at most pad_to * tp rows.
            total = sum(per_rank[r][j][1] for r in range(tp))
            row_bytes = base_bytes / V
            slack = 16 * tp + (8 * tp * row_bytes if layout == "padded" else 0)
            assert base_bytes <= total <= base_bytes + slack, (case[0], tp, layout, total, base_bytes)


# ---- typed errors on bad tensors -----------------------------------------------------------------------------
def _load(algo: QuantAlgo, tensors: dict[str, Any], *, activation: str = "static", per_row: bool = False,
          v: int = 40, h: int = 32) -> LMHead:
    config = QuantConfig(quant_algo=algo, activation=activation, granularity="per_row" if per_row else "per_tensor")
    head = LMHead(v, h, quant_config=config)
    head.load_weights(tensors)
    return head


def _bad(tensors: dict[str, torch.Tensor], **changes: Any) -> dict[str, torch.Tensor]:
    out = dict(tensors)
    for key, value in changes.items():
        if value is None:
            out.pop("lm_head." + key)
        else:
            out["lm_head." + key] = value
    return out


FP8_OK = quantized(FP8, head_weight(40, 32))
FP8_ROW = quantized(FP8, head_weight(40, 32), per_row=True)
NV_OK = quantized(NVFP4, head_weight(40, 32))
BAD = [
    ("fp8 dense weight", FP8, FP8_OK, {"weight": head_weight(40, 32).bfloat16()}, {}, CheckpointError, "float8_e4m3fn"),
    ("fp8 nan code", FP8, FP8_OK, {"weight": torch.full((40, 32), 0x7F, dtype=torch.uint8).view(F8)}, {},
     QuantizationError, "NaN"),
    ("fp8 missing scale", FP8, FP8_OK, {"weight_scale": None}, {}, QuantizationError,
     "lm_head.weight_scale is missing"),
    ("fp8 bf16 scale", FP8, FP8_OK, {"weight_scale": torch.tensor(0.1, dtype=torch.bfloat16)}, {}, QuantizationError,
     "float32"),
    ("fp8 vector scale per-tensor", FP8, FP8_OK, {"weight_scale": torch.ones(40)}, {}, QuantizationError, "per-row"),
    ("fp8 nan scale", FP8, FP8_OK, {"weight_scale": torch.tensor(float("nan"))}, {}, QuantizationError, "finite"),
    ("fp8 inf scale", FP8, FP8_OK, {"weight_scale": torch.tensor(float("inf"))}, {}, QuantizationError, "finite"),
    ("fp8 zero scale", FP8, FP8_OK, {"weight_scale": torch.tensor(0.0)}, {}, QuantizationError, "> 0"),
    ("fp8 negative input scale", FP8, FP8_OK, {"input_scale": torch.tensor(-1.0)}, {}, QuantizationError,
     "lm_head.input_scale"),
    ("fp8 static missing input scale", FP8, FP8_OK, {"input_scale": None}, {}, QuantizationError,
     "lm_head.input_scale is missing"),
    ("fp8 got weight_scale_2", FP8, FP8_OK, {"weight_scale_2": torch.tensor(1.0)}, {}, CheckpointError, "NVFP4"),
    ("fp8 wrong rows", FP8, FP8_OK, {"weight": torch.zeros(7, 32, dtype=F8)}, {}, CheckpointError, "lm_head.weight"),
    ("fp8 per-row zero", FP8, FP8_ROW, {"weight_scale": torch.zeros(40)}, {"per_row": True}, QuantizationError,
     "per-row scales must be finite and > 0"),
    ("fp8 per-row bad shape", FP8, FP8_ROW, {"weight_scale": torch.ones(40, 2)}, {"per_row": True},
     QuantizationError, r"\[V\] or \[V, 1\]"),
    ("nvfp4 packed width", NVFP4, NV_OK, {"weight": torch.zeros(40, 15, dtype=torch.uint8)}, {}, CheckpointError,
     "lm_head.weight.*H/2"),
    ("nvfp4 packed dtype", NVFP4, NV_OK, {"weight": torch.zeros(40, 16, dtype=torch.int8)}, {}, CheckpointError,
     "uint8"),
    ("nvfp4 block scale dtype", NVFP4, NV_OK, {"weight_scale": torch.ones(40, 2)}, {}, QuantizationError,
     "float8_e4m3fn"),
    ("nvfp4 block scale shape", NVFP4, NV_OK, {"weight_scale": torch.ones(40, 4).to(F8)}, {}, QuantizationError,
     r"\[V, H/16\]"),
    ("nvfp4 block scale nan", NVFP4, NV_OK, {"weight_scale": torch.full((40, 2), 0x7F, dtype=torch.uint8).view(F8)}, {},
     QuantizationError, "NaN"),
    ("nvfp4 block scale zero", NVFP4, NV_OK, {"weight_scale": torch.zeros(40, 2).to(F8)}, {}, QuantizationError,
     "> 0"),
    ("nvfp4 missing global", NVFP4, NV_OK, {"weight_scale_2": None}, {}, QuantizationError,
     "lm_head.weight_scale_2 is missing"),
    ("nvfp4 negative global", NVFP4, NV_OK, {"weight_scale_2": torch.tensor(-2.0)}, {}, QuantizationError,
     "lm_head.weight_scale_2"),
    ("nvfp4 missing block scales", NVFP4, NV_OK, {"weight_scale": None}, {}, QuantizationError,
     "lm_head.weight_scale is missing"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_tensors_raise_typed_errors(case):
    _, algo, base, changes, kwargs, error, match = case
    with pytest.raises(error, match=match):
        _load(algo, _bad(base, **changes), **kwargs)


def test_bad_configs_raise_typed_errors():
    with pytest.raises(QuantizationError, match=r"lm_head.weight.*multiple of 16"):
        LMHead(40, 24, quant_config=QuantConfig(quant_algo=NVFP4, activation="none"))
    with pytest.raises(QuantizationError, match="activation"):
        LMHead(40, 32, quant_config=QuantConfig(quant_algo=NVFP4, activation="dynamic"))
    with pytest.raises(QuantizationError, match="group_size"):
        LMHead(40, 32, quant_config=QuantConfig(quant_algo=NVFP4, activation="none", group_size=32))
    with pytest.raises(QuantizationError, match="not supported"):
        LMHead(40, 32, quant_config=QuantConfig(quant_algo=QuantAlgo.W4A16_AWQ))
    # A dense head refuses quantized tensors instead of reading their bytes as numbers.
    with pytest.raises(CheckpointError, match="quantization tensors"):
        LMHead(40, 32).load_weights(FP8_OK)


def test_dense_lm_head_from_quantized_checkpoint_bytes_refused_by_dtype(tmp_path):
    # Quantized bytes but no scale at all: the gate refuses them rather than reading FP8 as dense.
    tensors = {"lm_head.weight": FP8_OK["lm_head.weight"]}
    path = write_ckpt(tmp_path / "ckpt", tensors, hf_quant=hf_quant("FP8"))
    with pytest.raises(QuantizationError, match="weight_scale is missing"):
        LMHead.from_checkpoint(path)


# ---- a checkpoint exported by ModelOpt itself (CPU calibration + export_hf_checkpoint) -------------------------
@pytest.fixture(scope="module")
def modelopt_export(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq = pytest.importorskip("modelopt.torch.quantization")
        export = pytest.importorskip("modelopt.torch.export")

    def build(algo: str) -> tuple[Path, torch.Tensor]:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                       tie_word_embeddings=False, max_position_embeddings=64,
                                       architectures=["LlamaForCausalLM"])
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
        qcfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG if algo == "FP8" else mtq.NVFP4_DEFAULT_CFG)
        entries = {e["quantizer_name"]: e for e in qcfg["quant_cfg"]}
        # The default configs disable "*lm_head*"; later entries win, so enable the head's
        # weight and input quantizers with the same settings as every other linear layer.
        for q in ("weight_quantizer", "input_quantizer"):
            qcfg["quant_cfg"].append({"quantizer_name": f"*lm_head*{q}", "cfg": entries[f"*{q}"]["cfg"]})
        ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mtq.quantize(model, qcfg, forward_loop=lambda m: m(ids))
            original = model.lm_head.weight.detach().clone()
            out = tmp_path_factory.mktemp(f"modelopt_{algo.lower()}")
            export.export_hf_checkpoint(model, export_dir=str(out))
        return out, original

    return build


@pytest.mark.model
@pytest.mark.parametrize("algo", ["FP8", "NVFP4"])
def test_loads_checkpoint_exported_by_modelopt(modelopt_export, algo):
    path, original = modelopt_export(algo)
    ckpt = Checkpoint(path)
    assert ckpt.info("lm_head.weight").dtype == ("F8_E4M3" if algo == "FP8" else "U8")
    head = LMHead.from_checkpoint(path)
    config = head.quant_decision.config
    assert config is not None and config.quant_algo.value == algo and config.activation == "static"
    tensors = {name: ckpt.read(name) for name in ckpt.names() if name.startswith("lm_head.")}
    want_w = ref_weight(tensors)
    assert torch.equal(head.weights.dense_weight(), want_w)
    x = hidden(4, 64, seed=5)
    ref = ref_logits(x, tensors, QuantAlgo(algo), "static")
    assert rel_error(head(x), ref) < 1e-6
    if algo == "NVFP4":
        # ModelOpt's export and trtvocab's quantizer write the same bytes for the same weight.
        packed, bs, g = quantize_head_tensors(original, QuantConfig(quant_algo=NVFP4, activation="none")).values()
        assert torch.equal(g, tensors["lm_head.weight_scale_2"])
        assert torch.equal(bs.view(torch.uint8), tensors["lm_head.weight_scale"].view(torch.uint8))
        assert torch.equal(packed, tensors["lm_head.weight"])
    else:
        assert torch.equal(tensors["lm_head.weight_scale"], original.float().abs().amax() / 448)
    # A rank's rows of the exported file, read lazily: packed rows and block scales together.
    shard = vocab_shard(500, 3, 1)
    lazy = {k.split(".")[-1]: ckpt.get_slice(k) for k in tensors if k != "lm_head.input_scale"}
    assert torch.equal(dequantize_stored(WeightFormat(algo), lazy, shard, 64), want_w[shard.start : shard.end])
