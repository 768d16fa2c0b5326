"""What more than one benchmark needs: the read and multiply probes, random quantized tensors, the real
model a name stands for, and llama-perplexity's windows. Benchmarks import this module and
:mod:`_harness`, never each other. Only the standard library at the top: the llama.cpp peer
(``llamacpp_peer.py``) runs in another virtual environment and imports ``windows`` from here.
"""

from __future__ import annotations

import glob
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from trtvocab import QuantAlgo

DEFAULT_MIB = 1024  # > 30x the L3 of the machines this runs on


def last_level_cache_bytes() -> int | None:
    """The largest cache this CPU reports (sysfs), None where it is not readable."""
    best = None
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path, encoding="ascii").read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        value = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        best = value if best is None else max(best, value)
    return best


@dataclass
class Probe:
    """A read-only pass over ``buffer``; ``readers`` name -> call (each reads every byte once)."""

    buffer: torch.Tensor
    readers: dict[str, Callable[[], object]]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def make_probe(mib: int = DEFAULT_MIB) -> Probe:
    nbytes = max(256, (mib << 20) // 256 * 256)
    llc = last_level_cache_bytes()
    if llc is not None and nbytes < 4 * llc:
        nbytes = (4 * llc + 255) // 256 * 256
    import torch

    buffer = torch.ones(nbytes // 8, dtype=torch.int64)  # written once: every page resident
    readers: dict[str, Callable[[], object]] = {}
    from trtvocab import kernels
    from trtvocab.kernels import probes

    if kernels.available():
        readers["kernel"] = lambda: probes.read_probe(buffer)
    readers["torch"] = lambda: buffer.sum()
    return Probe(buffer, readers)


def measure(probe: Probe, rounds: int = 5) -> dict[str, float]:
    """Best GB/s of each reader over ``rounds`` interleaved rounds (after one warm-up call each)."""
    for read in probe.readers.values():
        read()
    best = {name: 0.0 for name in probe.readers}
    for _ in range(rounds):
        for name, read in probe.readers.items():
            start = time.perf_counter()
            read()
            best[name] = max(best[name], probe.nbytes / (time.perf_counter() - start) / 1e9)
    return best


def per_ns(count: Callable[[], int]) -> float:
    """What one call of ``count`` returns (the work it did: multiplies, weights) per ns of its wall time."""
    start = time.perf_counter()
    made = count()
    return made / ((time.perf_counter() - start) * 1e9)


def multiply_rate(steps: int = 1 << 21) -> float | None:
    """Float32 multiplies per ns of one call of the kernels' multiply probe (``steps`` rounds of its 16
    chains per thread); None where the kernels' library does not load. Call it per round, keep the best."""
    from trtvocab import kernels
    from trtvocab.kernels import probes

    if not kernels.available():
        return None
    return per_ns(lambda: probes.mul_probe(steps))


def random_tensors(algo: QuantAlgo, vocab: int, hidden: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Valid checkpoint tensors: no NaN codes, positive scales."""
    import torch

    from trtvocab import QuantAlgo

    if algo is QuantAlgo.FP8:
        codes = torch.randint(0, 256, (vocab, hidden), dtype=torch.uint8, generator=gen)
        codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn NaN
        return {"weight": codes.view(torch.float8_e4m3fn), "weight_scale": torch.tensor(2e-4)}
    packed = torch.randint(0, 256, (vocab, hidden // 2), dtype=torch.uint8, generator=gen)
    # Block scales 0x30..0x5f: e4m3 values 1 .. 240.
    scales = torch.randint(0x30, 0x60, (vocab, hidden // 16), dtype=torch.uint8, generator=gen)
    return {"weight": packed, "weight_scale": scales.view(torch.float8_e4m3fn), "weight_scale_2": torch.tensor(3e-5)}


def model_file(name: str) -> Path:
    """``smollm2`` / ``gemma3`` (installed, Gemma 3 assembled) or a path to a ``.gguf``; exits naming
    the install command when the model is not there."""
    from trtvocab.checkpoints.real_models import model_path
    from trtvocab.errors import TrtVocabError

    if name.endswith(".gguf"):
        return Path(name)
    try:
        return Path(model_path(name))
    except TrtVocabError as exc:
        raise SystemExit(f"{name}: {exc}") from exc


def windows(n_tokens: int, n_ctx: int, chunks: int | None) -> tuple[int, int]:
    """``(n_chunk, first)``: ``llama-perplexity``'s windows over ``n_tokens`` ids. Chunk ``i`` is ids
    ``[i * n_ctx, (i + 1) * n_ctx)`` (whole chunks only: a tail shorter than ``n_ctx`` is dropped), its first id
    replaced by BOS where the vocabulary adds one; rows ``first = n_ctx // 2`` .. ``n_ctx - 2`` are scored,
    each against the id after it, so a chunk scores ``n_ctx - 1 - first`` tokens."""
    n_chunk = n_tokens // n_ctx
    if chunks is not None:
        n_chunk = min(n_chunk, chunks)
    return n_chunk, n_ctx // 2
