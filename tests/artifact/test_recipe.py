"""Recipe validation: unknown keys, wrong types, missing checkpoint, tp larger than the vocab."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtvocab.artifact.recipe import load_recipe, parse_recipe
from trtvocab.errors import ConfigError

BUILDERS = Path(__file__).resolve().parents[2] / "builders"


@pytest.mark.parametrize("name", sorted(p.name for p in BUILDERS.glob("*.toml")))
def test_shipped_recipes_validate(name: str) -> None:
    recipe = load_recipe(BUILDERS / name)
    assert recipe.mapping.tp_size >= 1


def test_unknown_key_names_file_section_key_and_allowed(tmp_path: Path) -> None:
    f = tmp_path / "r.toml"
    f.write_text('[checkpoint]\npath = "."\n[lm_head]\ndtyp = "bfloat16"\n')
    with pytest.raises(ConfigError) as exc:
        load_recipe(f)
    msg = str(exc.value)
    assert str(f) in msg and "[lm_head] dtyp" in msg and "allowed keys: dtype" in msg


def test_unknown_section(tmp_path: Path) -> None:
    f = tmp_path / "r.toml"
    f.write_text('[checkpoint]\npath = "."\n[quantisation]\nmode = "auto"\n')
    with pytest.raises(ConfigError, match=r"quantisation: unknown key; allowed keys: .*quantization"):
        load_recipe(f)


def test_wrong_type_and_bad_value() -> None:
    with pytest.raises(ConfigError, match=r"\[mapping\] tp_size"):
        parse_recipe({"checkpoint": {"path": "."}, "mapping": {"tp_size": "four"}}, "x.toml")
    with pytest.raises(ConfigError, match=r"\[lm_head\] dtype"):
        parse_recipe({"checkpoint": {"path": "."}, "lm_head": {"dtype": "int8"}}, "x.toml")
    with pytest.raises(ConfigError, match="min_tokens <= opt_tokens"):
        parse_recipe({"checkpoint": {"path": "."}, "profile": {"min_tokens": 9, "opt_tokens": 2}}, "x.toml")


def test_missing_checkpoint(tmp_path: Path) -> None:
    f = tmp_path / "r.toml"
    f.write_text('[checkpoint]\npath = "no/such/dir"\n')
    recipe = load_recipe(f)
    with pytest.raises(ConfigError, match="does not exist"):
        recipe.checkpoint_path()
    with pytest.raises(ConfigError, match="exactly one of path, package, synthetic"):
        parse_recipe({"checkpoint": {}}, "x.toml")
    with pytest.raises(ConfigError, match="not installed"):
        parse_recipe({"checkpoint": {"package": "no_such_pkg_xyz"}}, "x.toml").checkpoint_path()


def test_tp_larger_than_vocab() -> None:
    with pytest.raises(ConfigError, match="larger than the vocab"):
        parse_recipe({"checkpoint": {"synthetic": {"vocab_size": 4, "hidden_size": 8}}, "mapping": {"tp_size": 8}})


def test_not_toml(tmp_path: Path) -> None:
    f = tmp_path / "r.toml"
    f.write_text("[checkpoint\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_recipe(f)
    with pytest.raises(ConfigError, match="no such file"):
        load_recipe(tmp_path / "missing.toml")
