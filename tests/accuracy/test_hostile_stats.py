"""Accuracy options bounded before any work (``trtvocab/accuracy/stats.py``): ``--bootstrap`` past 100000
resamples, or a negative or too large ``--seed``, is a ConfigError naming the option and its range.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save, save_file

from tests.hostile import H, V, assert_cli_error, cli
from trtvocab.errors import ConfigError


@pytest.mark.parametrize("args, text", [
    (["--bootstrap", "1000000000"], "--bootstrap: resamples must be an int in [0, 100000]"),
    (["--bootstrap", "-1"], "--bootstrap: resamples must be an int in [0, 100000]"),
    (["--seed", "-1"], "--seed: the bootstrap seed must be an int in [0, 2**63 - 1]"),
    (["--seed", str(2**63)], "--seed: the bootstrap seed must be an int in [0, 2**63 - 1]"),
])
def test_cli_compare_bounds_bootstrap_and_seed(tmp_path: Path, args: list[str], text: str) -> None:
    """--bootstrap 1000000000 (74.5 GiB of resamples) and --seed -1 are ConfigErrors naming the option and
    its range, before any work (not an ArrayMemoryError or a ValueError traceback)."""
    ckpt = tmp_path / "base.safetensors"
    save_file({"lm_head.weight": torch.randn(V, H)}, str(ckpt))
    hidden = tmp_path / "h.safetensors"
    ids = torch.tensor([5, 7, 9, 11])
    hidden.write_bytes(save({"hidden_states": torch.randn(4, H), "seq_lens": torch.tensor([4], dtype=torch.int32),
                             "input_ids": ids, "next_token_ids": torch.tensor([7, 9, 11, -1])}))
    assert_cli_error(*cli("compare", str(ckpt), "--hidden", str(hidden), "--simulate", "fp8", *args),
                     "ConfigError", text)


def test_llamacpp_stats_bounds_bootstrap_and_seed() -> None:
    from trtvocab.accuracy.stats import MAX_BOOTSTRAP, check_bootstrap

    check_bootstrap(MAX_BOOTSTRAP, 2**63 - 1)
    for bootstrap, seed in ((MAX_BOOTSTRAP + 1, 0), (True, 0), (10, -1), (10, 1.5), (10, 2**63)):
        with pytest.raises(ConfigError, match=r"`bootstrap`|`seed`"):
            check_bootstrap(bootstrap, seed)
