"""A damaged model file (``trtvocab/checkpoints/real_models.py``): a file assembled earlier and truncated since
is checked against its sha256 and assembled again.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest


def test_low_assemble_rechecks_an_existing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    from trtvocab.checkpoints import real_models

    good = b"GGUF" + b"x" * 5000
    package = types.ModuleType("fake_chunks")
    package.EXPECTED_SHA256 = hashlib.sha256(good).hexdigest()  # type: ignore[attr-defined]
    package.assemble = lambda out, **_: Path(out).write_bytes(good)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_chunks", package)
    model = real_models.RealModel("fake", "fake_chunks", "fake.gguf", "", "", assembled=True)
    monkeypatch.setattr(real_models, "MODELS", (model,))
    monkeypatch.setattr(real_models, "assembled_dir", lambda: tmp_path)
    monkeypatch.setattr(real_models.importlib.util, "find_spec", lambda name: object())
    target = real_models.assemble("fake")
    assert target.read_bytes() == good
    target.write_bytes(good[:1000])  # truncated after a first assembly
    assert real_models.assemble("fake").read_bytes() == good
