"""Hostile checkpoint files: safetensors files, HF folders and their JSON, GGUF metadata.

Grouped by family: files that are not regular files (they used to block a reader forever),
index entries that lead out of the checkpoint folder, error messages that quoted bytes of a
foreign file, safetensors headers that break the format, config values of the wrong type,
and paths that are not paths. Every case asserts the error's type and that its message names
the input. Cases that used to hang run under a deadline (an interval timer in this process,
or a subprocess with a timeout for the CLI), so a regression fails in seconds instead of
stalling CI. Safetensors files the format forbids are written byte by byte here.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from safetensors.torch import save_file

import trtvocab.base.safetensors_header as st_header
import trtvocab.checkpoints.checkpoint as ckpt_mod
from tests.conftest import model_config, write_hf_dir
from tests.hostile import deadline
from tests.weights.hostile_files import write_blocks_gguf
from trtvocab import LMHead
from trtvocab.base import safe_read
from trtvocab.base.safetensors_header import read_safetensors_header
from trtvocab.checkpoints.checkpoint import Checkpoint, open_checkpoint
from trtvocab.checkpoints.gguf import GGUFCheckpoint
from trtvocab.errors import CheckpointError
from trtvocab.quant.config import resolve_lm_head_quant

V, H = 8, 4
HEAD = torch.arange(V * H, dtype=torch.float32).reshape(V, H)  # row i starts with 4 * i
ENTRY = {"dtype": "F32", "shape": [V, H], "data_offsets": [0, V * H * 4]}
PASSWD = b"root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"
PASSWD_AS_LENGTH = "3475222254926655346"  # b"root:x:0" read as a little-endian u64
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
Q, T = gguf.GGMLQuantizationType, gguf.GGUFValueType


def st_bytes(header: Any, data: bytes = b"", *, raw: bytes | None = None) -> bytes:
    """A safetensors file by hand: 8-byte little-endian header length, the JSON header, the data."""
    body = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


def head_file(path: Path) -> Path:
    """A valid one-tensor file written by hand: ``lm_head.weight`` = HEAD."""
    path.write_bytes(st_bytes({"lm_head.weight": ENTRY}, HEAD.numpy().tobytes()))
    return path


def hf_dir(folder: Path, tensors: dict[str, torch.Tensor] | None = None, config: dict | None = None,
           **kw: Any) -> Path:
    return write_hf_dir(folder, tensors or {"lm_head.weight": HEAD, "model.norm.weight": torch.ones(H)},
                        config if config is not None else model_config(V, H, tie_word_embeddings=False), **kw)


def write_index(folder: Path, weight_map: Any, **extra: Any) -> Path:
    path = folder / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map, **extra}))
    return path


def refused(call: Any, *needles: str) -> str:
    """``call()`` raises CheckpointError (within seconds) whose message holds every needle."""
    with deadline(), pytest.raises(CheckpointError) as info:
        call()
    message = str(info.value)
    for needle in needles:
        assert needle in message, (needle, message)
    return message


# ==== only regular files are opened (these used to block forever) =========================================
def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def test_fifo_as_the_only_shard_of_a_folder(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(model_config(V, H)))
    fifo = _fifo(folder / "model.safetensors")
    refused(lambda: Checkpoint(folder), str(fifo), "FIFO", "expected a regular file")
    refused(lambda: LMHead.from_checkpoint(folder), str(fifo), "FIFO")
    refused(lambda: resolve_lm_head_quant(folder), str(fifo), "FIFO")


def test_fifo_as_a_shard_the_index_names(tmp_path: Path) -> None:
    folder = hf_dir(tmp_path / "model")
    shard = next(folder.glob("model-00002-*.safetensors"))
    shard.unlink()
    _fifo(shard)
    refused(lambda: LMHead.from_checkpoint(folder), str(shard), "FIFO")


def test_fifo_as_a_single_file_checkpoint(tmp_path: Path) -> None:
    fifo = _fifo(tmp_path / "model.safetensors")
    refused(lambda: Checkpoint(fifo), f"checkpoint {fifo}: is a FIFO", "expected an HF folder or a regular")
    refused(lambda: LMHead.from_checkpoint(fifo), str(fifo), "FIFO")
    refused(lambda: read_safetensors_header(fifo, "safetensors file", CheckpointError), str(fifo), "FIFO")


@pytest.mark.parametrize("name", ["config.json", "hf_quant_config.json", "model.safetensors.index.json"])
def test_fifo_as_a_json_file_of_the_folder(tmp_path: Path, name: str) -> None:
    folder = hf_dir(tmp_path / "model", index=False)
    if (folder / name).exists():
        (folder / name).unlink()
    fifo = _fifo(folder / name)
    refused(lambda: Checkpoint(folder), str(fifo), "FIFO")


def test_symlink_to_dev_zero_is_refused_before_it_is_read(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    os.symlink("/dev/zero", folder / "model.safetensors")
    refused(lambda: Checkpoint(folder), str(folder / "model.safetensors"), "character device")
    refused(lambda: Checkpoint(folder / "model.safetensors"), "character device")


def test_fifo_gguf_through_open_checkpoint_and_from_checkpoint(tmp_path: Path) -> None:
    fifo = _fifo(tmp_path / "model.gguf")
    refused(lambda: open_checkpoint(fifo), str(fifo), "expected a regular .gguf file")
    refused(lambda: LMHead.from_checkpoint(fifo), str(fifo), "expected a regular .gguf file")


@pytest.mark.subprocess
def test_cli_plan_on_a_fifo_checkpoint_returns_one_error_line(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    fifo = _fifo(folder / "model.safetensors")
    # no hang: subprocess.run's timeout raises TimeoutExpired
    res = subprocess.run([sys.executable, "-c", "from trtvocab.commands.cli import main; main()", "plan", str(folder)],
                         env=ENV, timeout=120, capture_output=True, text=True)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out, out
    assert len([ln for ln in out.splitlines() if "error:" in ln]) == 1, out
    assert "CheckpointError" in out and str(fifo) in out and "FIFO" in out, out


class _Counting:
    """Stands in for ``open_regular`` where checkpoints read files and counts the bytes read."""

    def __init__(self) -> None:
        self.read = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fh = safe_read.open_regular(*args, **kwargs)  # handed back to the caller's with-block
        counter = self

        class Wrapped:
            def __enter__(self) -> Wrapped:
                return self

            def __exit__(self, *exc: Any) -> None:
                fh.close()

            def read(self, n: int = -1) -> bytes:
                data = fh.read(n)
                counter.read += len(data)
                return data

            def readinto(self, buf: Any) -> int:
                got = fh.readinto(buf) or 0
                counter.read += got
                return got

            def fileno(self) -> int:
                return fh.fileno()

            def seek(self, *a: Any) -> int:
                return fh.seek(*a)

        return Wrapped()


def test_probes_read_exactly_the_header_and_a_read_exactly_its_rows(tmp_path: Path, monkeypatch) -> None:
    path = head_file(tmp_path / "head.safetensors")
    header_bytes = 8 + len(json.dumps({"lm_head.weight": ENTRY}).encode())
    counter = _Counting()
    monkeypatch.setattr(ckpt_mod, "open_regular", counter)
    monkeypatch.setattr(st_header, "open_regular", counter)
    ckpt = Checkpoint(path)
    assert counter.read == header_bytes
    assert torch.equal(ckpt.get_slice("lm_head.weight")[2:5], HEAD[2:5])
    assert counter.read == header_bytes + 3 * H * 4


# ==== index entries are file names inside the checkpoint folder ============================================
@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A valid safetensors file next to (not inside) the checkpoint folder, and a passwd-like file."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_bytes(PASSWD)
    save_file({"lm_head.weight": torch.full((V, H), 7.0)}, str(tmp_path / "outside.safetensors"))
    return tmp_path / "outside.safetensors"


@pytest.mark.parametrize("value", [
    "../outside.safetensors", "../../etc/passwd", "../etc/passwd", "/etc/passwd", "ABSOLUTE",
    "sub/model.safetensors", "sub\\model.safetensors", "./model-00001-of-00002.safetensors", "..", ".", "",
    "model-00001-of-00002.safetensors\x00", "config.json",
])
def test_index_entries_leading_out_of_the_folder_are_refused(tmp_path: Path, outside: Path, value: str) -> None:
    folder = hf_dir(tmp_path / "model")
    value = str(outside) if value == "ABSOLUTE" else value
    index = write_index(folder, {"lm_head.weight": value, "model.norm.weight": "model-00002-of-00002.safetensors"})
    message = refused(lambda: LMHead.from_checkpoint(folder), str(index), "weight_map['lm_head.weight']",
                      repr(value)[:60], "is not a plain .safetensors file name")
    assert PASSWD_AS_LENGTH not in message and "root:x" not in message


@pytest.mark.parametrize("value", [5, None, True, ["model-00001-of-00002.safetensors"], {"file": "x.safetensors"}])
def test_index_values_that_are_not_strings(tmp_path: Path, value: Any) -> None:
    folder = hf_dir(tmp_path / "model")
    index = write_index(folder, {"lm_head.weight": value, "model.norm.weight": "model-00002-of-00002.safetensors"})
    refused(lambda: Checkpoint(folder), str(index), "weight_map['lm_head.weight'] must be a shard file name")


@pytest.mark.parametrize(("content", "text"), [
    ("[]", "expected a JSON object, got a JSON array"), ('"weights"', "got a JSON string"),
    ("7", "got a JSON integer"), ('{"weight_map": []}', "no 'weight_map' object"),
    ('{"weight_map": "model.safetensors"}', "no 'weight_map' object"), ("{", "is not JSON"),
])
def test_index_that_is_not_an_index(tmp_path: Path, content: str, text: str) -> None:
    folder = hf_dir(tmp_path / "model")
    (folder / "model.safetensors.index.json").write_text(content)
    refused(lambda: Checkpoint(folder), str(folder / "model.safetensors.index.json"), text)


def test_hf_cache_snapshot_of_symlinks_still_loads(tmp_path: Path) -> None:
    """The HF hub cache layout: snapshots/<rev>/<file> -> ../../blobs/<sha>. Allowed: the index
    names a file inside the snapshot folder; that entry is a symlink to a regular file."""
    built = hf_dir(tmp_path / "built")
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(built.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        blob.write_bytes(f.read_bytes())
        os.symlink(f"../../blobs/{blob.name}", snapshot / f.name)
    ckpt = Checkpoint(snapshot)
    assert all(p.is_symlink() for p in ckpt.files) and len(ckpt.files) == 2
    head = LMHead.from_checkpoint(snapshot, dtype=torch.float32)
    assert torch.equal(head.weights.weight, HEAD)


def test_index_entry_that_is_a_symlink_to_a_fifo_is_refused(tmp_path: Path) -> None:
    folder = hf_dir(tmp_path / "model")
    shard = next(folder.glob("model-00001-*.safetensors"))
    shard.unlink()
    fifo = _fifo(tmp_path / "pipe")
    os.symlink(fifo, shard)
    refused(lambda: Checkpoint(folder), str(shard), "FIFO")


def test_index_that_misplaces_a_tensor_is_refused(tmp_path: Path) -> None:
    folder = hf_dir(tmp_path / "model")  # lm_head.weight is in shard 1, model.norm.weight in shard 2
    index = write_index(folder, {"lm_head.weight": "model-00002-of-00002.safetensors",
                                 "model.norm.weight": "model-00001-of-00002.safetensors"})
    refused(lambda: Checkpoint(folder), str(index), "weight_map puts 'lm_head.weight' in "
            "model-00002-of-00002.safetensors, but it is in model-00001-of-00002.safetensors")
    index = write_index(folder, {"lm_head.weight": "model-00001-of-00002.safetensors",
                                 "model.norm.weight": "model-00002-of-00002.safetensors",
                                 "model.lost.weight": "model-00002-of-00002.safetensors"})
    refused(lambda: Checkpoint(folder), str(index), "'model.lost.weight' in model-00002-of-00002.safetensors, "
            "but it is in no shard file")


@pytest.mark.parametrize("with_index", [True, False])
def test_one_tensor_in_two_shard_files_is_refused(tmp_path: Path, with_index: bool) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"lm_head.weight": HEAD}, str(folder / "a.safetensors"))
    save_file({"lm_head.weight": HEAD + 1}, str(folder / "b.safetensors"))
    if with_index:
        write_index(folder, {"lm_head.weight": "a.safetensors", "model.norm.weight": "b.safetensors"})
    refused(lambda: LMHead.from_checkpoint(folder), str(folder), "'lm_head.weight' is in two shard files, "
            "a.safetensors and b.safetensors")


# ==== error messages never quote bytes of a file that is not ours ===========================================
def test_passwd_named_safetensors_gives_no_bytes_away(tmp_path: Path) -> None:
    path = tmp_path / "passwd.safetensors"
    path.write_bytes(PASSWD)
    message = refused(lambda: Checkpoint(path), f"{path}: not a safetensors file (implausible header length)")
    assert PASSWD_AS_LENGTH not in message and "root:x" not in message and "bash" not in message


def test_symlinked_foreign_file_inside_the_folder_gives_no_bytes_away(tmp_path: Path, outside: Path) -> None:
    """A name inside the folder may be a symlink anywhere (as in an HF cache); a target that is
    not a safetensors file is refused without quoting it."""
    folder = hf_dir(tmp_path / "model")
    os.symlink(tmp_path / "etc" / "passwd", folder / "evil.safetensors")
    write_index(folder, {"lm_head.weight": "evil.safetensors", "model.norm.weight": "model-00002-of-00002.safetensors"})
    message = refused(lambda: LMHead.from_checkpoint(folder), str(folder / "evil.safetensors"),
                      "not a safetensors file (implausible header length)")
    assert PASSWD_AS_LENGTH not in message and "root:x" not in message and "bash" not in message


@pytest.mark.parametrize(("data", "secret"), [
    (struct.pack("<Q", 2**40) + b"{}", str(2**40)),  # more than the format allows
    (struct.pack("<Q", 5000) + b"{}" + b" " * 100, "5000"),  # more than the file holds
], ids=["over-the-format-limit", "over-the-file-size"])
def test_implausible_header_length_is_not_printed(tmp_path: Path, data: bytes, secret: str) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    message = refused(lambda: Checkpoint(path), f"{path}: not a safetensors file (implausible header length)")
    assert secret not in message


def test_header_that_is_not_utf8_is_not_quoted(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(st_bytes(None, raw=b'{"\xff\xfe\xfd": 1}'))
    message = refused(lambda: Checkpoint(path), str(path), "safetensors header is not UTF-8 text (at byte 2)")
    assert "xff" not in message and "\ufffd" not in message


# ==== safetensors headers as the format requires ============================================================
def _two(a: list[int], b: list[int]) -> dict[str, Any]:
    return {"a": {"dtype": "F32", "shape": [4], "data_offsets": a}, "b": {"dtype": "F32", "shape": [4],
                                                                          "data_offsets": b}}


BAD_HEADERS = {  # case -> (header, data, text the message holds)
    "header is a list": ([], b"", "safetensors header is a JSON array, expected an object"),
    "header is a string": ("lm_head.weight", b"", "safetensors header is a JSON string, expected an object"),
    "entry is a number": ({"a": 5}, b"", "tensor 'a': header entry is a JSON integer"),
    "entry lacks keys": ({"a": {"dtype": "F32"}}, b"", "tensor 'a': header entry lacks shape/data_offsets"),
    "unknown dtype": ({"a": {**ENTRY, "dtype": "F7"}}, bytes(128), "dtype 'F7' is not a safetensors dtype"),
    "dtype not a string": ({"a": {**ENTRY, "dtype": 32}}, bytes(128), "dtype 32 is not a safetensors dtype"),
    "float shape": ({"a": {**ENTRY, "shape": [8.9, 4.5]}}, bytes(128), "shape must be a list of at most 64 "
                    "non-negative integers, got [8.9, 4.5]"),
    "integral float shape": ({"a": {**ENTRY, "shape": [8.0, 4]}}, bytes(128), "got [8.0, 4]"),
    "bool shape": ({"a": {**ENTRY, "shape": [True, 32]}}, bytes(128), "got [True, 32]"),
    "negative dim": ({"a": {**ENTRY, "shape": [-8, -4]}}, bytes(128), "got [-8, -4]"),
    "shape a string": ({"a": {**ENTRY, "shape": "8,4"}}, bytes(128), "got '8,4'"),
    "65 dims": ({"a": {**ENTRY, "shape": [1] * 62 + [2, 4, 4]}}, bytes(128), "at most 64"),
    "one offset": ({"a": {**ENTRY, "data_offsets": [128]}}, bytes(128), "data_offsets must be [begin, end]"),
    "three offsets": ({"a": {**ENTRY, "data_offsets": [0, 64, 128]}}, bytes(128), "got [0, 64, 128]"),
    "float offset": ({"a": {**ENTRY, "data_offsets": [0.0, 128]}}, bytes(128), "got [0.0, 128]"),
    "bool offset": ({"a": {**ENTRY, "data_offsets": [False, 128]}}, bytes(128), "got [False, 128]"),
    "reversed offsets": ({"a": {**ENTRY, "data_offsets": [128, 0]}}, bytes(128), "0 <= begin <= end"),
    "negative offset": ({"a": {**ENTRY, "data_offsets": [-128, 0]}}, bytes(128), "got [-128, 0]"),
    "span too short": ({"a": {**ENTRY, "data_offsets": [0, 96]}}, bytes(96),
                       "tensor 'a' spans 96 bytes, but F32 [8, 4] needs 128"),
    "span too long": ({"a": {**ENTRY, "data_offsets": [0, 160]}}, bytes(160), "spans 160 bytes"),
    "sub-byte elements": ({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2), "needs 1.5"),
    "overlap": (_two([0, 16], [8, 24]), bytes(24), "tensor 'b' data [8, 24) overlaps tensor 'a' [0, 16)"),
    "same span twice": (_two([0, 16], [0, 16]), bytes(16), "overlaps tensor"),
    "gap": (_two([0, 16], [20, 36]), bytes(36), "4 bytes at data offset 16 before tensor 'b' belong to no tensor"),
    "not from 0": ({"a": {**ENTRY, "data_offsets": [4, 132]}}, bytes(132), "4 bytes at data offset 0 before tensor "
                   "'a' belong to no tensor (spans must be contiguous from offset 0)"),
    "both shifted": (_two([4, 20], [20, 36]), bytes(36), "4 bytes at data offset 0 before tensor 'a'"),
    "bytes after the last": ({"a": ENTRY}, bytes(136), "8 bytes after the last tensor's data belong to no tensor"),
    "metadata not strings": ({"__metadata__": {"format": 1}, "a": ENTRY}, bytes(128),
                             "__metadata__ must be an object of strings"),
    "metadata a list": ({"__metadata__": ["pt"], "a": ENTRY}, bytes(128), "__metadata__ must be an object"),
    "empty header": (None, b"", "safetensors header is not JSON (Expecting value at character 0)"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_header_that_breaks_the_format_is_refused(tmp_path: Path, case: str) -> None:
    header, data, text = BAD_HEADERS[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(st_bytes(header, data, raw=b"" if header is None else None))
    refused(lambda: Checkpoint(path), f"{path}", text)
    refused(lambda: read_safetensors_header(path, "safetensors file", CheckpointError), text)


def test_duplicate_tensor_name_in_one_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "dup.safetensors"
    one = json.dumps(ENTRY)
    path.write_bytes(st_bytes(None, HEAD.numpy().tobytes(), raw=f'{{"a": {one}, "a": {one}}}'.encode()))
    refused(lambda: Checkpoint(path), str(path), "safetensors header holds the key 'a' twice")


def test_float_shape_is_not_truncated_into_a_head(tmp_path: Path) -> None:
    """[8.9, 4.5] used to be read as [8, 4]."""
    path = tmp_path / "head.safetensors"
    path.write_bytes(st_bytes({"lm_head.weight": {**ENTRY, "shape": [8.9, 4.5]}}, HEAD.numpy().tobytes()))
    refused(lambda: LMHead.from_checkpoint(path), str(path), "'lm_head.weight'", "got [8.9, 4.5]")


def test_tiny_file_claiming_32_gib_is_refused_before_allocating(tmp_path: Path, monkeypatch) -> None:
    rows, cols = 2**21, 2**12  # float32: 32 GiB
    path = tmp_path / "tiny.safetensors"
    header = {"lm_head.weight": {"dtype": "F32", "shape": [rows, cols], "data_offsets": [0, rows * cols * 4]}}
    path.write_bytes(st_bytes(header, bytes(64)))
    header_bytes = 8 + len(json.dumps(header))
    ckpt = Checkpoint(path)  # header probes still answer (a truncated copy is reported on read)
    assert ckpt.info("lm_head.weight").shape == (rows, cols)

    def no_allocation(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("allocated a buffer for a tensor the file does not hold")

    monkeypatch.setattr(torch, "empty", no_allocation)
    for read in (lambda: ckpt.read("lm_head.weight"), lambda: ckpt.get_slice("lm_head.weight")[0:1],
                 lambda: ckpt.get_slice("lm_head.weight")):  # a caller can check before it allocates
        refused(read, f"{path}: lm_head.weight is truncated (the header declares a "
                f"{header_bytes + rows * cols * 4}-byte file, it holds {header_bytes + 64} bytes)")


def test_file_that_changes_after_opening_is_not_read(tmp_path: Path) -> None:
    path = head_file(tmp_path / "head.safetensors")
    ckpt = Checkpoint(path)
    with open(path, "ab") as fh:
        fh.write(b"\0" * 16)
    refused(lambda: ckpt.read("lm_head.weight"), f"{path}: changed since it was opened")
    os.truncate(path, path.stat().st_size - 32)
    refused(lambda: ckpt.get_slice("lm_head.weight")[0:1], f"{path}: lm_head.weight is truncated")


def test_hand_written_file_the_format_allows_loads(tmp_path: Path) -> None:
    """Control: a zero-size tensor, a string __metadata__ and contiguous spans are fine."""
    header = {"__metadata__": {"format": "pt"}, "empty": {"dtype": "F16", "shape": [0, 4], "data_offsets": [0, 0]},
              "lm_head.weight": ENTRY, "bias": {"dtype": "BF16", "shape": [V], "data_offsets": [128, 144]}}
    path = tmp_path / "ok.safetensors"
    path.write_bytes(st_bytes(header, HEAD.numpy().tobytes() + torch.ones(V, dtype=torch.bfloat16).view(
        torch.uint8).numpy().tobytes()))
    ckpt = Checkpoint(path)
    assert ckpt.names() == ["bias", "empty", "lm_head.weight"]
    assert ckpt.read("empty").shape == (0, 4) and torch.equal(ckpt.read("bias"), torch.ones(V, dtype=torch.bfloat16))
    assert torch.equal(LMHead.from_checkpoint(path, dtype=torch.float32).weights.weight, HEAD)


# ==== config.json and GGUF metadata of the wrong type ========================================================
BAD_CONFIGS = {  # case -> (config.json, key the message names)
    "tie a string": ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    "tie an int": ({"tie_word_embeddings": 0}, "tie_word_embeddings must be true or false"),
    "tie null": ({"tie_word_embeddings": None}, "tie_word_embeddings must be true or false"),
    "text_config a string": ({"text_config": "llama"}, "text_config must be a JSON object, got a JSON string"),
    "text_config a list": ({"text_config": [{"vocab_size": V}]}, "text_config must be a JSON object, got a JSON array"),
    "nested tie a string": ({"text_config": {"tie_word_embeddings": "no"}}, "text_config.tie_word_embeddings must"),
    "vocab a bool": ({"vocab_size": True}, "vocab_size must be a positive integer, got a JSON bool True"),
    "vocab a float": ({"vocab_size": 8.0}, "vocab_size must be a positive integer, got a JSON number 8.0"),
    "vocab a string": ({"vocab_size": "8"}, "vocab_size must be a positive integer, got a JSON string '8'"),
    "vocab zero": ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    "hidden a bool": ({"hidden_size": False}, "hidden_size must be a positive integer, got a JSON bool"),
    "hidden a float": ({"hidden_size": 4.5}, "hidden_size must be a positive integer, got a JSON number 4.5"),
    "hidden negative": ({"hidden_size": -4}, "hidden_size must be a positive integer"),
    "nested hidden a string": ({"text_config": {"hidden_size": "4"}}, "text_config.hidden_size must be a positive"),
    "quantization_config a string": ({"quantization_config": "fp8"}, "quantization_config must be a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_config_values_of_the_wrong_type(tmp_path: Path, case: str) -> None:
    """Only the tied embedding is stored: ``"false"`` used to be truthy and tie the head silently."""
    config, text = BAD_CONFIGS[case]
    folder = hf_dir(tmp_path / "model", {"model.embed_tokens.weight": HEAD}, config)
    refused(lambda: LMHead.from_checkpoint(folder), f"{folder / 'config.json'}: {text}")


@pytest.mark.parametrize(("content", "text"), [
    (b"[1, 2]", "expected a JSON object, got a JSON array"), (b"\xff\xfe{}", "is not UTF-8 text (at byte 0)"),
    (b"[" * 200_000 + b"]" * 200_000, "is not usable JSON (nested too deeply)"),
    (b'{"vocab_size": ' + b"9" * 5000 + b"}", "is not usable JSON"), (b"{'a': 1}", "is not JSON"),
])
@pytest.mark.parametrize("name", ["config.json", "hf_quant_config.json"])
def test_json_files_that_are_not_objects(tmp_path: Path, content: bytes, text: str, name: str) -> None:
    folder = hf_dir(tmp_path / "model")
    (folder / name).write_bytes(content)
    message = refused(lambda: Checkpoint(folder), str(folder / name), text)
    assert "999999" not in message


def test_config_of_the_right_types_still_decides(tmp_path: Path) -> None:
    """Control: a JSON false unties (the stored embedding is not used), a nested int is checked."""
    folder = hf_dir(tmp_path / "untied", {"model.embed_tokens.weight": HEAD}, {"tie_word_embeddings": False})
    refused(lambda: LMHead.from_checkpoint(folder), "config.json says tie_word_embeddings=false")
    folder = hf_dir(tmp_path / "nested", {"model.embed_tokens.weight": HEAD},
                    {"text_config": {"tie_word_embeddings": True, "vocab_size": V, "hidden_size": H}})
    assert torch.equal(LMHead.from_checkpoint(folder, dtype=torch.float32).weights.weight, HEAD)


def write_gguf(path: Path, *metadata: tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]) -> Path:
    """A llama GGUF with a float32 ``output.weight`` [V, H]; ``metadata`` overrides or adds keys."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_embedding_length(H)
    writer.add_token_list([f"t{i}" for i in range(V)])
    for key, value, vtype, sub_type in metadata:
        writer.add_key_value(key, value, vtype, sub_type)
    writer.add_tensor("output.weight", HEAD.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


BAD_GGUF_METADATA = {  # case -> (key, value, type, item type, text)
    "hidden a string": ("llama.embedding_length", "4", T.STRING, None, "must be an integer (UINT32 / UINT64), got "
                        "STRING"),
    "hidden a bool": ("llama.embedding_length", True, T.BOOL, None, "must be an integer (UINT32 / UINT64), got BOOL"),
    "hidden a float": ("llama.embedding_length", 4.0, T.FLOAT32, None,
                       "must be an integer (UINT32 / UINT64), got FLOAT32"),
    "hidden zero": ("llama.embedding_length", 0, T.UINT32, None, "must be positive, got 0"),
    "vocab a string": ("llama.vocab_size", "8", T.STRING, None, "must be an integer (UINT32 / UINT64), got STRING"),
    "architecture a number": ("general.architecture", 7, T.UINT32, None, "must be a STRING, got UINT32"),
    "alignment a bool": ("general.alignment", True, T.BOOL, None, "must be an integer (UINT32), got BOOL"),
    "tokens a number": ("tokenizer.ggml.tokens", 8, T.UINT32, None, "must be an ARRAY of STRING, got UINT32"),
    "tokens of numbers": ("tokenizer.ggml.tokens", list(range(V)), T.ARRAY, T.UINT32,
                          "must be an ARRAY of STRING, got ARRAY of UINT32"),
    "block count a string": ("llama.block_count", "12", T.STRING, None, "must be a number (or an ARRAY of numbers)"),
    "token id a string": ("tokenizer.ggml.bos_token_id", "1", T.STRING, None, "must be an integer (a token id)"),
}


@pytest.mark.parametrize("case", sorted(BAD_GGUF_METADATA))
def test_gguf_metadata_of_the_wrong_type(tmp_path: Path, case: str) -> None:
    key, value, vtype, sub_type, text = BAD_GGUF_METADATA[case]
    path = write_gguf(tmp_path / "bad.gguf", (key, value, vtype, sub_type))
    refused(lambda: GGUFCheckpoint(path), f"{path}: GGUF metadata {key!r} {text}")
    refused(lambda: LMHead.from_checkpoint(path), str(path), repr(key))


def test_gguf_metadata_key_twice_is_refused(tmp_path: Path) -> None:
    def kv(key: str, value: str) -> bytes:
        return (struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", int(T.STRING))
                + struct.pack("<Q", len(value)) + value.encode())

    path = tmp_path / "twice.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + kv("general.architecture", "llama")
                     + kv("general.architecture", "gpt2"))
    refused(lambda: GGUFCheckpoint(path), f"{path}: metadata key 'general.architecture' appears twice")


def test_gguf_metadata_of_the_right_types_still_loads(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "ok.gguf", ("llama.block_count", 2, T.UINT32, None),
                      ("tokenizer.ggml.bos_token_id", 1, T.UINT32, None))
    ckpt = GGUFCheckpoint(path)
    assert (ckpt.config["vocab_size"], ckpt.config["hidden_size"], ckpt.config["num_hidden_layers"]) == (V, H, 2)
    assert torch.equal(LMHead.from_checkpoint(path, dtype=torch.float32).weights.weight, HEAD)


# ==== paths that are not paths ===============================================================================
@pytest.mark.parametrize("path", [None, 3, 0, b"model.safetensors", "", "model\x00.safetensors", 1.5,
                                  ["model.safetensors"]])
def test_path_that_is_not_a_path(path: Any) -> None:
    """An int would have been opened as a file descriptor, "" as the current folder."""
    shown = "is empty" if path == "" else "NUL" if isinstance(path, str) else repr(path)[:40]
    refused(lambda: Checkpoint(path), "checkpoint path", shown)
    refused(lambda: open_checkpoint(path), "checkpoint path", shown)
    refused(lambda: LMHead.from_checkpoint(path), "checkpoint path", shown)
    refused(lambda: resolve_lm_head_quant(path), "checkpoint path", shown)
    refused(lambda: GGUFCheckpoint(path), "GGUF checkpoint path must be a non-empty str or os.PathLike",
            type(path).__name__)


def test_pathlike_objects_still_work(tmp_path: Path) -> None:
    path = head_file(tmp_path / "head.safetensors")

    class Custom:
        def __fspath__(self) -> str:
            return str(path)

    assert Checkpoint(Custom()).names() == ["lm_head.weight"]
    assert Checkpoint(str(path)).names() == ["lm_head.weight"]
    refused(lambda: Checkpoint(path).lm_head_name(5), "tensor_name must be a string, got int 5")  # type: ignore[arg-type]


# ==== a GGUF's vocabulary is its own, named with the file =====================================================
@pytest.mark.parametrize(("tokens", "rows"), [(70, 64), (64, 128)])
def test_r2_gguf_row_mismatch_names_the_file_not_config_json(tmp_path: Path, tokens: int, rows: int) -> None:
    path = write_blocks_gguf(tmp_path / "m.gguf", "Q8_0", tokens=tokens, rows=rows)
    with pytest.raises(CheckpointError) as err:
        LMHead.from_checkpoint(path, dtype=torch.float32)
    text = str(err.value)
    assert "config.json" not in text and str(path) in text and "tokenizer.ggml.tokens" in text, text
    assert f"has {rows} rows" in text and f"is {tokens}" in text, text
