"""`trtvocab plan` figures against the DeepSeek-V4.1-Flash accounting (V 129280, H 5120, tp 8), to its digits."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from trtvocab.base.units import human_bytes as human
from trtvocab.commands.cli import app
from trtvocab.errors import ConfigError
from trtvocab.lm_head import FORWARD_HANDSHAKE
from trtvocab.pipeline.plan import make_plan

MIB, GIB = 2**20, 2**30


def test_deepseek_figures() -> None:
    p = make_plan(129280, 5120, 8, 256)
    # Figures from the published accounting, to the digits it gives.
    assert round(p.full_weight_bytes["bf16"] / GIB, 2) == 1.23
    assert all(round(r.weight_bytes["bf16"] / MIB, 1) == 157.8 for r in p.ranks)
    assert round(p.gathered_logits_bytes["bf16"] / MIB, 1) == 63.1
    assert round(p.gathered_logits_bytes["fp32"] / MIB, 1) == 126.2
    assert all(round(r.local_logits_bytes["bf16"] / MIB, 1) == 7.9 for r in p.ranks)
    # Per-rank figures add up to the whole.
    assert sum(r.rows for r in p.ranks) == 129280
    assert sum(r.local_logits_bytes["fp32"] for r in p.ranks) == p.gathered_logits_bytes["fp32"]


def test_quantized_bytes_ratios() -> None:
    p = make_plan(129280, 5120, 8, 1)
    w = p.full_weight_bytes
    assert w["fp8"] / w["bf16"] == pytest.approx(0.5, abs=1e-6)
    # 4 bits per value + one 8-bit scale per 16 values = 4.5 bits of 16.
    assert w["nvfp4"] / w["bf16"] == pytest.approx(4.5 / 16, abs=1e-6)


def test_uneven_allgather_pads_to_largest_shard() -> None:
    p = make_plan(10, 16, 3, 2)
    assert [r.rows for r in p.ranks] == [4, 3, 3]
    # every rank sends a piece as wide as the largest shard (gloo needs equal shapes)
    assert {r.allgather_send_bytes["bf16"] for r in p.ranks} == {2 * 4 * 2}
    assert p.ranks[1].allgather_recv_bytes["bf16"] == 2 * (2 * 4 * 2)


def test_human_units() -> None:
    assert human(1323827200) == "1.23 GiB"
    assert human(165478400) == "157.8 MiB"
    assert human(512) == "512 B"


def test_cli_plan_table_and_json() -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["plan", "--vocab", "129280", "--hidden", "5120", "--tp", "8", "--batch", "256"])
    assert res.exit_code == 0, res.output
    for figure in ("157.8 MiB", "1.23 GiB", "63.1 MiB", "126.2 MiB", "7.9 MiB"):
        assert figure in res.output
    res = runner.invoke(app, ["plan", "--vocab", "1000", "--hidden", "64", "--tp", "3", "--json"])
    data = json.loads(res.output)
    assert [r["rows"] for r in data["ranks"]] == [334, 333, 333]


def test_cli_plan_checkpoint(tmp_path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"lm_head.weight": torch.zeros(1001, 32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1001, "hidden_size": 32}))
    res = CliRunner().invoke(app, ["plan", str(tmp_path), "--tp", "4", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert (data["vocab_size"], data["hidden_size"]) == (1001, 32)
    assert [r["rows"] for r in data["ranks"]] == [251, 250, 250, 250]


def test_cli_plan_needs_shape() -> None:
    res = CliRunner().invoke(app, ["plan", "--tp", "2"])
    assert res.exit_code != 0


# ---- the ledger (both ends of the vocabulary dimension) ---------------------------------------
DEEPSEEK = ["--vocab", "129280", "--hidden", "5120", "--tp", "8", "--batch", "256", "--tokens", "8192",
            "--link-gbs", "300", "--tflops", "600"]
MB = 10**6


def _json(args: list[str]) -> dict:
    res = CliRunner().invoke(app, ["plan", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_ledger_deepseek_figures() -> None:
    d = _json([*DEEPSEEK, "--untied"])
    e, g, gr, h, m = d["embedding_allreduce"], d["logits_gather"], d["greedy"], d["head"], d["matrices"]
    # embedding all-reduce: T * H * 2 bf16, ring 2(n-1)/n of it per rank, at 300 GB/s
    assert e["payload_bytes"] == 8192 * 5120 * 2 == 83_886_080
    assert round(e["payload_bytes"] / MB, 1) == 83.9
    assert e["ring_bytes_per_rank"] == 2 * 7 * 83_886_080 // 8 == 146_800_640
    assert round(e["ring_bytes_per_rank"] / MB, 1) == 146.8
    assert e["time_s"] == pytest.approx(146_800_640 / 300e9)
    assert round(e["time_s"] * 1e3, 2) == 0.49
    # logits all-gather: B * V * (n-1)/n * 2 received per rank, at 300 GB/s
    assert g["recv_bytes_per_rank"] == 256 * 129280 * 7 // 8 * 2 == 57_917_440
    assert round(g["recv_bytes_per_rank"] / MB, 1) == 57.9
    assert round(g["time_s"] * 1e6) == 193
    assert all(r["logits_gather_recv_bytes"] == 57_917_440 for r in d["ranks"])
    # greedy: B * n pairs, sent as int64 (score, id, status) triples (48 KiB); as float32 pairs the article's 16 KB
    assert (gr["values"], gr["bytes"], gr["float32_bytes"]) == (256 * 8 * 2, 49152, 16384)
    assert gr["float32_bytes"] == 16 * 1024  # 16 KiB (binary): the "16 KB"
    # head GEMM 2 B V H at 600 TFLOP/s
    assert h["flops"] == 2 * 256 * 129280 * 5120 == 338_899_763_200
    assert round(h["flops"] / 1e9) == 339
    assert round(h["time_s"] * 1e3, 3) == 0.565
    assert h["flops_per_rank"] * 8 == h["flops"]
    # both matrices per rank, and what replicating them costs
    assert (m["tied"], m["count"]) == (False, 2)
    assert m["bytes_per_rank"] == 2 * 16160 * 5120 * 2 == 330_956_800
    assert round(m["bytes_per_rank"] / MIB, 1) == 315.6
    assert m["replicated_bytes_per_card"] == 2 * 129280 * 5120 * 2
    assert m["replicated_extra_bytes_per_card"] == 2_647_654_400 - 330_956_800 == 2_316_697_600
    assert round(m["replicated_extra_bytes_per_card"] / GIB, 2) == 2.16
    assert m["replicated_extra_bytes_total"] == 8 * 2_316_697_600
    assert round(m["replicated_extra_bytes_total"] / GIB, 1) == 17.3
    # the options land in the JSON; the defaults are the same figures
    assert (d["tokens"], d["link_gbs"], d["tflops"]) == (8192, 300.0, 600.0)
    assert _json(DEEPSEEK[:8]) == d


def test_ledger_table_prints_each_figure_in_its_unit() -> None:
    res = CliRunner().invoke(app, ["plan", *DEEPSEEK, "--untied"])
    assert res.exit_code == 0, res.output
    out = res.stdout
    for figure in ("83.9 MB", "146.8 MB", "489 us", "57.9 MB", "193 us", "16.0 KiB", "339 GFLOP", "565 us",
                   "315.6 MiB", "+2.16 GiB", "+17.26 GiB", "untied"):
        assert figure in out, figure


def test_ledger_float32_gathered_logits_at_batch_1024() -> None:
    d = _json([*DEEPSEEK[:6], "--batch", "1024"])
    fp32 = d["gathered_logits_bytes"]["fp32"]
    assert fp32 == 1024 * 129280 * 4 == 529_530_880
    # exactly 505.0 MiB (529.5 MB): not the 504.8 MiB the issue text gives
    assert fp32 / MIB == 505.0 and human(fp32) == "505.0 MiB"


def test_ledger_tied_counts_one_matrix() -> None:
    untied, tied = _json([*DEEPSEEK, "--untied"]), _json([*DEEPSEEK, "--tied"])
    mu, mt = untied["matrices"], tied["matrices"]
    assert (mt["tied"], mt["count"]) == (True, 1)
    assert mt["bytes_per_rank"] == 16160 * 5120 * 2 == mu["bytes_per_rank"] // 2
    assert mt["replicated_bytes_per_card"] == 129280 * 5120 * 2 == untied["full_weight_bytes"]["bf16"]
    assert mt["replicated_extra_bytes_per_card"] * 2 == mu["replicated_extra_bytes_per_card"]
    assert mt["replicated_extra_bytes_total"] * 2 == mu["replicated_extra_bytes_total"]
    assert all(r["matrices_bytes"] == r["weight_bytes"]["bf16"] for r in tied["ranks"])
    # the rest of the ledger does not depend on tying
    for key in ("embedding_allreduce", "logits_gather", "greedy", "head"):
        assert tied[key] == untied[key]
    # synthetic default: untied
    assert _json(DEEPSEEK)["matrices"]["tied"] is False


def _checkpoint(path, tied: bool) -> None:  # type: ignore[no-untyped-def]
    import torch
    from safetensors.torch import save_file

    tensors = {"model.embed_tokens.weight": torch.zeros(1001, 32)}
    if not tied:
        tensors["lm_head.weight"] = torch.zeros(1001, 32)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"vocab_size": 1001, "hidden_size": 32,
                                                  "tie_word_embeddings": tied}))


@pytest.mark.parametrize("tied", [True, False])
def test_ledger_checkpoint_says_tied(tmp_path, tied: bool) -> None:
    _checkpoint(tmp_path, tied)
    d = _json([str(tmp_path), "--tp", "4"])
    assert (d["matrices"]["tied"], d["matrices"]["count"]) == (tied, 1 if tied else 2)
    assert d["matrices"]["bytes_per_rank"] == (1 if tied else 2) * 251 * 32 * 2
    # the flag that agrees is accepted; the one that contradicts the checkpoint is refused
    assert _json([str(tmp_path), "--tp", "4", "--tied" if tied else "--untied"]) == d
    res = CliRunner().invoke(app, ["plan", str(tmp_path), "--tp", "4", "--untied" if tied else "--tied"])
    _assert_refused(res, "--untied" if tied else "--tied")


def test_ledger_padded_layout_counts_padding() -> None:
    # V = 10, tp = 3, pad_to = 2: V padded to 12, every rank allocates 4 columns, rank 2 owns 2
    d = _json(["--vocab", "10", "--hidden", "16", "--tp", "3", "--batch", "2", "--layout", "padded", "--pad-to", "2"])
    assert [(r["rows"], r["width"]) for r in d["ranks"]] == [(4, 4), (4, 4), (2, 4)]
    assert all(r["logits_gather_recv_bytes"] == 2 * (4 + 4) * 2 for r in d["ranks"])  # padded pieces travel
    assert d["logits_gather"]["recv_bytes_per_rank"] == 2 * 12 * 2 // 3 * 2
    assert all(r["matrices_bytes"] == 2 * 4 * 16 * 2 for r in d["ranks"])
    assert all(r["head_flops"] == 2 * 2 * 4 * 16 for r in d["ranks"])
    assert d["matrices"]["replicated_bytes_per_card"] == 2 * 10 * 16 * 2  # replication needs no padding
    assert d["matrices"]["replicated_extra_bytes_total"] == 3 * 640 - 3 * 256
    # DeepSeek padded to 64 * 8: 129280 -> 129536 columns, 16192 per rank
    p = make_plan(129280, 5120, 8, 256, "padded", 64)
    assert {r.width for r in p.ranks} == {16192} and sum(r.rows for r in p.ranks) == 129280
    assert p.logits_gather.recv_bytes_per_rank == 256 * 7 * 16192 * 2
    assert p.matrices.bytes_per_rank == 2 * 16192 * 5120 * 2


def test_ledger_uneven_gather_uses_real_widths() -> None:
    p = make_plan(10, 16, 3, 2)  # widths 4, 3, 3
    assert [r.logits_gather_recv_bytes for r in p.ranks] == [2 * 6 * 2, 2 * 7 * 2, 2 * 7 * 2]
    assert p.logits_gather.recv_bytes_per_rank == 2 * 7 * 2
    assert p.logits_gather.wire_recv_bytes_per_rank == 2 * (2 * 4 * 2)  # pad-and-trim pieces of 4
    assert sum(r.head_flops for r in p.ranks) == p.head.flops


def test_ledger_tp1_moves_nothing() -> None:
    p = make_plan(1000, 64, 1, 8)
    assert p.embedding_allreduce.ring_bytes_per_rank == 0 and p.embedding_allreduce.time_s == 0
    assert p.logits_gather.recv_bytes_per_rank == 0 and p.greedy.bytes == 0
    assert p.matrices.replicated_extra_bytes_total == 0
    assert p.embedding_allreduce.payload_bytes == 8192 * 64 * 2


def _assert_refused(res, option: str) -> None:  # type: ignore[no-untyped-def]
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ConfigError:"), lines
    assert option in lines[0], lines


@pytest.mark.parametrize(("args", "option", "allowed"), [
    (["--tp", "0"], "--tp", "[1, 100]"),
    (["--tp", "101"], "--tp", "[1, 100]"),
    (["--batch", "0"], "--batch", "[1, inf)"),
    (["--batch", "-3"], "--batch", "[1, inf)"),
    (["--hidden", "0"], "--hidden", "[1, inf)"),
    (["--hidden", "-8"], "--hidden", "[1, inf)"),
    (["--vocab", "0"], "--vocab", "[1, inf)"),
    (["--vocab", "-100"], "--vocab", "[1, inf)"),
    (["--tokens", "0"], "--tokens", "[1, inf)"),
    (["--tokens", "-1"], "--tokens", "[1, inf)"),
    (["--link-gbs", "0"], "--link-gbs", "> 0"),
    (["--link-gbs", "-300"], "--link-gbs", "> 0"),
    (["--link-gbs", "nan"], "--link-gbs", "> 0"),
    (["--tflops", "0"], "--tflops", "> 0"),
    (["--tflops", "-1.5"], "--tflops", "> 0"),
    (["--tflops", "inf"], "--tflops", "> 0"),
    (["--layout", "diagonal"], "--layout", "uneven, padded"),
    (["--pad-to", "0"], "--pad-to", "[1, inf)"),
])
def test_ledger_refuses_bad_input(args: list[str], option: str, allowed: str) -> None:
    base = {"--vocab": "100", "--hidden": "8", "--tp": "2"}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    res = CliRunner().invoke(app, ["plan", *[x for kv in base.items() for x in kv]])
    _assert_refused(res, option)
    assert allowed in res.stderr
    with pytest.raises(ConfigError, match=f"`{option[2:].replace('-', '_')}`"):  # the library names the argument
        make_plan(int(base["--vocab"]), int(base["--hidden"]), int(base["--tp"]), int(base.get("--batch", 256)),
                  base.get("--layout", "uneven"), int(base.get("--pad-to", 64)),  # type: ignore[arg-type]
                  tokens=int(base.get("--tokens", 8192)), link_gbs=float(base.get("--link-gbs", 300)),
                  tflops=float(base.get("--tflops", 600)))


def test_ledger_refuses_missing_shape() -> None:
    _assert_refused(CliRunner().invoke(app, ["plan", "--tp", "2"]), "--vocab")


# ---- every collective, KV tokens, and the article's six figures (docs/architecture.md) ------------------
def test_kv_tokens_price_replication() -> None:
    d = _json([*DEEPSEEK, "--untied", "--kv-bytes-per-token", "890"])
    kv = d["kv"]
    assert kv["kv_bytes_per_token"] == 890 and kv["kv_layers"] == 1
    assert kv["kv_tokens_replicated_extra_per_card"] == 2_316_697_600 // 890 == 2_603_031  # 2.6 M, not 24 k
    per_layer = _json([*DEEPSEEK, "--untied", "--kv-bytes-per-token", "890", "--layers", "61"])["kv"]
    assert per_layer["kv_bytes_per_token"] == 890 * 61 and per_layer["kv_tokens_replicated_extra_per_card"] == 42_672
    assert _json(DEEPSEEK)["kv"] is None


def test_the_articles_six_figures() -> None:
    d = _json([*DEEPSEEK, "--untied", "--top-p", "--typical-p"])
    assert round(d["matrices"]["replicated_extra_bytes_total"] / GIB, 1) == 17.3  # 1: not 8.6
    emb = d["embedding"]["steady"]  # 2: one all-reduce of the rows per forward
    assert [c["kind"] for c in emb] == ["all_gather", "all_reduce"] and emb[1]["bytes"] == 8192 * 5120 * 2
    assert round(d["full_weight_bytes"]["nvfp4"] / GIB, 2) == 0.35  # 4: the block scales included
    padded = _json(["--vocab", "129280", "--hidden", "5120", "--tp", "3", "--layout", "padded"])  # 5
    assert 129280 % 64 == 0 and 129280 % 3 != 0
    assert {r["width"] for r in padded["ranks"]} == {43_136}
    step = d["decode_step"]  # 6: top-p and typical-p without a gather
    rows, tree = 256, 2 * 36 * 4  # the vocab tree's (max, sum exp) float32 pairs of 129280 ids: 36 nodes
    cut = 4 * rows * 256 * 8  # four [B, 256] int64 mass histograms
    want = (rows * tree + 24) + cut + rows * tree + rows * 8 + cut + rows * 3 * 8  # header, entropy, race
    assert step["steady_bytes"] == want == 4_349_976 < d["gathered_logits_bytes"]["bf16"] // 8


def test_forward_modes_are_priced_and_bad_values_refused() -> None:
    base = ["--vocab", "1001", "--hidden", "16", "--tp", "3", "--batch", "7", "--head-dtype", "fp32"]
    whole = _json(base)["forward"]
    chunked = _json([*base, "--gather-chunk-rows", "3"])["forward"]
    rank0 = _json([*base, "--gather-output", "rank0"])["forward"]
    handshake = (1 + len(FORWARD_HANDSHAKE.fields)) * 8  # its declared fields, counted
    assert [c["bytes"] for c in whole["first"]] == [handshake, 7 * 334 * 4]
    assert [c["bytes"] for c in chunked["first"][1:]] == [3 * 334 * 4, 3 * 334 * 4, 1 * 334 * 4]
    assert [c["kind"] for c in rank0["steady"]] == ["all_gather", "gather"]
    adp = _json([*base, "--attention-dp-rows", "3,0,5"])["forward"]
    assert [c["kind"] for c in adp["steady"]] == ["all_gather", "all_gather", "all_to_all"]
    for bad in (["--gather-output", "rank1"], ["--attention-dp-rows", "1,2"], ["--head-dtype", "fp16"],
                ["--embedding-dtype", "int4"]):
        res = CliRunner().invoke(app, ["plan", *base, *bad])
        assert res.exit_code == 2 and "ConfigError" in res.output, (bad, res.output)


def test_head_groups_under_attention_dp_price_the_id_exchange_generate_makes() -> None:
    """generate's head groups each sample their own rows, then one all_gather over the world hands every
    rank every row (the id, and per asked logprob slot its id, value bits and rank): priced after the step."""
    base = ["--vocab", "1000", "--hidden", "16", "--tp", "4", "--lm-head-tp", "2", "--attention-dp-rows", "3,1,0,2"]
    for logprobs, width in ((None, 1), (2, 1 + 3 * 3)):
        d = _json([*base, *(["--logprobs", str(logprobs)] if logprobs is not None else [])])
        last = d["decode_step"]["steady"][-1]
        assert last["kind"] == "all_gather" and last["what"].startswith("head groups' ids")
        assert last["bytes"] == (3 + 1) * width * 8  # the busiest group (ranks 0-1: 4 rows), int64 words
        assert last["wire_recv_bytes"] == 3 * last["bytes"]  # from the other 3 ranks of the world
        assert d["decode_step"]["first"][-1] == last
    without = _json(["--vocab", "1000", "--hidden", "16", "--tp", "4", "--lm-head-tp", "2"])
    assert not any(c["what"].startswith("head groups' ids") for c in without["decode_step"]["steady"])
