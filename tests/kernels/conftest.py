"""The ``isa`` fixture of the fused kernel tests: a test runs once per build of the library
(``TRTVOCAB_KERNELS_ISA``: native, avx512, avx2, portable); a build this machine cannot run is skipped with
the reason.
"""

from __future__ import annotations

import pytest

from tests.kernels.fused_reference import isa_runs_here
from trtvocab.kernels import library


@pytest.fixture(params=list(library.ISAS))
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Route the kernels of this test through the library built for one ISA."""
    if library.disabled_reason() is not None:
        pytest.skip(library.disabled_reason())
    why = isa_runs_here(request.param)
    if why:
        pytest.skip(why)
    try:
        loaded = library.load_isa(request.param)
    except Exception as exc:  # no compiler here: the fused tests above skip for the same reason
        pytest.skip(f"{request.param} build unavailable: {exc}")
    monkeypatch.setattr(library, "_loaded", loaded)
    return request.param
