"""A build that cannot keep its promise (``trtvocab/pipeline/build.py``): an engine required (``[engine]
require`` or ``--require-engine``) with ``[output] onnx = false`` is one EngineUnavailableError line, before
anything is written.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hostile import assert_cli_error, cli


@pytest.mark.parametrize("how", ["e26_recipe_require", "f11_cli_require_engine"])
def test_e26_f11_required_engine_without_onnx_fails_before_writing(tmp_path: Path, how: str) -> None:
    """e26 / f11: ``require = true`` (or ``--require-engine``) with ``[output] onnx = false`` exited 0 with no
    engine; now one EngineUnavailableError line, exit 2, nothing written."""
    out = tmp_path / "art"
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[checkpoint.synthetic]\nvocab_size = 101\nhidden_size = 16\n[output]\ndir = "{out}"\n'
                      f'onnx = false\n' + ('[engine]\nrequire = true\n' if how.startswith("e26") else ""))
    code, output = cli("build", str(recipe), *([] if how.startswith("e26") else ["--require-engine"]))
    assert_cli_error(code, output, "EngineUnavailableError", "onnx = false")
    assert not out.exists()
