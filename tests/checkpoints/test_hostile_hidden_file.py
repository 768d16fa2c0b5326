"""Hostile hidden-states files (``trtvocab/checkpoints/hidden_file.py``): NaN rows, ``next_token_ids`` that
break the teacher-forced relation, ``last_tokens`` metadata that is not JSON -- an InputError naming the
file and the row, through the API and the command line (before any inference).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save, save_file

from tests.hostile import H, V, assert_cli_error, build_art, cli, forbid_inference
from trtvocab.errors import InputError


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_art(tmp_path_factory)


@pytest.fixture
def no_inference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the CLI runs inference: every refusal below must come before it."""
    forbid_inference(monkeypatch)


def test_nan_in_a_hidden_file_is_refused_by_infer_and_compare(art: Path, tmp_path: Path) -> None:
    from trtvocab.checkpoints.hidden_file import load_hidden

    x = torch.randn(6, H)
    x[3, 0] = float("nan")
    path = tmp_path / "nan.safetensors"
    path.write_bytes(save({"hidden_states": x}))
    with pytest.raises(InputError, match=r"nan\.safetensors: hidden_states: contains NaN or inf \(first at row 3"):
        load_hidden(path)
    assert_cli_error(*cli("infer", str(art), "--hidden", str(path)), "InputError", "row 3")
    assert_cli_error(*cli("compare", str(tmp_path / "any-baseline"), "--hidden", str(path)), "InputError", "row 3")


def test_cli_infer_refuses_last_tokens_that_are_not_json(art: Path, tmp_path: Path, no_inference) -> None:
    path = tmp_path / "h.safetensors"
    path.write_bytes(save({"hidden_states": torch.randn(2, H)}, metadata={"last_tokens": "['not', json"}))
    assert_cli_error(*cli("infer", str(art), "--hidden", str(path)), "InputError",
                     "metadata last_tokens is not JSON")


# ==== the teacher-forced relation =============================================================================
def _tf_file(path: Path, input_ids: list[int], next_ids: list[int], seq_lens: list[int] | None) -> Path:
    tensors = {"hidden_states": torch.randn(len(input_ids), H), "input_ids": torch.tensor(input_ids),
               "next_token_ids": torch.tensor(next_ids)}
    if seq_lens is not None:
        tensors["seq_lens"] = torch.tensor(seq_lens, dtype=torch.int32)
    path.write_bytes(save(tensors))
    return path


@pytest.mark.parametrize("input_ids, next_ids, seq_lens, text", [
    # inside a sequence: the next id is not the input id of the row after it
    ([1, 2, 3, 4, 5], [2, 9, 4, -1, -1], [4, 1], r"next_token_ids\[1\] = 9 but input_ids\[2\] = 3"),
    # the last row of sequence 0 points at sequence 1's first id
    ([1, 2, 3, 4, 5], [2, 3, 4, 5, -1], [4, 1], r"next_token_ids\[3\] = 5 at the last row of sequence 0"),
    # no seq_lens: one sequence, whose last row must be -1
    ([1, 2, 3], [2, 3, 4], None, r"next_token_ids\[2\] = 4 at the last row of sequence 0"),
])
def test_hidden_files_must_hold_the_teacher_forced_relation(tmp_path: Path, input_ids, next_ids, seq_lens,
                                                            text: str) -> None:
    """A hidden file whose next_token_ids disagree with its input_ids is refused, naming the row."""
    from trtvocab.checkpoints.hidden_file import load_hidden_file

    path = _tf_file(tmp_path / "h.safetensors", input_ids, next_ids, seq_lens)
    with pytest.raises(InputError, match=text):
        load_hidden_file(path)
    ckpt = tmp_path / "base.safetensors"
    save_file({"lm_head.weight": torch.randn(V, H)}, str(ckpt))
    assert_cli_error(*cli("compare", str(ckpt), "--hidden", str(path), "--simulate", "fp8"), "InputError",
                     str(path), "next_token_ids[")


def test_hidden_files_holding_the_relation_load(tmp_path: Path) -> None:
    from trtvocab.checkpoints.hidden_file import load_hidden_file

    # -1 inside a sequence is a row without a target (not scored); seq_lens that do not tile are left to
    # the reader that uses them
    good = _tf_file(tmp_path / "g.safetensors", [1, 2, 3, 4, 5], [2, -1, 4, -1, -1], [4, 1])
    assert load_hidden_file(good).next_token_ids.tolist() == [2, -1, 4, -1, -1]
    assert load_hidden_file(_tf_file(tmp_path / "one.safetensors", [1, 2, 3], [2, 3, -1], None)).seq_lens is None
