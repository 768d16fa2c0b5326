"""Hostile inputs, fourth round: a value that passes its own check but makes a non-finite or absorbed number
downstream (the report's causes H1-H3, M1, M2 and the Low ones; each test names its cause).

Every input here is refused where it enters -- a GGUF block scale at load, a LoRA scaling or factor at
``load_adapter``, a sampling knob in ``SamplingParams``, a family field in ``config.json`` or GGUF metadata --
with a typed error naming it (on the command line: exit 2 and one ``error:`` line). docs/threat_model.md,
"Bounds where a value enters".
"""

from __future__ import annotations

import json
import os
import struct
import sys
import types
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.checkpoints.test_hostile_checkpoint import deadline
from tests.commands.test_hostile import assert_cli_error, cli
from tests.weights.test_gguf_blocks import random_blocks
from trtvocab import ArchitectureError, CheckpointError, LMHead, Mapping, VocabParallelEmbedding
from trtvocab.errors import AdapterError, ConfigError, InputError
from trtvocab.quant.gguf_blocks import GGUFConfig
from trtvocab.sampling import SamplingParams, TokenState, sample

Q = gguf.GGMLQuantizationType
V = 64
HIDDEN = {"Q8_0": 64, "Q6_K": 256, "Q4_0": 64, "Q4_1": 64, "Q5_0": 64, "Q4_K": 256}
# Each block type's fp16 scales and their byte offsets (gguf.quants' layout; the report's table).
SCALES = {"Q8_0": (("d", 0),), "Q4_0": (("d", 0),), "Q5_0": (("d", 0),), "Q4_1": (("d", 0), ("m", 2)),
          "Q6_K": (("d", 208),), "Q4_K": (("d", 0), ("dmin", 2))}
SCALE_CASES = [(bt, name, at) for bt, scales in SCALES.items() for name, at in scales]
NAN, INF = 0x7E00, 0x7C00  # fp16 NaN, +inf
BAD_TOKEN = 40  # rank 1's shard at tp 2 ([32, 64))


def write_blocks_gguf(path: Path, block_type: str, *, bad: tuple[int, int] | None = None, arch: str = "llama",
                      tokens: int = V, rows: int = V, meta: dict[str, Any] | None = None,
                      bias: np.ndarray | None = None) -> Path:
    """A GGUF file whose tied head ``token_embd.weight [rows, H]`` is stored as ``block_type``; ``bad``:
    ``(byte offset of a scale in the block, fp16 bits)`` written into token :data:`BAD_TOKEN`'s block 0."""
    hidden = HIDDEN[block_type]
    raw = random_blocks(block_type, rows, hidden)
    if bad is not None:
        at, bits = bad
        raw[BAD_TOKEN, at : at + 2] = np.frombuffer(struct.pack("<H", bits), np.uint8)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.embedding_length", hidden)
    writer.add_uint32(f"{arch}.block_count", 1)
    writer.add_uint32(f"{arch}.context_length", 128)
    for key, value in (meta or {}).items():
        getattr(writer, f"add_{value[0]}")(f"{arch}.{key}", value[1])
    writer.add_token_list([f"t{i}" for i in range(tokens)])
    writer.add_tensor("token_embd.weight", raw, raw_dtype=Q[block_type])
    if bias is not None:
        writer.add_tensor("output.weight", raw, raw_dtype=Q[block_type])
        writer.add_tensor("output.bias", bias)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ==== H1: GGUF block scales ===================================================================================
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


# ==== H2: LoRA scaling and factors; +inf made where data enters =============================================
def _ckpt(root: Path, **config: Any) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    w = torch.randn(V, 32, generator=torch.Generator().manual_seed(0))
    save_file({"lm_head.weight": w, "model.embed_tokens.weight": w.clone()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": V, "hidden_size": 32,
                                                  "tie_word_embeddings": False, **config}))
    return root


def _adapter(root: Path, *, a: torch.Tensor | None = None, b: torch.Tensor | None = None, **config: Any) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 8, "target_modules": ["lm_head"], **config}
    (root / "adapter_config.json").write_text(json.dumps(cfg))
    g, r = torch.Generator().manual_seed(1), cfg["r"]
    save_file({"base_model.model.lm_head.lora_A.weight": torch.randn(r, 32, generator=g) * 0.01 if a is None else a,
               "base_model.model.lm_head.lora_B.weight": torch.randn(V, r, generator=g) * 0.01 if b is None else b},
              str(root / "adapter_model.safetensors"))
    return root


@pytest.mark.parametrize(("config", "field"), [
    ({"lora_alpha": 1e308}, "lora_alpha"), ({"lora_alpha": -1e300}, "lora_alpha"),
    ({"alpha_pattern": {"lm_head": 1e300}}, "alpha_pattern"), ({"lora_alpha": 2.0**26, "r": 2}, "lora_alpha"),
    ({"lora_alpha": 2.0**25, "use_rslora": True, "r": 1}, "lora_alpha"),
])
def test_h2_lora_scaling_is_bounded_like_the_family_factors(tmp_path: Path, config: dict, field: str) -> None:
    head = LMHead.from_checkpoint(_ckpt(tmp_path / "ck"), dtype=torch.float32)
    with pytest.raises(AdapterError, match=rf"adapter_config.json: {field} for lm_head .*outside \[-2\^24, 2\^24\]"):
        head.load_adapter(_adapter(tmp_path / "a", **config))
    head.load_adapter(_adapter(tmp_path / "ok", lora_alpha=2.0**24, r=1))  # the bound itself loads


def test_h2_a_finite_factor_whose_product_overflows_is_refused(tmp_path: Path) -> None:
    head = LMHead.from_checkpoint(_ckpt(tmp_path / "ck"), dtype=torch.float32)
    b = torch.randn(V, 2) * 0.01
    b[9] = 3e38  # finite in float32, but s * (x @ A.T) @ B.T is inf
    with pytest.raises(AdapterError, match=r"lora_A.weight and .*lora_B.weight .*past float32's range"):
        head.load_adapter(_adapter(tmp_path / "a", b=b))
    with pytest.raises(AdapterError, match=r"lora_B.weight holds NaN or inf \(in float32\)"):
        head.load_adapter(_adapter(tmp_path / "f64", b=torch.full((V, 2), 1e300, dtype=torch.float64)))


def test_h2_a_float32_checkpoint_that_overflows_a_float16_head_is_refused(tmp_path: Path) -> None:
    w = torch.randn(V, 32)
    w[11, 3] = 1e5  # finite in float32, inf in float16
    head = LMHead(V, 32, dtype=torch.float16)
    with pytest.raises(CheckpointError, match=r"row 11 .*once cast from torch.float32 to the head's torch.float16"):
        head.load_weights({"weight": w})


def test_h2_cli_compare_lora_refuses_a_huge_alpha(tmp_path: Path) -> None:
    ck = _ckpt(tmp_path / "ck")
    save_file({"hidden_states": torch.randn(6, 32)}, str(tmp_path / "h.safetensors"))
    code, text = cli("compare", str(ck), "--hidden", str(tmp_path / "h.safetensors"), "--bootstrap", "0",
                     "--lora", f"a={_adapter(tmp_path / 'huge', lora_alpha=1e308)}")
    assert_cli_error(code, text, "AdapterError", "lora_alpha", "2^24")
    assert "nan" not in text.lower().replace("nan or inf", "")


# ==== M2 and Low: adapter tensor dtypes; the FIFO message ===================================================
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.bool])
def test_m2_float8_int_and_bool_factors_are_typed_errors(tmp_path: Path, dtype: torch.dtype) -> None:
    head = LMHead.from_checkpoint(_ckpt(tmp_path / "ck"), dtype=torch.float32)
    a = torch.ones(2, 32).to(dtype)
    with pytest.raises(AdapterError, match=rf"lora_A.weight is stored as {dtype}"):
        head.load_adapter(_adapter(tmp_path / "a", a=a))


def test_m2_cli_compare_float8_adapter_is_one_error_line(tmp_path: Path) -> None:
    ck = _ckpt(tmp_path / "ck")
    save_file({"hidden_states": torch.randn(6, 32)}, str(tmp_path / "h.safetensors"))
    bad = _adapter(tmp_path / "f8", a=torch.ones(2, 32).to(torch.float8_e4m3fn))
    code, text = cli("compare", str(ck), "--hidden", str(tmp_path / "h.safetensors"), "--bootstrap", "0",
                     "--lora", f"a={bad}")
    assert_cli_error(code, text, "AdapterError", "float8_e4m3fn")


def test_low_a_fifo_adapter_weights_file_is_named_as_a_fifo(tmp_path: Path) -> None:
    from trtvocab.weights.lora import open_adapter

    folder = tmp_path / "fifo"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 8}))
    os.mkfifo(folder / "adapter_model.safetensors")
    with deadline(10), pytest.raises(AdapterError, match=r"adapter_model.safetensors: is a FIFO.*regular file"):
        open_adapter(folder)


# ==== H3: logit_bias and repetition_penalty =================================================================
@pytest.mark.parametrize("bias", [1e30, 100.5, -1e300, float("inf"), float("nan"), 10**400])
def test_h3_logit_bias_is_bounded_to_plus_minus_100(bias: float) -> None:
    with pytest.raises(InputError, match=r"SamplingParams.logit_bias: bias of id 7 must be a number in \[-100, 100\]"):
        SamplingParams(logit_bias={7: bias})


def test_h3_bias_100_and_the_explicit_minus_inf_ban_keep_the_odds() -> None:
    torch.manual_seed(0)
    head = LMHead(V, 32, dtype=torch.float32)
    head.load_weights({"weight": torch.randn(V, 32)})
    y = head(torch.randn(3, 32))
    draws = torch.stack([sample(y, head, SamplingParams(temperature=1.0, seed=s, logit_bias={7: 100, 9: 100}))
                         for s in range(200)])
    share = float((draws[:, 0] == 9).double().mean())
    want = float(torch.softmax(y[0, [7, 9]].double(), 0)[1])
    assert set(draws.unique().tolist()) <= {7, 9} and abs(share - want) < 0.12, (share, want)
    top = int(y[0].argmax())
    banned = sample(y, head, SamplingParams(temperature=0.0, logit_bias={top: float("-inf")}))
    assert int(banned[0]) != top  # -inf: a documented ban


@pytest.mark.parametrize("penalty", [1e-45, 1e-38, 1e-3, 0.0099, 100.5, 1e30])
def test_h3_repetition_penalty_is_bounded(penalty: float) -> None:
    with pytest.raises(InputError, match=r"SamplingParams.repetition_penalty: must be in \[0.01, 100\]"):
        SamplingParams(repetition_penalty=penalty)


def test_h3_repetition_penalty_at_its_bounds_keeps_the_greedy_order() -> None:
    torch.manual_seed(0)
    head = LMHead(V, 32, dtype=torch.float32)
    head.load_weights({"weight": torch.randn(V, 32)})
    y = head(torch.randn(3, 32))
    state = TokenState.for_head(head, [list(range(V))] * 3)  # every id seen: the penalty keeps the order
    for penalty in (0.01, 100.0):
        got = sample(y, head, SamplingParams(temperature=0.0, repetition_penalty=penalty), state=state)
        assert torch.equal(got, y.argmax(1)), (penalty, got)


@pytest.mark.parametrize(("flags", "option"), [
    (["--logit-bias", "12=1e30", "--logit-bias", "7042=1e30"], "--logit-bias"),
    (["--logit-bias", "12=inf"], "--logit-bias"),
    (["--repetition-penalty", "1e-45"], "--repetition-penalty"),
    (["--repetition-penalty", "1e3"], "--repetition-penalty"),
    (["--lora", "a=x", "--lora", "b=y", "--lora-for", "0=a", "--lora-for", "0=b"], "--lora-for"),
])
def test_h3_cli_generate_refuses_before_the_model_loads(tmp_path: Path, flags: list[str], option: str) -> None:
    with deadline(30):  # no model at this path: the refusal comes first
        code, text = cli("generate", str(tmp_path / "no-model"), "--prompt", "x", *flags)
    assert_cli_error(code, text, option)


# ==== M1: family fields -- absent only when None ============================================================
@pytest.mark.parametrize(("model_type", "field"), [
    ("gemma2", "final_logit_softcapping"), ("cohere", "logit_scale"), ("granite", "logits_scaling"),
    ("hyperclovax", "logits_scaling"), ("falcon_h1", "lm_head_multiplier"), ("minicpm3", "scale_emb"),
    ("my_new_arch", "logit_scale"), ("my_new_arch", "final_logit_softcapping"),
])
@pytest.mark.parametrize("value", [0, 0.0, -0.0, False, True])
def test_m1_zero_false_and_true_are_values_not_absent(tmp_path: Path, model_type: str, field: str,
                                                      value: Any) -> None:
    path = _ckpt(tmp_path / "m", model_type=model_type, **{field: value})
    with pytest.raises(ArchitectureError, match=field):
        LMHead.from_checkpoint(path, dtype=torch.float32)
        VocabParallelEmbedding.from_checkpoint(path, dtype=torch.float32)  # minicpm3: the embedding's field


def test_m1_neutral_values_still_load(tmp_path: Path) -> None:
    path = _ckpt(tmp_path / "n", model_type="my_new_arch", logits_scaling=1.0, logit_scale=1, scale_embedding=False,
                 final_logit_softcapping=None)
    assert LMHead.from_checkpoint(path, dtype=torch.float32).head_ops.is_identity
    with pytest.raises(ArchitectureError, match="final_logit_softcapping"):  # a cap of 1 squashes the logits
        LMHead.from_checkpoint(_ckpt(tmp_path / "c", model_type="my_new_arch", final_logit_softcapping=1.0),
                               dtype=torch.float32)
    with pytest.raises(ArchitectureError, match="scale_embedding"):
        VocabParallelEmbedding.from_checkpoint(_ckpt(tmp_path / "x", model_type="xglm", scale_embedding=1),
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


# ==== round 2's leftover: a GGUF's vocabulary is its own, named with the file ================================
@pytest.mark.parametrize(("tokens", "rows"), [(70, 64), (64, 128)])
def test_r2_gguf_row_mismatch_names_the_file_not_config_json(tmp_path: Path, tokens: int, rows: int) -> None:
    path = write_blocks_gguf(tmp_path / "m.gguf", "Q8_0", tokens=tokens, rows=rows)
    with pytest.raises(CheckpointError) as err:
        LMHead.from_checkpoint(path, dtype=torch.float32)
    text = str(err.value)
    assert "config.json" not in text and str(path) in text and "tokenizer.ggml.tokens" in text, text
    assert f"has {rows} rows" in text and f"is {tokens}" in text, text


# ==== the other Low causes =================================================================================
@pytest.mark.parametrize("kwargs", [{"block_type": "Q5_1"}, {"block_type": "q8_0"},
                                    {"block_type": "Q8_0", "extra": 1}, {"block_type": "Q8_0", "activation": "fp8"}])
def test_low_gguf_config_errors_are_config_errors(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match=r"GGUFConfig: (block_type|extra|activation)"):
        GGUFConfig(**kwargs)


def test_low_an_int32_gguf_bias_is_refused(tmp_path: Path) -> None:
    path = write_blocks_gguf(tmp_path / "b.gguf", "Q8_0", arch="phi2", bias=np.arange(V, dtype=np.int32))
    with pytest.raises(CheckpointError, match=r"b.gguf: lm_head.bias: the head's bias is stored as torch.int32"):
        LMHead.from_checkpoint(path, dtype=torch.float32)


@pytest.mark.parametrize("config", [GGUFConfig(block_type="Q8_0"), None])
def test_low_a_meta_tensor_is_a_checkpoint_error(config: GGUFConfig | None) -> None:
    head = LMHead(V, 64, dtype=torch.float32, quant_config=config)
    dtype = torch.uint8 if config is not None else torch.float32
    width = 68 if config is not None else 64
    with pytest.raises(CheckpointError, match="meta tensor"):
        head.load_weights({"weight": torch.empty(V, width, dtype=dtype, device="meta")})


def test_low_the_tokenizer_cache_never_asks_about_remote_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted ``auto_map`` made transformers print its y/N prompt on stdout: every load passes
    ``trust_remote_code=False`` (no prompt, no code)."""
    from trtvocab.checkpoints import hf_loader

    calls: list[dict] = []

    class Tok:
        @staticmethod
        def from_pretrained(where: str, **kwargs: Any) -> Any:
            calls.append(kwargs)
            return types.SimpleNamespace(save_pretrained=lambda d: (Path(d) / "tokenizer_config.json").write_text("{}"))

    fake = types.SimpleNamespace(AutoTokenizer=Tok)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setenv("TRTVOCAB_CACHE_DIR", str(tmp_path / "cache"))
    hf_loader.gguf_tokenizer(model, fake)  # converts
    hf_loader.gguf_tokenizer(model, fake)  # reads the cached entry
    assert len(calls) == 2 and all(c.get("trust_remote_code") is False for c in calls), calls


def test_low_assemble_rechecks_an_existing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    from trtvocab.checkpoints import real_models

    good = b"GGUF" + b"x" * 5000
    package = types.ModuleType("fake_chunks")
    package.EXPECTED_SHA256 = hashlib.sha256(good).hexdigest()  # type: ignore[attr-defined]
    package.assemble = lambda out, **_: Path(out).write_bytes(good)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_chunks", package)
    model = real_models.RealModel("fake", "fake_chunks", "fake.gguf", "", "", assembled=True)
    monkeypatch.setattr(real_models, "MODELS", (model,))
    monkeypatch.setattr(real_models, "assembled_dir", lambda: tmp_path)
    monkeypatch.setattr(real_models.importlib.util, "find_spec", lambda name: object())
    target = real_models.assemble("fake")
    assert target.read_bytes() == good
    target.write_bytes(good[:1000])  # truncated after a first assembly
    assert real_models.assemble("fake").read_bytes() == good


# ==== the general rule: one finite check after a product of checked factors ==================================
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
    code, text = cli("compare", str(_ckpt(tmp_path / "ck")), "--hidden", str(tmp_path / "h.safetensors"),
                     "--bootstrap", "0", "--simulate", "fp8")
    assert_cli_error(code, text, "InputError", "row 3", "overflow float32")
