"""A hostile ``TRTVOCAB_KERNELS_ISA`` (``trtvocab/kernels/compile.py``): an ISA the CPU lacks is refused before
anything is built or loaded (the torch path, one log line), and a huge value is not echoed whole.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_a2_forced_isa_the_cpu_lacks_falls_back_to_torch_with_one_line(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, isa: str) -> None:
    """A2 (code reading): ``TRTVOCAB_KERNELS_ISA=avx512`` on a CPU without AVX-512 built ``-march=x86-64-v4``
    and ran its self-check (SIGILL, here and in every later process through the cached library). A CPU
    without the flags (simulated) now gets the torch path with one log line; nothing is built or loaded."""
    from trtvocab import kernels
    from trtvocab.kernels import compile as kbuild
    from trtvocab.kernels import library

    built: list[str | None] = []
    monkeypatch.setattr(kbuild, "_library", lambda verbose, isa=None: built.append(isa) or 1 / 0)
    monkeypatch.setattr(kbuild.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kbuild, "cpu_flags", lambda: {"sse2", "sse4_2", "popcnt"})  # an old x86-64
    monkeypatch.delenv(kernels.library.ENV_VAR, raising=False)
    monkeypatch.setenv(kbuild.ISA_ENV_VAR, isa)
    monkeypatch.setattr(library, "_loaded", None)
    monkeypatch.setattr(library, "_failure", None)
    monkeypatch.setattr(library, "_by_isa", {})
    with caplog.at_level("WARNING", logger="trtvocab.kernels"):
        assert kernels.load() is None
        assert kernels.load() is None
    assert built == []  # refused before building or opening a cached library
    lines = [r.getMessage() for r in caplog.records if "torch path" in r.getMessage()]
    assert len(lines) == 1 and f"{kbuild.ISA_ENV_VAR}={isa}" in lines[0] and "fma" in lines[0], lines
    with pytest.raises(RuntimeError, match="lacks"):
        library.load_isa(isa)
    monkeypatch.setenv(kbuild.ISA_ENV_VAR, "portable")  # what every x86-64 runs is not refused
    assert kbuild.isa_problem("portable") is None


def test_k05_a_huge_isa_value_is_not_echoed_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """k05 (Low): a 100 000-character ``TRTVOCAB_KERNELS_ISA`` was echoed whole in a 100 179-character log line."""
    from trtvocab.kernels import compile as kbuild

    monkeypatch.setenv(kbuild.ISA_ENV_VAR, "x" * 100_000)
    with pytest.raises(ValueError) as err:
        kbuild.requested_isa()
    assert len(str(err.value)) < 300 and "100000 characters" in str(err.value)
