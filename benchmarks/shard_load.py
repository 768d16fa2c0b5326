"""Peak memory of one rank loading its shard of a large LM head, as a fraction of the whole.

    .venv/bin/python benchmarks/shard_load.py                 # 129280 x 5120 bf16 (~1.3 GB), tp 8
    .venv/bin/python benchmarks/shard_load.py --vocab 32000 --hidden 1024

Writes an HF directory (config.json + model.safetensors holding ``lm_head.weight``)
to a temporary directory, streaming random rows so the writer never holds the matrix,
then loads the shard of a few ranks with ``LMHead.from_checkpoint`` in *fresh*
subprocesses, and deletes the checkpoint.

Measured per load: the kernel's resident-set high-water mark (VmHWM, reset through
/proc/self/clear_refs after imports) minus the resident set before the call, divided
by the full matrix's bytes. The shard itself is 1/tp of it (0.125 at tp 8), so the goal
of <= 0.2 leaves room for allocator and Python overhead but not for a second copy.
The page cache holding the file is not part of a process's RSS; the checkpoint reader
uses positioned reads (no mmap), so only the rows read count.

Two ways of loading are measured side by side:

* ``from_checkpoint``: the lazy reader reads exactly the shard's rows into a fresh
  tensor, which DenseWeight adopts as its buffer (its initial buffer is zero pages
  never touched);
* ``copy``: the same rows handed in as a caller's tensor, which the head copies into
  its own buffer (it never aliases a caller's tensor): two shard-sized buffers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import add_json, recording

CHILD = r"""
import json, re, sys, time
import torch
from trtvocab import LMHead, Mapping
from trtvocab.checkpoints.checkpoint import Checkpoint

def status(key):
    with open("/proc/self/status") as fh:
        return int(re.search(key + r":\s+(\d+)", fh.read()).group(1)) * 1024

path, tp, rank, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
mapping = Mapping(world_size=tp, rank=rank, tp_size=tp)
before = status("VmRSS")
try:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    reset = True
except OSError:
    reset = False
start = time.perf_counter()
if how == "from_checkpoint":
    head = LMHead.from_checkpoint(path, mapping=mapping, dtype=torch.bfloat16)
else:
    ckpt = Checkpoint(path)
    info = ckpt.info("lm_head.weight")
    head = LMHead(info.shape[0], info.shape[1], dtype=torch.bfloat16, mapping=mapping)
    rows = ckpt.get_slice("lm_head.weight")[head.vocab_start : head.vocab_end]
    head.load_weights({"weight": rows})
    del rows
seconds = time.perf_counter() - start
print(json.dumps({"peak_delta": status("VmHWM") - before, "reset": reset, "seconds": seconds,
                  "resident": head.resident_bytes(), "shard": [head.vocab_start, head.vocab_end]}))
"""

DTYPES = {"bf16": ("BF16", 2), "fp16": ("F16", 2), "fp32": ("F32", 4)}


def write_checkpoint(directory: Path, vocab: int, hidden: int, dtype: str, chunk_rows: int = 8192) -> int:
    """Stream a safetensors file with one ``[vocab, hidden]`` tensor; returns its data bytes."""
    import torch

    tag, itemsize = DTYPES[dtype]
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    nbytes = vocab * hidden * itemsize
    header = json.dumps({"lm_head.weight": {"dtype": tag, "shape": [vocab, hidden], "data_offsets": [0, nbytes]}})
    header += " " * (-len(header) % 8)  # data starts 8-byte aligned, as safetensors writes it
    (directory / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
         "tie_word_embeddings": False}))
    gen = torch.Generator().manual_seed(0)
    with open(directory / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(header)))
        fh.write(header.encode())
        for start in range(0, vocab, chunk_rows):
            rows = min(chunk_rows, vocab - start)
            block = (torch.randn(rows, hidden, generator=gen) * 0.02).to(torch_dtype)
            fh.write(block.view(torch.uint8).numpy().tobytes())
    return nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--ranks", type=int, nargs="*", help="ranks to load (default: first and last)")
    parser.add_argument("--goal", type=float, default=0.2)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the temporary checkpoint")
    add_json(parser)
    args = parser.parse_args()
    with recording("shard_load", args):
        ranks = args.ranks if args.ranks else sorted({0, args.tp - 1})

        tmp = Path(tempfile.mkdtemp(prefix="trtvocab_shard_load_", dir=args.dir))
        try:
            start = time.perf_counter()
            full_bytes = write_checkpoint(tmp, args.vocab, args.hidden, args.dtype)
            print(f"wrote {args.vocab} x {args.hidden} {args.dtype} = {full_bytes / 2**30:.2f} GiB to {tmp} "
                  f"in {time.perf_counter() - start:.1f} s")
            print(f"tp={args.tp}: shard = 1/{args.tp} = {1 / args.tp:.3f} of the matrix; goal: peak <= {args.goal}\n")
            print(f"{'how':<17}{'rank':>5}{'rows':>18}{'peak RSS delta':>17}{'ratio':>8}{'load':>9}")
            worst = 0.0
            for how in ("from_checkpoint", "copy"):
                for rank in ranks:
                    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp), str(args.tp), str(rank), how],
                                         capture_output=True, text=True, check=False)
                    if out.returncode:
                        raise SystemExit(f"load of rank {rank} failed:\n{out.stderr}")
                    rec = json.loads(out.stdout.strip().splitlines()[-1])
                    ratio = rec["peak_delta"] / full_bytes
                    if how == "from_checkpoint":
                        worst = max(worst, ratio)
                    rows = f"[{rec['shard'][0]}, {rec['shard'][1]})"
                    print(f"{how:<17}{rank:>5}{rows:>18}{rec['peak_delta'] / 2**20:>13.1f} MiB{ratio:>8.3f}"
                          f"{rec['seconds']:>8.2f}s"
                          + ("" if rec["reset"] else "  (VmHWM not resettable: over-estimate)"))
            verdict = "meets" if worst <= args.goal else "MISSES"
            print(f"\nfrom_checkpoint peak / full matrix = {worst:.3f}: {verdict} the goal of <= {args.goal}")
            print("Measured: VmHWM after the load minus VmRSS before it, in a fresh process per load (imports done "
                  "first);\nthe page cache holding the file is not counted in RSS (positioned reads, no mmap).")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
