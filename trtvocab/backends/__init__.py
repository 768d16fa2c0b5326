"""Per-rank runners of a built artifact, behind one interface (:class:`~trtvocab.backends.base.RankBackend`).

::

    tensorrt   rank{r}/lm_head.plan on a CUDA GPU (standard TensorRT: built for this GPU;
               TensorRT-RTX: built ahead of time for targets that include this GPU)
    onnx       rank{r}/lm_head.onnx on CPU: onnxruntime, or onnx.reference where onnxruntime
               has no kernels (bf16 MatMul, FP4); the result says which ran
    torch      rank{r}/weights.safetensors through the PyTorch LMHead (always there)

``auto`` takes the first usable one in that order. ``onnxruntime`` is accepted as an older
name of ``onnx``. Backend modules import their runtime only when used: ``onnx`` needs the
onnx extra, ``tensorrt`` needs TensorRT and a GPU.
"""

from __future__ import annotations

from pathlib import Path

from trtvocab.artifact.manifest import Manifest
from trtvocab.backends.base import RankBackend, RankLogits
from trtvocab.errors import ArtifactError, EngineUnavailableError

ORDER = ("tensorrt", "onnx", "torch")
CHOICES = ("auto", *ORDER)
ALIASES = {"onnxruntime": "onnx"}
# The modules each backend runs on (its own and its runtime's), for a caller that imports them
# ahead of time (generate's rank server: trtvocab.parallel.launch.warm_up).
MODULES = {"tensorrt": ("trtvocab.backends.tensorrt",), "onnx": ("trtvocab.backends.onnx", "onnxruntime"),
           "torch": ("trtvocab.backends.torch",)}


def canonical(name: str) -> str:
    """A backend name as the user may write it -> its canonical name; ArtifactError if unknown."""
    name = ALIASES.get(name, name)
    if name not in CHOICES:
        raise ArtifactError(f"`backend` must be one of {CHOICES} (or onnxruntime, an alias of onnx), got {name!r}")
    return name


def _onnx_unusable(manifest: Manifest) -> str | None:
    if not manifest.backends.onnx:
        return "the artifact has no ONNX graphs"
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        return f"onnx / onnxruntime are not installed ({exc.name})"
    return None


def _tensorrt_unusable(manifest: Manifest) -> str | None:
    if not manifest.backends.tensorrt:
        reasons = sorted({e.engine.reason for e in manifest.ranks if not e.engine.built and e.engine.reason})
        return "no engine in the artifact" + (f": {'; '.join(reasons)}" if reasons else "")
    from trtvocab.backends.tensorrt import current_gpu, engine_mismatch
    from trtvocab.export.tensorrt import import_compiler

    gpu = current_gpu()
    versions: dict[str, str | None] = {}
    whys = []
    for e in manifest.ranks:
        compiler = e.engine.build.compiler if e.engine.build is not None else "tensorrt"
        if compiler not in versions:
            try:
                versions[compiler] = import_compiler(compiler).version
            except EngineUnavailableError as exc:
                if gpu is not None:
                    return str(exc)
                versions[compiler] = None  # no GPU either: engine_mismatch says so first
        whys.append((e.files.plan, engine_mismatch(e.engine, gpu, versions[compiler])))
    reasons = [why for _, why in whys if why]
    if reasons and len(set(reasons)) == 1 and gpu is None:
        return reasons[0]  # one line for the whole artifact: every plan has the same reason
    return "; ".join(f"{plan}: {why}" for plan, why in whys if why) or None


def available_backends(manifest: Manifest) -> dict[str, str | None]:
    """backend -> None if usable, else why not."""
    return {"tensorrt": _tensorrt_unusable(manifest), "onnx": _onnx_unusable(manifest), "torch": None}


def pick_backend(manifest: Manifest, requested: str = "auto") -> tuple[str, dict[str, str | None]]:
    """The backend to run (canonical name) and every backend's availability."""
    requested = canonical(requested)
    usable = available_backends(manifest)
    if requested != "auto":
        if usable[requested] is not None:
            raise EngineUnavailableError(f"backend {requested} is not usable: {usable[requested]}")
        return requested, usable
    return next(name for name in ORDER if usable[name] is None), usable


def open_backend(name: str, root: Path, manifest: Manifest, rank: int) -> RankBackend:
    """The runner of ``rank`` for backend ``name`` (canonical, not ``auto``)."""
    if name == "torch":
        from trtvocab.backends.torch import TorchBackend

        return TorchBackend(root, manifest, rank)
    if name == "onnx":
        from trtvocab.backends.onnx import OnnxBackend

        return OnnxBackend(root, manifest, rank)
    if name == "tensorrt":
        from trtvocab.backends.tensorrt import TensorRTBackend

        return TensorRTBackend(root, manifest, rank)
    raise ArtifactError(f"no backend {name!r}; choose one of {ORDER}")


__all__ = ["ALIASES", "CHOICES", "ORDER", "RankBackend", "RankLogits", "available_backends", "canonical",
           "open_backend", "pick_backend"]
