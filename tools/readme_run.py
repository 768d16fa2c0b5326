"""Run every command block of the README for real, top to bottom, as a new user would.

    python tools/readme_run.py [--venv .venv] [--keep DIR] [--only PATTERN] [--quick] [--json FILE]

The README's ```bash blocks run in one bash session (variables carry from line to line) inside a scratch
copy of the repository's tracked files, so that nothing they write lands in the clone; ``.venv/bin`` is on
the PATH and ``.venv`` in the copy is the real one. ``[...]`` parts of a line are optional and left out;
``make X`` uses the existing venv (its install and kernel steps are taken as done); ``make test`` is left
out (it is what runs this). Each ```python block is run as a script; where the README says right after it
``This prints `X```, the script's output must contain X. Exit status 1 if any line fails, with the line,
its exit status and the end of its output; every line's wall time is printed (and written with ``--json``).
``make readme`` runs this; ``tests/project/test_readme.py`` parses the same lines with the real CLI and runs the
``--quick`` ones for real.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = {"make test": "the suite that runs this script"}
# --quick leaves out the lines that take minutes (the demo build, the teacher-forced comparisons and
# quantizations, Gemma 3) and those that read what they write; what is left runs in about a minute.
SLOW_PARTS = ("make ", "examples/", "trtvocab compare", "trtvocab quantize", "--text-file", "G3",
              "artifacts/default")
LINE_TIMEOUT_S = 1800


@dataclass
class Step:
    """One README command (continuation lines joined) or one python block."""

    kind: str  # "bash" | "python"
    text: str  # the line as a shell runs it (optional parts removed) or the script
    shown: str  # the line as the README shows it
    expect: str | None = None  # what the output must contain (python blocks)


def split_optional(line: str) -> tuple[str, list[list[str]]]:
    """``line`` without its ``[...]`` parts (those outside quotes and before any comment; runs of blanks
    become one space), and those parts, each as the list of its alternatives, separated by a ``|`` that stands
    alone (``[--a 1 | --b]``: ``["--a 1", "--b"]``; ``[--c x|y]``: ``["--c x|y"]``). The one parser of the
    README's optional parts: ``tests/project/test_readme.py`` tokenizes what it returns."""
    out: list[str] = []
    parts: list[list[str]] = []
    inside: list[str] = []
    depth, quote = 0, ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'" and not depth:
            quote = ch
        elif ch == "#" and not depth and (i == 0 or line[i - 1].isspace()):
            out.append(line[i:])
            break
        elif ch == "[" and (i == 0 or line[i - 1].isspace()) and not depth:
            depth, inside = 1, []
            continue
        elif ch == "]" and depth:
            depth = 0
            parts.append(_alternatives(inside))
            continue
        (inside if depth else out).append(ch)
    if depth:  # a part the line leaves open runs to its end
        parts.append(_alternatives(inside))
    return re.sub(r"[ \t]+", " ", "".join(out)).strip(), parts


def _alternatives(chars: list[str]) -> list[str]:
    """An optional part's text split at each ``|`` that stands alone."""
    return [alt.strip() for alt in re.split(r"(?<!\S)\|(?!\S)", "".join(chars))]


def steps(readme: str) -> list[Step]:
    """The README's runnable steps in order."""
    found: list[Step] = []
    for match in re.finditer(r"```(bash|python)\n(.*?)```", readme, flags=re.DOTALL):
        kind, body = match.group(1), match.group(2)
        if kind == "python":
            after = readme[match.end():match.end() + 400]
            prints = re.search(r"This prints `([^`]+)`", after)
            found.append(Step("python", body, "```python block", prints.group(1) if prints else None))
            continue
        joined = re.sub(r"\\\n\s*", " ", body)
        for line in joined.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                found.append(Step("bash", split_optional(line)[0], line))
    return found


def make_function(venv: Path) -> str:
    """A ``make`` that reuses ``venv`` as already installed and its kernels as already built."""
    return (f'make() {{ command make VENV="{venv}" -o "{venv}/.installed" -o "{venv}/.kernels" "$@"; }}\n'
            "export -f make\n")


def scratch_copy(dest: Path) -> None:
    """The repository's tracked files (what a fresh clone has), copied to ``dest``."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def run_steps(all_steps: list[Step], workdir: Path, venv: Path) -> list[dict[str, object]]:
    env = dict(os.environ, PATH=f"{venv / 'bin'}:{os.environ.get('PATH', '')}", HF_HUB_OFFLINE="1")
    assignments: list[str] = []  # earlier `VAR=...` lines: each later line's shell runs them first
    results: list[dict[str, object]] = []
    for step in all_steps:
        skip = SKIPPED.get(step.text.split(" #")[0].strip())
        if skip:
            print(f"-- skipped: {step.shown}  ({skip})", flush=True)
            continue
        print(f"-- {step.shown}", flush=True)
        if step.kind == "python":
            script = workdir / ".readme_block.py"
            script.write_text(step.text)
            cmd = [str(venv / "bin" / "python"), str(script)]
        else:
            prelude = make_function(venv) + "".join(a + "\n" for a in assignments)
            cmd = ["bash", "-c", f"set -eo pipefail\n{prelude}{step.text}\n"]
            if re.fullmatch(r"[A-Za-z_]\w*=\S.*", step.text):
                assignments.append(step.text)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=LINE_TIMEOUT_S)
        seconds = time.perf_counter() - start
        ok = proc.returncode == 0 and (step.expect is None or step.expect in proc.stdout)
        results.append({"line": step.shown, "seconds": round(seconds, 1), "exit": proc.returncode, "ok": ok})
        print(f"   {'ok' if ok else 'FAILED'} in {seconds:.1f} s", flush=True)
        if not ok:
            why = f"exit {proc.returncode}" if proc.returncode else f"its output lacks {step.expect!r}"
            print(f"   {why}; the end of its output:\n{(proc.stdout + proc.stderr)[-2000:]}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv", help="the installed venv (make setup's)")
    parser.add_argument("--keep", type=Path, help="run in this (new or empty) folder and keep what it writes")
    parser.add_argument("--only", help="run only the lines containing this text (with the lines that set "
                                       "the variables they use)")
    parser.add_argument("--json", type=Path, help="write each line's time and status here")
    parser.add_argument("--quick", action="store_true", help="leave out the lines that take minutes (the "
                        "demo, comparisons, quantizations, Gemma 3) and the lines that read their outputs")
    args = parser.parse_args(argv)
    venv = args.venv.resolve()
    if not (venv / "bin" / "trtvocab").is_file():
        print(f"{venv}: no installed trtvocab (run make setup first)", file=sys.stderr)
        return 2
    chosen = steps((ROOT / "README.md").read_text())
    if args.quick:
        chosen = [s for s in chosen if not any(part in s.text for part in SLOW_PARTS)]
    if args.only:
        chosen = [s for s in chosen if args.only in s.text or re.fullmatch(r"\w+=.*", s.text)]
    with tempfile.TemporaryDirectory(prefix="trtvocab-readme-") as tmp:
        workdir = args.keep.resolve() if args.keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        scratch_copy(workdir)
        (workdir / ".venv").unlink(missing_ok=True)
        (workdir / ".venv").symlink_to(venv, target_is_directory=True)
        start = time.perf_counter()
        results = run_steps(chosen, workdir, venv)
        total = time.perf_counter() - start
    failed = [r for r in results if not r["ok"]]
    print(f"\n{len(results) - len(failed)} of {len(results)} README steps ran as written in {total:.0f} s"
          + (": FAILED " + "; ".join(str(r["line"])[:80] for r in failed) if failed else ""))
    if args.json:
        args.json.write_text(json.dumps({"total_seconds": round(total, 1), "steps": results}, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
