"""One name per concept in base: the Runtime that ran, FP8 scale granularity, the head dtypes."""

from __future__ import annotations

import pytest

from trtvocab.artifact.manifest import VerifyRecord
from trtvocab.backends.onnx import RUNNERS, parse_runner
from trtvocab.base.formats import Runtime
from trtvocab.errors import InputError


def test_older_name_reference_is_onnx_reference() -> None:
    assert Runtime("reference") is Runtime.ONNX_REFERENCE
    body = '{"backend": "reference", "max_abs_err": 0.0, "tolerance": 0.0, "ok": true, "argmax_equal": true}'
    record = VerifyRecord.model_validate_json(body, strict=True)  # a manifest written before the enum
    assert record.backend is Runtime.ONNX_REFERENCE
    assert record.model_dump(mode="json")["backend"] == "onnx.reference"


def test_onnx_runner_choices() -> None:
    assert RUNNERS == ("auto", "onnxruntime", "onnx.reference")
    assert parse_runner("auto") is None
    assert parse_runner("onnxruntime") is Runtime.ONNXRUNTIME
    assert parse_runner("reference") is parse_runner("onnx.reference") is Runtime.ONNX_REFERENCE
    for bad in ("torch", "cuda", None):
        with pytest.raises(InputError, match="runner"):
            parse_runner(bad)


def test_one_rule_for_per_row_fp8_scales() -> None:
    from trtvocab.base.formats import Granularity

    for shape in ((), (1,), (1, 1)):
        assert Granularity.of_scale(shape) is Granularity.PER_TENSOR
    for shape in ((7,), (7, 1)):
        assert Granularity.of_scale(shape) is Granularity.PER_ROW


def test_one_tuple_of_head_dtypes() -> None:
    import torch

    from trtvocab.base.dtypes import DTYPES, HEAD_DTYPES

    assert DTYPES == tuple(HEAD_DTYPES.values()) == (torch.float32, torch.bfloat16, torch.float16)
