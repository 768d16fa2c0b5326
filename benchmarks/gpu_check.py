"""One prepared command for the first GPU: ``make gpu-check`` (``python benchmarks/gpu_check.py``).

Without CUDA it says so in one line and exits 0. With CUDA it runs, within a time budget
(``--budget-s``, default 540 s), and prints one report (what ran, what was skipped and why,
the figures), also written as JSON (``--out``, default ``artifacts/gpu_check.json``):

1. **CUDA fallback parity**: every weight format (dense bf16, FP8 W8A8 / dynamic / W8A16,
   NVFP4 W4A4 / W4A16) on the GPU against the same head on the CPU, uneven tp shards included.
2. **NCCL parity**: a tp head split over ``min(GPUs, 4)`` ranks on NCCL against the
   single-device head (needs >= 2 GPUs: NCCL refuses two ranks on one GPU, so one GPU is
   reported as skipped, with that reason).
3. **FP8 GEMM**: ``torch._scaled_mm`` on the FP8 head's operands (compute capability >= 8.9)
   against the dequantized float32 product.
4. **Head benchmarks**: bf16 GEMM time and TFLOP/s at B = 1, 256, 1024 (V = 129280,
   H = 5120), and FP8 (``_scaled_mm``) vs bf16 at B >= 256, side by side.
5. **Vocab tree and chunked head on the device**: the tree logsumexp (torch ops there; the C++
   kernel is CPU only) against float64 and its time beside ``torch.logsumexp`` at B = 1, 64, 1024
   (V = 129280); whether chunked greedy / logsumexp / top-p sample equal the materialized path
   bitwise there (reported, not failed: cuBLAS may pick other kernels for narrower GEMMs).
6. **TensorRT**: build and run the default recipe's engine where ``import tensorrt`` works.
7. **The prepared decode step on the device** (``trtvocab.sampling.DecodeStep``): every knob's eager step
   under ``torch.cuda.set_sync_debug_mode("error")`` (a sync inside the step raises), the step captured in
   a ``torch.cuda.CUDAGraph`` and replayed (ids and logprobs equal the eager step's, bitwise), and
   ``torch.compile(mode="reduce-overhead")`` of it (the same ids); the time of an eager step, a replay
   and a compiled call at B = 1, 8, 64.

This script has not run on a GPU yet: the development machines have none.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from _harness import add_json, recording

REPORT: dict[str, Any] = {"ran": [], "skipped": {}, "figures": {}, "failed": {}}


def _section(name: str, fn: Any, deadline: float) -> None:
    if time.monotonic() > deadline:
        REPORT["skipped"][name] = "time budget used up"
        return
    start = time.monotonic()
    try:
        result = fn()
    except Exception as exc:  # report and go on: one broken section must not hide the others
        REPORT["failed"][name] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        return
    if isinstance(result, str):
        REPORT["skipped"][name] = result
        return
    REPORT["ran"].append(name)
    REPORT["figures"][name] = {**(result or {}), "seconds": round(time.monotonic() - start, 2)}


def _heads(vocab: int, hidden: int) -> list[tuple[str, Any, dict[str, torch.Tensor]]]:
    from trtvocab import QuantAlgo, QuantConfig
    from trtvocab.quant.writer import quantize_head_tensors

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5
    out: list[tuple[str, Any, dict[str, torch.Tensor]]] = [("dense bf16", None, {"weight": w.bfloat16()})]
    for algo, activation in ((QuantAlgo.FP8, "static"), (QuantAlgo.FP8, "dynamic"), (QuantAlgo.FP8, "none"),
                             (QuantAlgo.NVFP4, "static"), (QuantAlgo.NVFP4, "none")):
        qc = QuantConfig(quant_algo=algo, activation=activation)
        out.append((qc.label, qc, quantize_head_tensors(w, qc, input_amax=torch.tensor(3.0))))
    return out


def cuda_fallback_parity() -> dict[str, Any]:
    from trtvocab import LMHead, Mapping

    vocab, hidden = 10007, 1024
    x = torch.randn(17, hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
    errors = {}
    for label, qc, tensors in _heads(vocab, hidden):
        for tp, rank in ((1, 0), (3, 1)):
            mapping = Mapping(world_size=tp, rank=rank, tp_size=tp) if tp > 1 else None
            cpu = LMHead(vocab, hidden, mapping=mapping, quant_config=qc, gather_output=False)
            cpu.load_weights(tensors)
            gpu = LMHead(vocab, hidden, mapping=mapping, quant_config=qc, gather_output=False, device="cuda")
            gpu.load_weights({k: v.cuda() for k, v in tensors.items()})
            want = cpu.local_logits(x).float()
            got = gpu.local_logits(x.cuda()).float().cpu()
            rel = float((got - want).abs().max() / want.abs().max())
            errors[f"{label} tp={tp} rank={rank}"] = rel
            if rel > 2e-2:
                raise AssertionError(f"{label} tp={tp}: CUDA differs from CPU by {rel:.3g} of max|logit|")
    return {"max_rel_err": errors}


def _nccl_rank(rank: int, world: int) -> float:
    from trtvocab import LMHead, Mapping

    vocab, hidden = 30011, 512
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(vocab, hidden, generator=gen).bfloat16()
    x = torch.randn(9, hidden, generator=gen).bfloat16().cuda()
    head = LMHead(vocab, hidden, mapping=Mapping(world_size=world, rank=rank, tp_size=world), device="cuda")
    head.load_weights({"weight": w.cuda()})
    single = LMHead(vocab, hidden, device="cuda")
    single.load_weights({"weight": w.cuda()})
    y, y1 = head(x).float(), single(x).float()
    if not torch.equal(y.argmax(-1), y1.argmax(-1)):
        raise AssertionError("NCCL tp head: argmax differs from the single-device head")
    return float((y - y1).abs().max())


def nccl_parity() -> dict[str, Any] | str:
    n = torch.cuda.device_count()
    if n < 2:
        return "one GPU: NCCL refuses two ranks on the same device (needs >= 2 GPUs)"
    from trtvocab.parallel.launch import run_ranks

    world = min(n, 4)
    errs = run_ranks(_nccl_rank, world, timeout_s=120)
    return {"tp": world, "max_abs_diff_vs_single": max(errs)}


def scaled_mm_fp8() -> dict[str, Any] | str:
    cc = torch.cuda.get_device_capability()
    if cc < (8, 9) or not hasattr(torch, "_scaled_mm"):
        return f"compute capability {cc[0]}.{cc[1]} < 8.9 (or no torch._scaled_mm): no FP8 GEMM"
    from trtvocab.quant import fp8

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(4096, 1024, generator=gen) * 0.03
    x = torch.randn(256, 1024, generator=gen)
    qw, sw = fp8.quantize_fp8(w)
    qx, sx = fp8.quantize_fp8(x)
    got = torch._scaled_mm(qx.cuda(), qw.cuda().t(), scale_a=sx.cuda(), scale_b=sw.cuda(), out_dtype=torch.float32)
    want = (qx.float() * sx) @ (qw.float() * sw).t()
    return {"max_rel_err": float((got.cpu() - want).abs().max() / want.abs().max())}


def head_benchmarks() -> dict[str, Any]:
    vocab, hidden = 129280, 5120
    w = (torch.randn(vocab, hidden, device="cuda") * 0.01).bfloat16()
    out: dict[str, Any] = {}
    for batch in (1, 256, 1024):
        x = torch.randn(batch, hidden, device="cuda").bfloat16()
        seconds = _time_cuda(lambda x=x: x @ w.t())
        out[f"bf16 B={batch}"] = {"ms": seconds * 1e3, "tflops": 2 * batch * vocab * hidden / seconds / 1e12}
    if torch.cuda.get_device_capability() >= (8, 9) and hasattr(torch, "_scaled_mm"):
        wq = w.float().clamp(-448, 448).to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        for batch in (256, 1024):
            xq = torch.randn(batch, hidden, device="cuda").to(torch.float8_e4m3fn)
            seconds = _time_cuda(lambda xq=xq: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                                  out_dtype=torch.bfloat16))
            out[f"fp8 B={batch}"] = {"ms": seconds * 1e3, "vs_bf16": out[f"bf16 B={batch}"]["ms"] / (seconds * 1e3)}
    return out


def vocab_tree(device: str = "cuda") -> dict[str, Any]:
    from trtvocab import LMHead, sampling
    from trtvocab.sampling import SamplingParams, chunked, treesum

    def tree(x: torch.Tensor) -> torch.Tensor:
        return treesum.tree_logsumexp(x, 0, x.shape[1], 1, None, [(0, x.shape[1])])[1]

    out: dict[str, Any] = {}
    vocab = 129280
    for batch in (1, 64, 1024):
        x = torch.randn(batch, vocab, device=device) * 3
        lse = tree(x)
        out[f"tree B={batch}"] = {
            "max_abs_err_vs_float64": float((lse.double() - torch.logsumexp(x.double(), 1)).abs().max()),
            "ms": _time(lambda x=x: tree(x), device) * 1e3,
            "torch_logsumexp_ms": _time(lambda x=x: torch.logsumexp(x, 1), device) * 1e3}
    head = LMHead(32768, 1024, dtype=torch.bfloat16, device=device, logits_budget_bytes=8 << 20)
    head.load_weights({"weight": (torch.randn(32768, 1024) * 0.03).bfloat16().to(device)})
    hidden = (torch.randn(256, 1024) * 4).bfloat16().to(device)
    local = head.local_logits(hidden)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    out["chunked == materialized (bitwise)"] = {
        "greedy": bool(torch.equal(chunked.stream_greedy(hidden, head), sampling.greedy(local, head))),
        "logsumexp": bool(torch.equal(chunked.stream_logsumexp(hidden, head), sampling.logsumexp(local, head))),
        "sample top-p": bool(torch.equal(chunked.stream_sample(hidden, head, params),
                                         sampling.sample(local, head, params)))}
    return out


def _time(fn: Any, device: str) -> float:
    if device == "cuda":
        return _time_cuda(fn)
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - start) / 3


def _time_cuda(fn: Any, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def tensorrt_engine() -> dict[str, Any] | str:
    """The default-compiler engines run on this GPU against the PyTorch fallback: standard TensorRT
    where it imports, else TensorRT-RTX where this GPU is one of its targets (not Hopper/SM100)."""
    from trtvocab.export.targets import RTX_TARGETS, target_name
    from trtvocab.export.tensorrt import tensorrt_available

    target = target_name(torch.cuda.get_device_capability())
    ok, reason = tensorrt_available("tensorrt")
    compiler, targets = "tensorrt", None
    if not ok:
        rtx_ok, rtx_reason = tensorrt_available("tensorrt-rtx")
        if not rtx_ok:
            return f"{reason}; {rtx_reason}"
        if target not in RTX_TARGETS:
            return (f"{reason}; TensorRT-RTX is installed but cannot target this GPU ({target}): "
                    "Hopper and data-center Blackwell need standard TensorRT")
        compiler, targets = "tensorrt-rtx", [target]
    from trtvocab.artifact.recipe import load_recipe
    from trtvocab.pipeline.build import build
    from trtvocab.pipeline.infer import infer

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "builders" / "minilm.toml")
    recipe = recipe.model_copy(update={"engine": recipe.engine.model_copy(
        update={"require": True, "compiler": compiler, "targets": targets})})
    root, manifest = build(recipe, Path("artifacts") / "gpu_check_engine", force=True)
    hidden = torch.randn(6, manifest.head.hidden_size)
    by_engine = infer(root, hidden, torch.tensor([2, 4]), "tensorrt").logits
    by_torch = infer(root, hidden, torch.tensor([2, 4]), "torch").logits
    return {"compiler": compiler, "targets": manifest.ranks[0].engine.build.targets,
            "max_abs_diff_vs_torch": float((by_engine - by_torch).abs().max()),
            "argmax_equal": bool(torch.equal(by_engine.argmax(-1), by_torch.argmax(-1)))}


def decode_step_capture() -> dict[str, Any]:
    """Section 7 (module docstring): a dense bf16 head on the GPU, V = 49152, H = 576 (SmolLM2's shape)."""
    from trtvocab import LMHead
    from trtvocab.sampling import DecodeStep, SamplingParams

    vocab, hidden = 49152, 576
    head = LMHead(vocab, hidden, gather_output=False, device="cuda")
    head.load_weights({"weight": (torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0))
                                  * hidden**-0.5).bfloat16().cuda()})
    knobs = {"greedy": SamplingParams(temperature=0.0),
             "top-k + top-p": SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1),
             "min-p + penalties + bias": SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.2,
                                                        logit_bias={5: 2.0}, seed=2),
             "typical-p + logprobs": SamplingParams(temperature=1.0, typical_p=0.9, logprobs=5, seed=3)}
    out: dict[str, Any] = {}
    for name, p in knobs.items():
        for rows in (1, 8, 64):
            x = torch.randn(rows, hidden, device="cuda").bfloat16()
            eager, captured = DecodeStep(head, [p] * rows), DecodeStep(head, [p] * rows)
            captured.seed_keys = eager.seed_keys
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(3):  # warm (allocator, cuBLAS handles) on a side stream, as capture wants
                    eager(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    captured(x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                got = captured(x)
            graph.replay()
            eager(x)
            torch.cuda.synchronize()
            same = eager.last_output.token_ids.cpu().tolist() == got.cpu().tolist()
            t_eager = _time_cuda(lambda e=eager, x=x: e(x))
            t_graph = _time_cuda(graph.replay)
            out[f"{name} B={rows}"] = {"replay_equals_eager": same, "eager_ms": t_eager, "replay_ms": t_graph}
            if not same:
                raise AssertionError(f"{name} B={rows}: the replayed step's ids differ from the eager step's")
    compiled = torch.compile(DecodeStep(head, [knobs["top-k + top-p"]] * 8), mode="reduce-overhead", fullgraph=True)
    x = torch.randn(8, hidden, device="cuda").bfloat16()
    for _ in range(3):
        compiled(x)
    out["reduce-overhead compiled_ms"] = _time_cuda(lambda: compiled(x))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--out", type=Path, default=Path("artifacts") / "gpu_check.json")
    add_json(parser)
    args = parser.parse_args()
    with recording("gpu_check", args):
        if not torch.cuda.is_available():
            print(f"gpu-check: no CUDA device here (torch {torch.__version__}); nothing to check")
            return 0
        REPORT["device"] = {"name": torch.cuda.get_device_name(), "count": torch.cuda.device_count(),
                            "compute_capability": ".".join(map(str, torch.cuda.get_device_capability())),
                            "torch": torch.__version__}
        deadline = time.monotonic() + args.budget_s
        for name, fn in (("cuda fallback parity", cuda_fallback_parity), ("nccl parity", nccl_parity),
                         ("fp8 _scaled_mm", scaled_mm_fp8), ("head benchmarks", head_benchmarks),
                         ("vocab tree", vocab_tree), ("tensorrt engine", tensorrt_engine),
                         ("decode step capture", decode_step_capture)):
            _section(name, fn, deadline)
        print(json.dumps(REPORT, indent=2))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(REPORT, indent=2))
        print(f"gpu-check: {len(REPORT['ran'])} ran, {len(REPORT['skipped'])} skipped, {len(REPORT['failed'])} failed; "
              f"report in {args.out}")
        return 1 if REPORT["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
