"""Compare the object code of ``fused.cpp`` at a git revision with the working tree's, per instruction set.

    python tools/kernel_objdiff.py --base b82d925                      # native, avx512, avx2, portable
    python tools/kernel_objdiff.py --base HEAD --isas portable,avx2

For a change that must not alter one instruction (moving code between the headers of
``trtvocab/kernels/csrc/fused/``, comments, names of nothing): each side's ``fused.cpp`` is compiled
to an object with the flags the library is built with (``trtvocab.kernels.compile.cflags``) plus
``-ffunction-sections -fdata-sections``, so that every function is its own section; then the
disassembly of each section (``objdump -d -r``: instructions and the symbols they refer to, addresses
dropped) and the bytes of the ``.rodata`` sections are compared. Prints one line per instruction set
and exits 1 where any differs. Needs g++ and binutils' objdump.
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch
from torch.utils import cpp_extension

from trtvocab.kernels import compile as kcompile

ROOT = Path(__file__).resolve().parent.parent
CSRC = "trtvocab/kernels/csrc"


def checkout(rev: str, folder: Path) -> Path:
    """``rev``'s ``csrc/`` tree extracted under ``folder``; its path."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, CSRC],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not (member.isfile() or member.isdir()) or ".." in Path(member.name).parts:
                raise RuntimeError(f"{rev}:{member.name}: not a plain file of {CSRC}")
        tar.extractall(folder)
    return folder / CSRC


def normalized(source: Path, isa: str, obj: Path) -> tuple[str, str, int]:
    """``(disassembly by section, sorted, addresses dropped; .rodata bytes; sections)`` of ``source`` built
    for ``isa``."""
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    subprocess.run(["g++", *kcompile.cflags(isa), "-fPIC", "-std=c++17", abi, "-ffunction-sections", "-fdata-sections",
                    *includes, "-c", str(source), "-o", str(obj)], check=True)
    text = subprocess.run(["objdump", "-d", "-r", "--no-show-raw-insn", str(obj)], check=True,
                          capture_output=True, text=True).stdout
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        header = re.match(r"Disassembly of section (.*):", line)
        if header:
            current = sections.setdefault(header.group(1), [])
        elif current is not None:
            current.append(re.sub(r"\b[0-9a-f]+ <", "<", re.sub(r"^\s*[0-9a-f]+:\s*", "", line)))
    code = "".join(f"== {name}\n" + "\n".join(sections[name]) + "\n" for name in sorted(sections))
    heads = subprocess.run(["objdump", "-h", str(obj)], check=True, capture_output=True, text=True).stdout
    rodata = sorted({f.split()[1] for f in heads.splitlines() if ".rodata" in f and len(f.split()) > 1})
    data = subprocess.run(["objdump", "-s", *[a for s in rodata for a in ("-j", s)], str(obj)], check=True,
                          capture_output=True, text=True).stdout if rodata else ""
    return code, data.split("\n", 2)[-1], len(sections)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision to compare against (default HEAD)")
    parser.add_argument("--isas", default=",".join(kcompile.ISAS),
                        help="comma-separated, among " + ", ".join(kcompile.ISAS))
    args = parser.parse_args()
    isas = args.isas.split(",")
    if any(isa not in kcompile.ISAS for isa in isas):
        parser.error(f"--isas: among {', '.join(kcompile.ISAS)}, got {args.isas!r}")
    differ = 0
    with tempfile.TemporaryDirectory(prefix="trtvocab-objdiff-") as tmp:
        base_src = checkout(args.base, Path(tmp) / "base") / "fused.cpp"
        for isa in isas:
            base = normalized(base_src, isa, Path(tmp) / f"base.{isa}.o")
            new = normalized(kcompile.SOURCE, isa, Path(tmp) / f"new.{isa}.o")
            same_code, same_data = base[0] == new[0], base[1] == new[1]
            print(f"{isa:9} {new[2]} code sections: code {'same' if same_code else 'DIFFERS'}, "
                  f".rodata {'same' if same_data else 'DIFFERS'}")
            differ += not (same_code and same_data)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
