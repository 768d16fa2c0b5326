"""Hostile recipes (``trtvocab/artifact/recipe.py``): values of the wrong type or out of bounds, a vocabulary
padded past the limit, files that are not TOML recipes -- a ConfigError naming the file and the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.hostile import recipe_dict
from trtvocab.artifact.recipe import load_recipe, parse_recipe
from trtvocab.errors import ConfigError


@pytest.mark.parametrize("section, key, value, text", [
    ("mapping", "tp_size", True, "[mapping] tp_size: Input should be a valid integer (got True)"),
    ("mapping", "tp_size", "4", "[mapping] tp_size: Input should be a valid integer (got '4')"),
    ("mapping", "tp_size", 10**18, "allowed: [1, 4096]"),
    ("mapping", "tp_size", 10**23, "allowed: [1, 4096]"),
    ("lm_head", "pad_to", 1e12, "[lm_head] pad_to: Input should be a valid integer"),
    ("lm_head", "pad_to", 10**12, "[lm_head] pad_to: Input should be less than or equal to 1048576"),
    ("checkpoint.synthetic", "vocab_size", 1e12, "[checkpoint.synthetic] vocab_size: Input should be a valid integer"),
    ("checkpoint.synthetic", "vocab_size", 10**12, "allowed: [1, 2147483647]"),
    ("checkpoint.synthetic", "seed", -1, "[checkpoint.synthetic] seed"),
    ("checkpoint.synthetic", "std", float("inf"), "[checkpoint.synthetic] std"),
    ("lm_head", "gather_output", 1, "[lm_head] gather_output: Input should be a valid boolean"),
])
def test_recipe_values_are_typed_and_bounded(section: str, key: str, value: Any, text: str) -> None:
    data = recipe_dict(Path("o"))
    node = data
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[key] = value
    with pytest.raises(ConfigError) as info:
        parse_recipe(data, "hostile.toml")
    assert "hostile.toml" in str(info.value) and text in str(info.value), str(info.value)


def test_recipe_padded_past_the_vocab_limit_is_refused() -> None:
    data = recipe_dict(Path("o"), vocab_layout="padded", pad_to=2**20)
    data["mapping"]["tp_size"] = 4096
    data["checkpoint"]["synthetic"]["vocab_size"] = 4096
    with pytest.raises(ConfigError, match="pads the vocab past 2147483647"):
        parse_recipe(data, "x.toml")


@pytest.mark.parametrize("content, text", [
    (b'[checkpoint]\npath = "caf\xe9"\n', "not UTF-8"),
    (b"a = " + b"[" * 50_000 + b"]" * 50_000 + b"\n", "not a TOML file trtvocab can read"),
    (b"[mapping]\ntp_size = 1" + b"0" * 5000 + b"\n", "r.toml"),
])
def test_recipe_files_that_are_not_recipes(tmp_path: Path, content: bytes, text: str) -> None:
    path = tmp_path / "r.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    assert str(path) in str(info.value) and text in str(info.value)
