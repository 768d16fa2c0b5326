"""What every benchmark shares: interleaved rounds, best / median, a bandwidth fraction, and one JSON
record per run.

A script adds ``--json`` with :func:`add_json` and runs its body inside :func:`recording`::

    with recording("kernel_ab", args):
        ...                       # prints its table as before
        add_row(format="fp8", batch=1, base_ms=..., new_ms=...)   # from any function

Without ``--json`` nothing changes. With it the table goes to stderr, and stdout is one JSON line:
``{"benchmark", "time", "revision", "dirty", "cpu", "flags", "threads", "python", "torch", "argv", "args",
"rows", "lines", "status"}`` (``rows``: what the script added; ``lines``: the text it printed), which is also
appended to ``benchmarks/results/<cpu>.jsonl`` (``--results DIR`` elsewhere) so that runs on one machine
stay together and docs/kernels.md can cite them. Only the standard library is imported here: the peer
scripts run in other virtual environments.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
# The flags that pick a kernel path (docs/kernels.md, "Dispatch"): the rest of /proc/cpuinfo's list is noise.
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vbmi",
         "avx512_fp16", "amx_bf16", "amx_tile", "asimd", "sve")


@dataclass
class Timing:
    """The seconds of each round of one contender."""

    seconds: list[float] = field(default_factory=list)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def ms(self) -> dict[str, float]:
        return {"best_ms": self.best * 1e3, "median_ms": self.median * 1e3, "rounds": len(self.seconds)}


def interleaved(contenders: dict[str, Callable[[], object]], rounds: int, *, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, Timing]:
    """Each round calls every contender once, in an order rotated round by round, so that drift in the
    machine's clock, bandwidth or load hits all of them alike (compare ratios taken this way, never
    numbers from separate runs). ``warmup`` untimed calls each first."""
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    out = {name: Timing() for name in names}
    for r in range(max(1, rounds)):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = clock()
            contenders[name]()
            out[name].seconds.append(clock() - start)
    return out


def fraction(nbytes: int, seconds: float, probe_gb_s: float | None) -> float | None:
    """The share of the measured read bandwidth (``probe_gb_s``, GB/s) a call reading ``nbytes`` in
    ``seconds`` reached; None without a probe."""
    if not probe_gb_s or seconds <= 0:
        return None
    return nbytes / seconds / 1e9 / probe_gb_s


def _git(*cmd: str) -> str | None:
    try:
        done = subprocess.run(["git", *cmd], cwd=HERE, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def cpu() -> tuple[str, list[str]]:
    """This CPU's model name and the kernel-relevant flags it reports."""
    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    return model, [f for f in FLAGS if f in flags]


def environment() -> dict[str, Any]:
    """The revision and the machine a record was measured at."""
    model, flags = cpu()
    torch = sys.modules.get("torch")
    return {"time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "revision": _git("rev-parse", "--short=12", "HEAD"), "dirty": bool(_git("status", "--porcelain",
                                                                                     "--untracked-files=no")),
            "cpu": model, "flags": flags, "cores": os.cpu_count(),
            "threads": torch.get_num_threads() if torch is not None else None,
            "python": platform.python_version(), "torch": getattr(torch, "__version__", None)}


def results_file(model: str, folder: Path = RESULTS) -> Path:
    """``benchmarks/results/<cpu>.jsonl``: the CPU's model name as a file name."""
    return folder / (re.sub(r"[^A-Za-z0-9]+", "-", model).strip("-").lower() + ".jsonl")


def add_json(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON line (the rows, the printed text, the revision and the CPU) instead of "
                             "the table, which goes to stderr; also appended to benchmarks/results/<cpu>.jsonl")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the folder of the .jsonl files (--json)")
    return parser


class Record:
    """One run's rows (:meth:`add`) and printed lines."""

    def __init__(self, name: str) -> None:
        self.name, self.rows, self.status = name, [], 0

    def add(self, **row: Any) -> None:
        self.rows.append(row)


_ACTIVE: list[Record] = []


def add_row(**row: Any) -> None:
    """Add a row to the record of the :func:`recording` running now (from any function of the script)."""
    if _ACTIVE:
        _ACTIVE[-1].add(**row)


class _Tee:
    """Writes to ``out`` and keeps a copy; anything else (``reconfigure``, ``isatty``) is ``out``'s."""

    def __init__(self, out: Any) -> None:
        self.out, self.buffer_text = out, io.StringIO()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.out, name)

    def write(self, text: str) -> int:
        self.buffer_text.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def recording(name: str, args: argparse.Namespace | None = None) -> Iterator[Record]:
    """Run a benchmark's body; with ``args.json`` print and keep its one JSON record (module docstring).
    A ``SystemExit`` inside (a script's exit status) is recorded as ``status`` and raised again."""
    as_json = bool(getattr(args, "json", False))
    record = Record(name)
    tee = _Tee(sys.stderr if as_json else sys.stdout)
    stdout = sys.stdout
    exit_exc: SystemExit | None = None
    _ACTIVE.append(record)
    with contextlib.redirect_stdout(tee):
        try:
            yield record
        except SystemExit as exc:
            exit_exc = exc
            record.status = exc.code if isinstance(exc.code, int) else 1
        finally:
            _ACTIVE.remove(record)
    if as_json:
        env = environment()
        options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                   if k not in ("json", "results")}
        line = json.dumps({"benchmark": name, **env, "argv": sys.argv[1:], "args": options, "rows": record.rows,
                           "lines": tee.buffer_text.getvalue().splitlines(), "status": record.status}, default=str)
        stdout.write(line + "\n")
        stdout.flush()
        folder = Path(getattr(args, "results", RESULTS))
        folder.mkdir(parents=True, exist_ok=True)
        with results_file(env["cpu"], folder).open("a", encoding="utf-8") as fh:
            fh.write(line + "\n")
    if exit_exc is not None:
        raise exit_exc
