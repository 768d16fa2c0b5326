"""``python -m trtvocab.kernels --build``: build (or find in the cache) and self-check the kernels."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from trtvocab.kernels.compile import disabled_reason
from trtvocab.kernels.library import load, unavailable_reason
from trtvocab.kernels.tree import tree_available, tree_exp_check

DESCRIPTION = "Fused dequantize-multiply CPU kernels for the FP8, NVFP4 and dense heads (a JIT-built C++ extension)."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trtvocab.kernels", description=DESCRIPTION)
    parser.add_argument("--build", action="store_true", help="build (or find in the cache) and self-check the kernels")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    if not args.build:
        parser.print_help()
        return 0
    if disabled_reason() is not None:
        print(f"trtvocab fused kernels: disabled ({disabled_reason()}); the torch path is used")
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    loaded = load(verbose=args.verbose)
    if loaded is None:
        # Not an error for `make setup`: the heads fall back to torch, and say so once.
        print(f"trtvocab fused kernels: unavailable ({unavailable_reason()}); the torch path is used")
        return 0
    print(f"trtvocab fused kernels: {loaded.path} ({loaded.isa}, {loaded.seconds:.1f} s, self-check passed)")
    if tree_available():
        start = time.perf_counter()
        problem = tree_exp_check(exhaustive=True)
        verdict = f"differs ({problem}): the torch path is used" if problem else "matches torch.exp on [-104, 0]"
        print(f"trtvocab tree kernel: exp {verdict} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
