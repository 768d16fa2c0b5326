"""Which GPU can run which engine: compilers, targets and the hardware datatype rules.

Two real compilers turn a rank's ONNX graph into a plan (see ``docs/architecture.md``,
"Engines"):

* ``tensorrt``: standard TensorRT, builds for the local GPU (the only compiler for
  Hopper SM90 and data-center Blackwell SM100);
* ``tensorrt-rtx``: TensorRT-RTX, builds ahead of time on any machine (no GPU needed)
  for the named targets below.

A graph needs a hardware datatype when a tensor of that type reaches a kernel: bf16 from
SM80, FP8 from SM89, FP4 from SM120 in TensorRT-RTX (SM100 in standard TensorRT), and
TensorRT-RTX refuses a float32 GEMM on SM75. The rules are checked *before* building, so
an explicit target that cannot run a graph is refused with the datatype as the reason.
"""

from __future__ import annotations

from trtvocab.base.formats import NameEnum
from trtvocab.errors import ConfigError, EngineUnavailableError


class Compiler(NameEnum):
    """The engine compiler a recipe asks for (``auto``: standard TensorRT where it and a GPU
    exist, else TensorRT-RTX where it imports, else no engine)."""

    AUTO = "auto"
    TENSORRT = "tensorrt"
    TENSORRT_RTX = "tensorrt-rtx"


class HwType(NameEnum):
    """A hardware datatype a graph's kernels need."""

    BF16 = "bf16"
    FP8 = "fp8"
    FP4 = "fp4"
    FP32_GEMM = "fp32-gemm"  # a float32 x float32 GEMM (TensorRT-RTX has none on Turing)


# TensorRT-RTX's AOT targets: recipe name -> compute capability (its ComputeCapability.SMxx).
RTX_TARGETS: dict[str, tuple[int, int]] = {
    "sm75": (7, 5), "sm80": (8, 0), "sm86": (8, 6), "sm89": (8, 9), "sm120": (12, 0), "sm121": (12, 1)}

# First compute capability with each datatype, per compiler (None: every target has it).
MIN_CC: dict[Compiler, dict[HwType, tuple[int, int] | None]] = {
    Compiler.TENSORRT: {HwType.BF16: (8, 0), HwType.FP8: (8, 9), HwType.FP4: (10, 0), HwType.FP32_GEMM: None},
    Compiler.TENSORRT_RTX: {HwType.BF16: (8, 0), HwType.FP8: (8, 9), HwType.FP4: (12, 0),
                            HwType.FP32_GEMM: (8, 0)},
}
_WHY = {HwType.BF16: "bfloat16 kernels need", HwType.FP8: "FP8 (e4m3) kernels need",
        HwType.FP4: "FP4 (e2m1) kernels need", HwType.FP32_GEMM: "a float32 GEMM needs"}


def cc_name(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def target_name(cc: tuple[int, int]) -> str:
    """``(8, 9)`` -> ``"sm89"``."""
    return f"sm{cc[0]}{cc[1]}"


def parse_targets(names: list[str] | tuple[str, ...]) -> list[str]:
    """Validated, de-duplicated TensorRT-RTX target names in CC order; ConfigError names the bad one."""
    out = []
    for raw in names:
        name = str(raw).strip().lower()
        if name not in RTX_TARGETS:
            hint = (" (Hopper and data-center Blackwell need standard TensorRT: compiler = \"tensorrt\")"
                    if name in ("sm90", "sm100", "sm103", "sm110") else "")
            raise ConfigError(f"engine target {raw!r} is not a TensorRT-RTX target; allowed: "
                              f"{sorted(RTX_TARGETS, key=RTX_TARGETS.__getitem__)}{hint}")
        if name not in out:
            out.append(name)
    return sorted(out, key=RTX_TARGETS.__getitem__)


def refusal(needs: set[HwType], cc: tuple[int, int], compiler: Compiler) -> str | None:
    """Why a GPU of compute capability ``cc`` cannot run a graph needing ``needs`` (None: it can)."""
    table = MIN_CC[compiler]
    for hw in sorted(needs, key=lambda h: list(HwType).index(h)):
        first = table[hw]
        if first is not None and cc < first:
            where = "TensorRT-RTX" if compiler is Compiler.TENSORRT_RTX else "TensorRT"
            return (f"{_WHY[hw]} compute capability >= {cc_name(first)} in {where}; "
                    f"{target_name(cc)} is {cc_name(cc)}")
    return None


def choose_targets(needs: set[HwType], requested: list[str] | None) -> list[str]:
    """The TensorRT-RTX targets of one engine: ``requested`` (each must run the graph: refused
    with the reason otherwise) or, when None, every target whose hardware has the datatypes."""
    if requested:
        names = parse_targets(requested)
        bad = [f"{n}: {why}" for n in names if (why := refusal(needs, RTX_TARGETS[n], Compiler.TENSORRT_RTX))]
        if bad:
            raise EngineUnavailableError("target refused before building: " + "; ".join(bad))
        return names
    names = [n for n, cc in RTX_TARGETS.items() if refusal(needs, cc, Compiler.TENSORRT_RTX) is None]
    if not names:
        raise EngineUnavailableError(f"no TensorRT-RTX target can run a graph needing {sorted(map(str, needs))}")
    return names


__all__ = ["MIN_CC", "RTX_TARGETS", "Compiler", "HwType", "cc_name", "choose_targets", "parse_targets", "refusal",
           "target_name"]
