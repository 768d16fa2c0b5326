"""Compare the object code of ``fused.cpp`` at a git revision with the working tree's, per instruction set.

    python tools/kernel_objdiff.py --base b82d925                      # native, avx512, avx2, portable
    python tools/kernel_objdiff.py --base HEAD --isas portable,avx2
    python tools/kernel_objdiff.py --base HEAD --units fused.cpp,probes.cpp   # code moved between units

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


def _rodata(obj: Path) -> dict[str, bytes]:
    """Every ``.rodata*`` section of ``obj``: its bytes."""
    heads = subprocess.run(["objdump", "-h", str(obj)], check=True, capture_output=True, text=True).stdout
    names = sorted({f.split()[1] for f in heads.splitlines() if ".rodata" in f and len(f.split()) > 1})
    if not names:
        return {}
    dump = subprocess.run(["objdump", "-s", *[a for n in names for a in ("-j", n)], str(obj)], check=True,
                          capture_output=True, text=True).stdout
    out: dict[str, bytes] = {}
    current = None
    for line in dump.splitlines():
        header = re.match(r"Contents of section (.*):", line)
        if header:
            current = header.group(1)
            out[current] = b""
        elif current is not None and re.match(r"^ [0-9a-f]+ ", line):
            words = line[1:].split(None, 1)[1][:35].split()
            out[current] += bytes.fromhex("".join(words))
    return out


def _constants(obj: Path, rodata: dict[str, bytes]) -> dict[str, str]:
    """``.LCn`` (the compiler's numbered local constants) -> its bytes in hex (``.rodata.cstN``: N of them, any
    other section: the next 16), so that a constant's number, which moves with everything else in the unit,
    is not a difference."""
    table = subprocess.run(["objdump", "-t", str(obj)], check=True, capture_output=True, text=True).stdout
    out = {}
    for line in table.splitlines():
        m = re.match(r"^([0-9a-f]+)\s.*?\s(\.rodata\S*)\s+[0-9a-f]+\s+(\.LC\d+)$", line)
        if m:
            at, section, name = int(m.group(1), 16), m.group(2), m.group(3)
            pool = re.match(r"\.rodata\.cst(\d+)$", section)
            size = int(pool.group(1)) if pool else 16
            out[name] = f"<const {rodata.get(section, b'')[at : at + size].hex()}>"
    return out


def normalized(sources: list[Path], isa: str, folder: Path) -> tuple[dict[str, list[str]], dict[str, object]]:
    """``(code, data)`` of ``sources`` (translation units) built for ``isa``: the disassembly of every function
    section (instructions and the symbols they refer to, addresses dropped, a numbered constant by its
    bytes), keyed by section name, a name in two units holding both; and the ``.rodata`` sections: the
    constant pools (``.rodata.cstN``, whose entries a linker merges) as the set of their N-byte entries, any
    other by name."""
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    sections: dict[str, list[str]] = {}
    data: dict[str, object] = {}
    for source in sources:
        obj = folder / f"{source.stem}.{isa}.o"
        subprocess.run(["g++", *kcompile.cflags(isa), "-fPIC", "-std=c++17", abi, "-ffunction-sections",
                        "-fdata-sections", *includes, "-c", str(source), "-o", str(obj)], check=True)
        text = subprocess.run(["objdump", "-d", "-r", "--no-show-raw-insn", str(obj)], check=True,
                              capture_output=True, text=True).stdout
        rodata = _rodata(obj)
        constants = _constants(obj, rodata)
        current = None
        for line in text.splitlines():
            header = re.match(r"Disassembly of section (.*):", line)
            if header:
                current = sections.setdefault(header.group(1), [])
            elif current is not None:
                line = re.sub(r"<[^<>]*\+0x[0-9a-f]+>", "<+>", line)  # a jump target, named by a nearby label
                line = re.sub(r"\.LC\d+\b", lambda m, c=constants: c.get(m.group(0), ".LC"), line)
                current.append(re.sub(r"\b[0-9a-f]+ <", "<", re.sub(r"^\s*[0-9a-f]+:\s*", "", line)))
        for name, raw in rodata.items():
            pool = re.match(r"\.rodata\.cst(\d+)$", name)
            if pool:
                size = int(pool.group(1))
                entries = data.setdefault(name, set())
                assert isinstance(entries, set)
                entries.update(raw[i : i + size] for i in range(0, len(raw), size))
            else:
                data[f"{name} ({source.name})" if name in data else name] = raw
    return sections, data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision to compare against (default HEAD)")
    parser.add_argument("--isas", default=",".join(kcompile.ISAS),
                        help="comma-separated, among " + ", ".join(kcompile.ISAS))
    parser.add_argument("--units", default="fused.cpp",
                        help="translation units of csrc/ compiled on each side (comma-separated; a unit a side lacks "
                             "is left out there), so code moved between units compares equal (default fused.cpp)")
    args = parser.parse_args()
    isas = args.isas.split(",")
    if any(isa not in kcompile.ISAS for isa in isas):
        parser.error(f"--isas: among {', '.join(kcompile.ISAS)}, got {args.isas!r}")
    differ = 0
    units = args.units.split(",")
    with tempfile.TemporaryDirectory(prefix="trtvocab-objdiff-") as tmp:
        base_root = checkout(args.base, Path(tmp) / "base")
        base_src = [base_root / u for u in units if (base_root / u).is_file()]
        new_src = [kcompile.CSRC / u for u in units if (kcompile.CSRC / u).is_file()]
        for isa in isas:
            (Path(tmp) / "b").mkdir(exist_ok=True)
            (Path(tmp) / "n").mkdir(exist_ok=True)
            base_code, base_data = normalized(base_src, isa, Path(tmp) / "b")
            new_code, new_data = normalized(new_src, isa, Path(tmp) / "n")
            changed = sorted(n for n in set(base_code) | set(new_code) if base_code.get(n) != new_code.get(n))
            same_data = base_data == new_data
            print(f"{isa:9} {len(new_code)} code sections: code {'same' if not changed else 'DIFFERS'}, "
                  f".rodata {'same' if same_data else 'DIFFERS'}")
            for name in changed[:20]:
                where = ("only in base" if name not in new_code else "only in new" if name not in base_code
                         else "differs")
                print(f"          {where}: {name}")
            differ += bool(changed) or not same_data
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
