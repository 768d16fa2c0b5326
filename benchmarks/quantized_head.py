"""Resident bytes and decode throughput of FP8 / NVFP4 LM heads against bf16, side by side.

    python benchmarks/quantized_head.py            # V=129280, H=5120 (DeepSeek-V3 sized head)
    python benchmarks/quantized_head.py --small    # V=32000, H=2048, a quick run
    python benchmarks/quantized_head.py --quick    # the full shape, the W8A16 / W4A16 / dense heads only,
                                                   # no torch-path lines (about a minute on 2 threads)

Every head keeps its weights quantized in memory. Two paths are timed on the same head:
"fused" (trtvocab.kernels: the codes are decoded inside the multiply; where the
kernels cannot be built the line says so and shows the torch path) and "torch path" (the
fallback: rows dequantized in chunks of ``trtvocab.weights.quantized.CHUNK_ELEMENTS`` float32
values, then a float32 GEMM). As peers a user might pick instead: torch's own CPU weight-only
kernels on the same shape, ``_weight_int8pack_mm`` (int8, per-row scales) and
``_weight_int4pack_mm_for_cpu`` (int4 in groups along H), bf16 activations.

For each batch B: best and median ms, speed against bf16 and against torch's int8pack and
int4pack (the faster group size) kernels (for a quantized head, its peer of the same width: FP8 /
int8pack, NVFP4 / int4pack),  weight bytes read per token (the weights are
read once per call, so per token = bytes / B), the achieved GB/s (weight bytes / best time) and
its fraction of the machine's read bandwidth, measured in the same rounds by the probe of
``benchmarks/bandwidth.py`` (a STREAM-like read of a buffer larger than the caches, with the
heads' threads). Timings interleave the variants round by round, the probe included, so that a
busy machine slows all of them alike; the ratios are the result, the absolute numbers depend on
the machine. Weight values do not change the work done, so the heads hold random valid codes
instead of a (slow) quantized copy of the bf16 matrix; accuracy is covered by the tests, not here.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import add_json, recording
from common import make_probe, random_tensors

from trtvocab import LMHead, QuantAlgo, QuantConfig, kernels
from trtvocab.kernels import library
from trtvocab.weights import quantized as methods

BATCHES = (1, 2, 4, 8, 64)
Variant = tuple[Callable[[torch.Tensor], object], int]  # (call on bf16 x, weight bytes read per call)


def build_heads(vocab: int, hidden: int) -> dict[str, LMHead]:
    gen = torch.Generator().manual_seed(0)
    heads: dict[str, LMHead] = {}
    dense = LMHead(vocab, hidden, dtype=torch.bfloat16)
    with torch.no_grad():
        dense.weights.weight.uniform_(-0.04, 0.04, generator=gen)  # in place: no second full-size copy
    heads["bf16"] = dense
    half = LMHead(vocab, hidden, dtype=torch.float16)
    with torch.no_grad():
        half.weights.weight.uniform_(-0.04, 0.04, generator=gen)
    heads["fp16"] = half
    variants = [
        ("FP8 W8A8 (dynamic)", QuantAlgo.FP8, "dynamic"),
        ("FP8 W8A16", QuantAlgo.FP8, "none"),
        ("NVFP4 W4A4", QuantAlgo.NVFP4, "static"),
        ("NVFP4 W4A16", QuantAlgo.NVFP4, "none"),
    ]
    stored = {algo: random_tensors(algo, vocab, hidden, gen) for algo in (QuantAlgo.FP8, QuantAlgo.NVFP4)}
    for name, algo, activation in variants:
        head = LMHead(vocab, hidden, dtype=torch.bfloat16, quant_config=QuantConfig(quant_algo=algo,
                                                                                   activation=activation))
        tensors = dict(stored[algo])
        if activation == "static":
            tensors["input_scale"] = torch.tensor(4.0 / (6 * 448))
        head.load_weights(tensors)
        heads[name] = head
    return heads


def torch_path(head: LMHead) -> Callable[[torch.Tensor], object]:
    def call(x: torch.Tensor) -> object:
        with kernels.library.disabled():
            return head(x)

    return call


def peers(vocab: int, hidden: int, gen: torch.Generator) -> tuple[dict[str, Variant], list[str]]:
    """torch's CPU weight-only kernels on the same shape (random weights: values do not change the work)."""
    out: dict[str, Variant] = {}
    notes: list[str] = []
    aten = torch.ops.aten
    try:
        w8 = torch.randint(-127, 128, (vocab, hidden), dtype=torch.int8, generator=gen)
        s8 = (torch.rand(vocab, generator=gen) * 1e-3).bfloat16()
        aten._weight_int8pack_mm(torch.zeros(1, hidden).bfloat16(), w8[:8], s8[:8])
        out["torch int8pack (per row)"] = (lambda x: aten._weight_int8pack_mm(x, w8, s8),
                                           w8.numel() + s8.numel() * 2)
    except (AttributeError, RuntimeError) as exc:
        notes.append(f"torch._weight_int8pack_mm unavailable: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    try:
        # The packed layout is [V, H/2] bytes (checked on a small block); random bytes are valid codes.
        probe = aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (16, hidden), dtype=torch.int32), 1)
        packed = torch.randint(0, 256, (vocab, probe.shape[1]), dtype=torch.uint8, generator=gen)
        for group in (32, 128):
            if hidden % group:
                continue
            sz = (torch.rand(hidden // group, vocab, 2, generator=gen) * 1e-3).bfloat16()
            aten._weight_int4pack_mm_for_cpu(torch.zeros(1, hidden).bfloat16(), packed[:16], group, sz[:, :16])
            out[f"torch int4pack g{group}"] = (
                lambda x, sz=sz, group=group: aten._weight_int4pack_mm_for_cpu(x, packed, group, sz),
                packed.numel() + sz.numel() * 2)
    except (AttributeError, RuntimeError) as exc:
        notes.append(f"torch._weight_int4pack_mm_for_cpu unavailable: {type(exc).__name__}: "
                     f"{str(exc).splitlines()[0]}")
    return out, notes


def time_call(fn: Callable[[torch.Tensor], object], x: torch.Tensor) -> float:
    start = time.perf_counter()
    fn(x)
    return time.perf_counter() - start


def library_call(path: str, head: LMHead) -> Callable[[torch.Tensor], object]:
    """``head`` with its FP8 / NVFP4 / dense kernels taken from another build of the library (``path``,
    e.g. an older commit's, ABI 2 or 3): before / after in the same interleaved rounds."""
    lib = ctypes.CDLL(path)
    lib.trtvocab_dense_logits.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] + \
        [ctypes.c_int64] * 2 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
    lib.trtvocab_fp8_logits.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] + \
        [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    lib.trtvocab_nvfp4_logits.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] + \
        [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64]
    # Its own path name: the dense heads take the kernel at the batches dense_max_batch gives that path.
    isa = kernels.compile.ISA_NAMES.get(lib.trtvocab_fused_isa(), "unknown")
    loaded = kernels.Loaded(lib=lib, path=path, isa=isa, seconds=0.0)

    def call(x: torch.Tensor) -> object:
        previous = library._loaded
        library._loaded = loaded
        try:
            return head(x)
        finally:
            library._loaded = previous

    return call


def dense_kernel_call(head: LMHead) -> Callable[[torch.Tensor], object]:
    """``head`` through the dense kernel at every batch it takes (``TRTVOCAB_DENSE_KERNEL=1``)."""
    def call(x: torch.Tensor) -> object:
        before = os.environ.get(kernels.gemm.DENSE_ENV_VAR)
        os.environ[kernels.gemm.DENSE_ENV_VAR] = "1"
        try:
            return head(x)
        finally:
            if before is None:
                os.environ.pop(kernels.gemm.DENSE_ENV_VAR, None)
            else:
                os.environ[kernels.gemm.DENSE_ENV_VAR] = before

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="V=32000, H=2048: a quick run")
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per head and batch size")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES),
                        help="batch sizes (default 1 2 4 8 64)")
    parser.add_argument("--chunk-elements", type=int, default=methods.CHUNK_ELEMENTS,
                        help="float32 values dequantized per GEMM chunk")
    parser.add_argument("--no-torch-path", action="store_true", help="skip the torch-path lines (slow at large B)")
    parser.add_argument("--quick", action="store_true",
                        help="the W8A16 / W4A16 / dense heads only, without the torch-path lines")
    parser.add_argument("--only", nargs="+", default=None, help="heads to time (prefixes: bf16 fp16 FP8 NVFP4)")
    parser.add_argument("--probe-mib", type=int, default=1024, help="bandwidth probe buffer (MiB)")
    parser.add_argument("--before-library", default=None,
                        help="another build of the kernels' library (.so): its FP8 / NVFP4 lines, side by side")
    add_json(parser)
    args = parser.parse_args()
    with recording("quantized_head", args):
        sys.stdout.reconfigure(line_buffering=True)  # progress shows through a pipe or a file
        vocab = args.vocab or (32000 if args.small else 129280)
        hidden = args.hidden or (2048 if args.small else 5120)
        rounds = args.rounds or (7 if args.small else 3)
        methods.CHUNK_ELEMENTS = args.chunk_elements
        if args.quick:
            args.no_torch_path = True
            args.only = args.only or ["bf16", "fp16", "FP8 W8A16", "NVFP4 W4A16"]

        reason = kernels.unavailable_reason()
        fused_label = "fused" if reason is None else "fused unavailable -> torch path"
        print(f"LM head V={vocab} H={hidden}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
              f"torch-path chunk {methods.CHUNK_ELEMENTS} float32 values")
        if reason is None:
            loaded = kernels.load()
            dpbf16 = "on" if loaded.lib.trtvocab_fused_dpbf16() else "off (FMA kernels)"
            print(f"fused kernels: {loaded.isa}, vdpbf16ps kernels {dpbf16}, {loaded.path}")
        else:
            print(f"fused kernels unavailable ({reason}): the 'fused' lines run the torch path")
        print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())} ({os.cpu_count()} CPUs): "
              "timings are noisy when it exceeds the thread count")
        t0 = time.perf_counter()
        heads = build_heads(vocab, hidden)
        if args.only:
            heads = {k: v for k, v in heads.items() if any(k.startswith(p) for p in args.only) or k == "bf16"}
        variants: dict[str, Variant] = {}
        for name, head in heads.items():
            if name in ("bf16", "fp16"):
                dtype = head.weights.weight.dtype
                variants[name] = (lambda x, head=head, dtype=dtype: head(x.to(dtype)), head.resident_bytes())
                if args.before_library:
                    before = library_call(args.before_library, head)
                    variants[f"{name} before"] = (lambda x, f=before, dtype=dtype: f(x.to(dtype)),
                                                  head.resident_bytes())
                fallback = torch_path(head)  # torch's GEMM: the dense heads' path before the dense kernel
                variants[f"{name} torch GEMM"] = (lambda x, f=fallback, dtype=dtype: f(x.to(dtype)),
                                                  head.resident_bytes())
                if reason is None:  # the dense kernel even where dense_max_batch keeps torch's GEMM: is that right?
                    forced = dense_kernel_call(head)
                    variants[f"{name} kernel (forced)"] = (lambda x, f=forced, dtype=dtype: f(x.to(dtype)),
                                                           head.resident_bytes())
                continue
            variants[f"{name} {fused_label}"] = (head, head.resident_bytes())
            if args.before_library:
                variants[f"{name} before"] = (library_call(args.before_library, head), head.resident_bytes())
            if not args.no_torch_path:
                variants[f"{name} torch path"] = (torch_path(head), head.resident_bytes())
        peer_variants, notes = peers(vocab, hidden, torch.Generator().manual_seed(1))
        variants.update(peer_variants)
        probe = make_probe(args.probe_mib)
        for reader, read in probe.readers.items():
            variants[f"bandwidth probe ({reader})"] = (lambda x, read=read: read(), probe.nbytes)
        print(f"built heads in {time.perf_counter() - t0:.1f} s; bandwidth probe: {probe.nbytes / 2**20:.0f} MiB read "
              f"per call ({', '.join(probe.readers)})")
        for note in notes:
            print(note)

        base_bytes = variants["bf16"][1]
        width = max(map(len, variants)) + 1
        print(f"\n{'head':<{width}} {'weight bytes':>15} {'vs bf16':>8}")
        for name, (_, nbytes) in variants.items():
            if not name.startswith("bandwidth"):
                print(f"{name:<{width}} {nbytes:>15,} {nbytes / base_bytes:>8.3f}")

        for batch in args.batches:
            x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(batch)).bfloat16()
            slow = batch >= 64 and not args.small
            runs = rounds if not slow else max(1, rounds - 1)
            if batch == 1 or args.small:
                for fn, _ in variants.values():  # warm-up: allocator, thread pool, caches
                    fn(x)
            times: dict[str, list[float]] = {name: [] for name in variants}
            for r in range(runs):
                for name, (fn, _) in variants.items():
                    if slow and r and (name.endswith("torch path") or name.endswith("torch GEMM")):
                        continue  # seconds per call: one round is enough to place it
                    times[name].append(time_call(fn, x))
            gbs = {name: variants[name][1] / min(ts) / 1e9 for name, ts in times.items()}
            limit = max(v for k, v in gbs.items() if k.startswith("bandwidth probe"))
            best = {name: min(ts) for name, ts in times.items()}
            peer_best = {"int8": min((t for k, t in best.items() if k.startswith("torch int8pack")), default=None),
                         "int4": min((t for k, t in best.items() if k.startswith("torch int4pack")), default=None)}
            best_base, median_base = best["bf16"], statistics.median(times["bf16"])
            print(f"\ndecode B={batch}: {runs} interleaved rounds; best-of (robust to a busy machine) and median; "
                  f"read bandwidth (probe, same rounds) {limit:.2f} GB/s")
            print(f"{'head':<{width}} {'best ms':>9} {'median ms':>10} {'tokens/s':>9} {'vs bf16':>8} {'(median)':>9} "
                  f"{'vs int8':>8} {'vs int4':>8} {'MB/token':>9} {'GB/s':>6} {'of BW':>6}")
            for name, ts in times.items():
                if name.startswith("bandwidth"):
                    continue
                t, median = best[name], statistics.median(ts)
                nbytes = variants[name][1]
                vs_peer = " ".join(f"{peer_best[p] / t:>7.2f}x" if peer_best[p] else f"{'-':>8}"
                                   for p in ("int8", "int4"))
                print(f"{name:<{width}} {t * 1e3:>9.1f} {median * 1e3:>10.1f} {batch / t:>9.1f} "
                      f"{best_base / t:>7.2f}x {median_base / median:>8.2f}x {vs_peer} {nbytes / batch / 1e6:>9.2f} "
                      f"{gbs[name]:>6.2f} {gbs[name] / limit:>6.2f}")


if __name__ == "__main__":
    main()
