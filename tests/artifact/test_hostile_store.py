"""Hostile artifacts (``trtvocab/artifact/store.py``): a manifest edited to disagree with the shard math, its
files or itself is refused naming the field; so are a manifest that is not one, a file the manifest does not
list and a listed symlink leading outside. A runtime cache an earlier run left beside a plan is passed over.
On the command line, each refusal is one error line.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from tests.hostile import H, assert_cli_error, both, build_art, cli, copy_art, edit_manifest, set_field
from trtvocab.artifact import store as artifacts
from trtvocab.errors import ArtifactError


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_art(tmp_path_factory)


# ==== the manifest must agree with the shard math, the files and itself =======================================
MANIFEST_CASES: dict[str, tuple[Any, bool, str]] = {  # case -> (edit, redigest, text the error contains)
    "end + 1 (shifted ids)": (set_field("ranks.0.end", 52), True, "field ranks[0].end: 52"),
    "start - 1": (set_field("ranks.1.start", 50), True, "field ranks[1].start: 50"),
    "overlapping ranges": (both(set_field("ranks.0.end", 60), set_field("ranks.0.width", 60)), True,
                           "field ranks[0].end"),
    "vocab edited with the ranges": (both(set_field("head.vocab_size", 102),
                                          set_field("recipe.checkpoint.synthetic.vocab_size", 102),
                                          set_field("ranks.1.end", 102), set_field("ranks.1.width", 51)),
                                     True, "records end '101', the manifest says 102"),
    "head dtype edited (with the recipe)": (both(set_field("head.dtype", "bfloat16"),
                                                 set_field("recipe.lm_head.dtype", "bfloat16")),
                                            True, "weight is F32 [51, 16], the manifest says BF16"),
    "head dtype edited alone": (set_field("head.dtype", "bfloat16"), True, "field head.dtype"),
    "context_logits edited alone": (set_field("head.context_logits", True), True, "field head.context_logits"),
    "weights dropped from files": (lambda m: m["files"].pop("rank0/weights.safetensors"), True,
                                   "field ranks[0].files.weights: 'rank0/weights.safetensors' is not listed"),
    "rank file pointing at another rank": (set_field("ranks.0.files.weights", "rank1/weights.safetensors"), True,
                                           "field ranks[0].files.weights"),
    "absolute path in files": (lambda m: m["files"].update({"/etc/passwd": {"sha256": "0" * 64, "bytes": 1}}), True,
                               "field files['/etc/passwd']: '/etc/passwd' is not a normalized relative path"),
    "dot-dot path in files": (lambda m: m["files"].update({"rank0/../../x": {"sha256": "0" * 64, "bytes": 1}}), True,
                              "field files['rank0/../../x']"),
    "start as a string": (set_field("ranks.0.start", "0"), True, "ranks.0.start"),
    "tp_size true": (both(set_field("mapping.tp_size", True), set_field("recipe.mapping.tp_size", True)), True,
                     "mapping.tp_size"),
    "huge vocab": (set_field("head.vocab_size", 10**23), True, "head.vocab_size"),
    "files entry {}": (lambda m: m["files"].__setitem__("rank0/weights.safetensors", {}), True,
                       "files.rank0/weights.safetensors"),
    "key missing": (lambda m: m.pop("head"), True, "does not match the manifest schema"),
    "edited without updating the digest": (set_field("ranks.0.end", 52), False, "field digest: does not match"),
    "digest removed": (lambda m: m.pop("digest"), False, "field digest: missing"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_edited_manifest_is_refused_naming_the_field(art: Path, tmp_path: Path, case: str) -> None:
    root = copy_art(art, tmp_path / "c")
    mutate, redigest, text = MANIFEST_CASES[case]
    edit_manifest(root, mutate, redigest=redigest)
    with pytest.raises(ArtifactError) as info:
        artifacts.read_manifest(root)
    assert text in str(info.value), str(info.value)
    assert "manifest.json" in str(info.value) or "weights.safetensors" in str(info.value)


@pytest.mark.parametrize("content, text", [
    (b"[1, 2, 3]", "not a trtvocab artifact (format 'list')"),
    (b'{"format": "trtvocab-artifact", "name": "\xff\xfe"}', "not UTF-8"),
    (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
])
def test_manifest_that_is_not_a_manifest(art: Path, tmp_path: Path, content: bytes, text: str) -> None:
    root = copy_art(art, tmp_path / "c")
    (root / "manifest.json").write_bytes(content)
    with pytest.raises(ArtifactError, match=r"manifest\.json") as info:
        artifacts.read_manifest(root)
    assert text in str(info.value)


def test_unlisted_file_in_a_rank_folder_is_refused(art: Path, tmp_path: Path) -> None:
    root = copy_art(art, tmp_path / "c")
    (root / "rank0" / "lm_head.onnx.data").write_bytes(b"\x00" * 64)
    with pytest.raises(ArtifactError, match=r"rank0/lm_head\.onnx\.data: not listed in the manifest"):
        artifacts.read_manifest(root)


def test_listed_symlink_leading_outside_is_refused(art: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    root = copy_art(art, tmp_path / "c")
    os.symlink(secret, root / "link.txt")
    record = {"sha256": hashlib.sha256(secret.read_bytes()).hexdigest(), "bytes": secret.stat().st_size}
    edit_manifest(root, lambda m: m["files"].update({"link.txt": record}))
    with pytest.raises(ArtifactError, match=r"field files\['link.txt'\]: 'link.txt' leads outside the artifact"):
        artifacts.read_manifest(root)


def test_cli_inspect_of_an_edited_manifest_is_one_error_line(art: Path, tmp_path: Path) -> None:
    root = copy_art(art, tmp_path / "c")
    edit_manifest(root, set_field("ranks.0.end", 52))
    assert_cli_error(*cli("inspect", str(root)), "ArtifactError", "ranks[0].end")


def test_cli_infer_after_a_dtype_edit_has_no_traceback(art: Path, tmp_path: Path) -> None:
    root = copy_art(art, tmp_path / "c")
    edit_manifest(root, both(set_field("head.dtype", "bfloat16"), set_field("recipe.lm_head.dtype", "bfloat16")))
    hidden = tmp_path / "h.safetensors"
    hidden.write_bytes(save({"hidden_states": torch.randn(3, H)}))
    assert_cli_error(*cli("infer", str(root), "--hidden", str(hidden), "--backend", "torch"), "ArtifactError",
                     "weights.safetensors")


# ==== the TensorRT-RTX runtime cache never lands in (and never bricks) an artifact ============================
def test_p11_x10_runtime_cache_an_earlier_run_left_does_not_brick_the_artifact(art: Path, tmp_path: Path) -> None:
    """p11 / x10: ``rank0/lm_head.plan.runtime-cache`` (what the RTX runner wrote after its first run) made
    every later ``inspect`` / ``infer`` / ``generate --artifact`` refuse the artifact. It is never opened
    (caches live outside artifacts now), so it is passed over; any other unlisted file is still refused."""
    root = copy_art(art, tmp_path / "p11")
    for name in ("lm_head.plan.runtime-cache", "embedding.plan.runtime-cache"):
        (root / "rank0" / name).write_bytes(bytes(range(256)) * 16)
    artifacts.read_manifest(root)
    code, output = cli("inspect", str(root))
    assert code == 0, output
    (root / "rank1" / "lm_head.plan.runtime-cache.tmp").write_bytes(b"x")
    with pytest.raises(ArtifactError, match=r"runtime-cache\.tmp: not listed"):
        artifacts.read_manifest(root)
