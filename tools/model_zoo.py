"""The conformance suite: every causal LM of transformers against trtvocab's two vocabulary ends.

For every model type in transformers' causal-LM auto mapping (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``)
that can be instantiated tiny on a CPU, this saves a random checkpoint (safetensors; the head's
weight times 40 and any head bias ~ N(0, 5), so transforms show; the fields that are neutral by
default set to real values: soft-caps, logit scales, multipliers), computes transformers' own
references (the log-softmax of ``model(ids).logits`` for the rows ``lm_head`` receives, captured by
a hook, and ``model.get_input_embeddings()(ids)``), then loads the checkpoint with
``LMHead.from_checkpoint`` / ``VocabParallelEmbedding.from_checkpoint`` at tp 1 and at tp 2 (a real
gloo group; V = 1001, so the uneven split is 501 + 500) and classifies each end:

    exact        head log-softmax within 1e-4 nats, embedding rows within 1e-6 (relative)
    refused      trtvocab raised a typed error naming what it does not model (the loud outcome)
    wrong        no error and outside the tolerance: the outcome that must never happen
    not instantiable / other   transformers itself cannot build or run the tiny model

    python tools/model_zoo.py                       # all types, writes docs/model_families.md
    python tools/model_zoo.py --only gemma2 phi     # some types, prints the rows
    python tools/model_zoo.py --check               # exit 1 when a row is wrong (CI uses run_zoo)

Each type runs in a worker process (one import of torch / transformers for many types; a type
that hangs past ``--timeout`` seconds is killed and marked ``other``); memory is capped.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "model_families.md"
VOCAB = 1001
IDS = [3, 17, 250, 1000, 42, 7]
HEAD_TOL = 1e-4  # nats (see head_tolerance)
EMB_TOL = 1e-6  # relative
MEMORY_LIMIT = 10 << 30  # address space of a worker (two run at once on 24 GiB)
STARTUP_S = 180.0  # a worker's imports (torch, transformers) on a loaded 2-core machine
SIZES = {
    "vocab_size": VOCAB, "hidden_size": 64, "n_embd": 64, "d_model": 64, "n_embed": 64, "dim": 64,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "decoder_ffn_dim": 128, "encoder_ffn_dim": 128,
    "num_hidden_layers": 1, "n_layer": 1, "num_layers": 1, "n_layers": 1, "decoder_layers": 1, "encoder_layers": 1,
    "num_attention_heads": 2, "n_head": 2, "num_heads": 2, "n_heads": 2, "decoder_attention_heads": 2,
    "encoder_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
    "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "moe_num_experts": 4,
}
# Fields that are neutral by default in some families, set to the values real checkpoints use.
LATENT = {"final_logit_softcapping": 10.0, "logits_scaling": 4.0, "logit_scale": 0.5, "lm_head_multiplier": 0.5,
          "embedding_multiplier": 3.0}
SPECIAL: dict[str, dict[str, Any]] = {
    "bamba": {"attn_layer_indices": [0]},
    "granitemoehybrid": {"layer_types": ["attention"]},
    "bailing_hybrid": {"layer_types": ["full_attention"]},
    "codegen": {"rotary_dim": 16}, "gptj": {"rotary_dim": 16},
    "reformer": {"is_decoder": True, "axial_pos_shape": [16, 16], "axial_pos_embds_dim": [32, 32]},
    "xlstm": {"qk_dim_factor": 1.0, "v_dim_factor": 1.0},
    "lfm2_moe": {"layer_types": ["full_attention"]},
    "mamba2": {"num_heads": 2, "head_dim": 64, "n_groups": 1},
}
SKIP = {"blt": "instantiating its byte-latent patcher and encoders takes minutes on a CPU",
        "gemma3n": "needs timm", "gemma4_assistant": "its default config fails its own validation",
        "gemma4_unified_assistant": "a drafter: its forward needs the target model's states"}


# ---- worker: one model type -------------------------------------------------------------------------
def _shrink(d: dict[str, Any], drop: set[str], layers: bool = True) -> dict[str, Any]:
    """The overrides that make config dict ``d`` tiny (sub-configs shrunk whole); ``drop``: size fields
    left at their defaults; ``layers``: also drop the per-layer lists the class derives from the count."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and "model_type" in value:
            out[key] = {**value, **_shrink(value, drop, layers)}
        elif key in SIZES and key not in drop and isinstance(value, int) and not isinstance(value, bool):
            # never grow a size (a top-1 router stays top-1), except the vocabulary, which is fixed
            out[key] = SIZES[key] if key == "vocab_size" else min(value, SIZES[key])
        elif key == "head_dim" and value is None and key not in drop:
            out[key] = SIZES[key]  # a class that reads head_dim without a fallback
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        v = d.get(key)
        if isinstance(v, int) and v >= VOCAB:
            out[key] = 0
        elif isinstance(v, list) and any(isinstance(t, int) and t >= VOCAB for t in v):
            out[key] = [t if t < VOCAB else 0 for t in v]
    for key, value in LATENT.items():
        if key in d and d[key] in (None, 1, 1.0) and not isinstance(d[key], bool):
            out[key] = value
    return out


def _configs(model_type: str) -> list[tuple[str, Any]]:
    """Candidate tiny configs, tried in order: overrides through ``AutoConfig.for_model`` (the class
    derives its per-layer fields from the new sizes), a few variants, then a rebuild from the dict."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    cls = type(base)
    d = base.to_dict()
    layer_keys = {"num_hidden_layers", "n_layer", "num_layers", "n_layers"}
    variants = [("A", set(), {}), ("A-kv2", set(), {"num_key_value_heads": 2}),
                ("A-nohd", {"head_dim"}, {}), ("A-kv2-nohd", {"head_dim"}, {"num_key_value_heads": 2}),
                ("A-L", layer_keys, {}), ("A-L-kv2", layer_keys, {"num_key_value_heads": 2})]
    out = []
    for name, drop, extra in variants:
        def build(drop: set[str] = drop, extra: dict[str, Any] = extra) -> Any:
            over = _shrink(d, drop)
            over.update({k: v for k, v in extra.items() if k in d})
            over.update(SPECIAL.get(model_type, {}))
            return AutoConfig.for_model(model_type, **over)
        out.append((name, build))

    def rebuild() -> Any:
        small = {**d, **_shrink(d, set()), **SPECIAL.get(model_type, {})}
        small.pop("model_type", None)
        small.pop("layer_types", None)
        return cls(**{k: v for k, v in small.items() if not k.startswith("_")})
    out.append(("R", rebuild))
    return out


def _instantiate(model_type: str) -> tuple[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    errors = []
    for name, build in _configs(model_type):
        try:
            cfg = build()
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
            if hasattr(model, "set_default_language") and getattr(cfg, "languages", None):
                model.set_default_language(cfg.languages[0])  # X-MOD: one adapter per language
            with torch.no_grad():
                model(torch.tensor([IDS]))
            return name, model
        except Exception as exc:
            errors.append(f"{name}: {type(exc).__name__}: {str(exc)[:160]}")
    raise RuntimeError("; ".join(errors[:2] + errors[-1:] if len(errors) > 2 else errors))


def prepare(model_type: str, folder: Path) -> dict[str, Any]:
    """Build, perturb and save the tiny model; save the references beside it."""
    import torch
    from safetensors.torch import save_file

    variant, model = _instantiate(model_type)
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Module) or not hasattr(head, "weight"):
        raise RuntimeError(f"get_output_embeddings() is {type(head).__name__}, not one linear head")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        head.weight.mul_(40)
        if getattr(head, "bias", None) is not None:
            head.bias.copy_(torch.randn(head.bias.shape, generator=gen) * 5)
        for name, p in head.named_parameters():  # a learned per-token scale and the like
            if name not in ("weight", "bias"):
                p.mul_(torch.rand(p.shape, generator=gen) + 0.5)
    model.save_pretrained(folder)
    ids = torch.tensor([IDS])
    with torch.no_grad():
        rows = model.get_input_embeddings()(ids[0])
    reference = "float64"
    try:  # transformers' own forward in float64 on the saved weights: a reference with no float32 noise
        hidden, logits = _forward(model.double(), ids)
    except Exception:
        reference = "float32"
        hidden, logits = _forward(model.float(), ids)
    save_file({"hidden": hidden.contiguous().float(), "logprobs": torch.log_softmax(logits.double(), -1),
               "max_logit": logits.abs().max().double().reshape(1),
               "rows": rows.detach().float().contiguous(), "ids": ids[0]}, str(folder / "zoo_reference.safetensors"))
    return {"class": type(model).__name__, "variant": variant, "reference": reference}


def _forward(model: Any, ids: Any) -> tuple[Any, Any]:
    """``(rows lm_head receives [T, H], logits [T, V])`` of one forward. Where the head runs on more
    rows than the logits keep (ProphetNet's n-gram streams), the rows whose head output is the logits."""
    import torch

    captured: dict[str, torch.Tensor] = {}
    hook = model.get_output_embeddings().register_forward_hook(
        lambda mod, args, out: captured.update(x=args[0].detach(), y=out.detach()))
    try:
        with torch.no_grad():
            logits = model(ids).logits[0]
    finally:
        hook.remove()
    rows = captured["x"].reshape(-1, captured["x"].shape[-1])
    outs = captured["y"].reshape(-1, captured["y"].shape[-1])
    picked = []
    for t in range(logits.shape[0]):
        same = [k for k in range(outs.shape[0]) if torch.equal(outs[k], logits[t])]
        picked.append(same[0] if same else rows.shape[0] - logits.shape[0] + t)
    return rows[picked], logits


def head_tolerance(max_logit: float) -> float:
    """:data:`HEAD_TOL` nats, or the float32 GEMM's rounding where the logits are large (2**-20 * max |z|:
    the suite's heads are scaled x 40, so logits reach 1e3; a missing op is off by nats)."""
    return max(HEAD_TOL, 2.0**-20 * max_logit)


def compare(folder: Path, mapping: Any = None) -> dict[str, Any]:
    """Load ``folder`` with trtvocab (``mapping``: a tp rank) and classify each end against its references."""
    import torch
    from safetensors.torch import load_file

    from trtvocab import LMHead, VocabParallelEmbedding
    from trtvocab.errors import TrtVocabError

    ref = load_file(str(folder / "zoo_reference.safetensors"))
    out: dict[str, Any] = {}
    try:
        head = LMHead.from_checkpoint(folder, dtype=torch.float32, mapping=mapping)
        got = torch.log_softmax(head(ref["hidden"]).double(), -1)
        diff = float((got - ref["logprobs"]).abs().max())
        out["head"], out["head_diff"] = ("exact" if diff <= head_tolerance(float(ref["max_logit"])) else "wrong"), diff
        out["head_ops"] = head.head_ops.describe()
    except TrtVocabError as exc:
        out["head"], out["head_why"] = "refused", f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        out["head"], out["head_why"] = "other", f"{type(exc).__name__}: {exc}"
    try:
        emb = VocabParallelEmbedding.from_checkpoint(folder, dtype=torch.float32, mapping=mapping)
        rows = emb(ref["ids"])
        scale = float(ref["rows"].abs().max()) or 1.0
        diff = float((rows - ref["rows"]).abs().max()) / scale
        out["emb"], out["emb_diff"] = ("exact" if diff <= EMB_TOL else "wrong"), diff
        out["emb_ops"] = emb.embedding_ops.describe()
    except TrtVocabError as exc:
        out["emb"], out["emb_why"] = "refused", f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        out["emb"], out["emb_why"] = "other", f"{type(exc).__name__}: {exc}"
    return out


def worker(root: Path) -> None:
    """Read model types from stdin, one a line; print one JSON result a line."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for line in sys.stdin:
        mt = line.strip()
        folder = root / mt
        folder.mkdir(parents=True, exist_ok=True)
        result: dict[str, Any] = {"type": mt}
        try:
            result.update(prepare(mt, folder))
        except Exception as exc:
            result.update(status="not instantiable", why=f"{type(exc).__name__}: {str(exc)[:300]}")
            print(json.dumps(result), flush=True)
            continue
        result["tp1"] = compare(folder)
        print(json.dumps(result), flush=True)


# ---- parent: the pool, tp 2, the table ----------------------------------------------------------------
def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _run_workers(types: list[str], root: Path, timeout: float, log: Any,
                 retry: bool = True) -> dict[str, dict[str, Any]]:
    """``types`` through worker processes, one JSON line a type. A worker's first type also waits for its
    imports (``STARTUP_S`` more); a type that times out or kills its worker is tried once more alone, with
    twice the time (a loaded machine is slow, not wrong), then marked ``other``."""
    import queue
    import threading

    results: dict[str, dict[str, Any]] = {}
    pending = list(types)
    failed: list[str] = []
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    while pending:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", str(root)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("".join(t + "\n" for t in pending))
        proc.stdin.close()
        lines: queue.Queue[str | None] = queue.Queue()

        def pump(stream: Any = proc.stdout, q: queue.Queue[str | None] = lines) -> None:
            for line in stream:
                q.put(line)
            q.put(None)

        threading.Thread(target=pump, daemon=True).start()
        first = True
        while pending:
            try:
                line = lines.get(timeout=timeout + (STARTUP_S if first else 0.0))
            except queue.Empty:
                line, why = None, "killed after the time limit"
            else:
                why = f"worker died (exit {proc.wait()})" if line is None else ""
            first = False
            if line is not None:
                got = json.loads(line)
                results[got["type"]] = got
                pending.remove(got["type"])
                print(f"  {got['type']}: {summary(got)}", file=log, flush=True)
                continue
            mt = pending.pop(0)
            proc.kill()
            proc.wait()
            failed.append(mt)
            results[mt] = {"type": mt, "status": "other", "why": why}
            print(f"  {mt}: other ({why})", file=log, flush=True)
            break
        else:
            proc.wait()
    if retry:
        for mt in failed:
            results.update(_run_workers([mt], root, 2 * timeout, log, retry=False))
    return results


def _tp2_rank(rank: int, world: int, folders: list[str]) -> dict[str, Any]:
    from trtvocab import Mapping

    mapping = Mapping(world_size=world, rank=rank, tp_size=world)
    return {Path(f).name: compare(Path(f), mapping) for f in folders}


def status(result: dict[str, Any]) -> str:
    """One of exact / refused / wrong / not instantiable / other, over both ends and both tp sizes."""
    if "status" in result:
        return result["status"]
    ends = [result[tp][end] for tp in ("tp1", "tp2") if tp in result for end in ("head", "emb")]
    if "wrong" in ends:
        return "wrong"
    if all(e == "exact" for e in ends):
        return "exact"
    if "other" in ends:
        return "other"
    if any(e == "exact" for e in ends):
        return "partly refused"
    return "refused"


def summary(result: dict[str, Any]) -> str:
    if "status" in result:
        return f"{result['status']} ({result.get('why', '')[:120]})"
    tp1 = result["tp1"]
    return f"head {tp1['head']} {tp1.get('head_diff', '')}, emb {tp1['emb']} {tp1.get('emb_diff', '')}"


def run_zoo(types: list[str] | None = None, *, timeout: float = 90.0, log: Any = sys.stderr,
            tp2: bool = True, workers: int = 2) -> dict[str, dict[str, Any]]:
    """Run the suite over ``types`` (default: all) on ``workers`` worker processes; returns type -> result
    (see :func:`status`)."""
    from concurrent.futures import ThreadPoolExecutor

    types = types or model_types()
    with tempfile.TemporaryDirectory(prefix="trtvocab-zoo-") as tmp:
        root = Path(tmp)
        todo = [t for t in types if t not in SKIP]
        parts = [todo[i::workers] for i in range(workers)]
        results: dict[str, dict[str, Any]] = {}
        with ThreadPoolExecutor(workers) as pool:
            for got in pool.map(lambda part: _run_workers(part, root, timeout, log), [p for p in parts if p]):
                results.update(got)
        for t in types:
            if t in SKIP:
                results[t] = {"type": t, "status": "not instantiable", "why": SKIP[t]}
        loaded = [str(root / t) for t, r in results.items() if "tp1" in r]
        if tp2 and loaded:
            from trtvocab.parallel.launch import run_ranks

            by_rank = run_ranks(_tp2_rank, 2, loaded)
            for name, got in by_rank[0].items():
                results[name]["tp2"] = got
        return _without_root(results, f"{root}/")


def _without_root(value: Any, root: str) -> Any:
    """``value`` with the run's temporary folder cut from its texts: the table names ``dory/config.json``,
    never a path of the machine that generated it."""
    if isinstance(value, str):
        return value.replace(root, "")
    if isinstance(value, dict):
        return {k: _without_root(v, root) for k, v in value.items()}
    return value


def _reason(result: dict[str, Any]) -> str:
    if "status" in result:
        return result.get("why", "").split("\n")[0][:160]
    notes = []
    for end, what in (("head", "head"), ("emb", "embedding")):
        tp1 = result["tp1"]
        if tp1[end] == "exact":
            ops = tp1.get(f"{end}_ops", "")
            if ops not in ("x @ W.T", "W[ids]"):
                notes.append(f"{what}: {ops}")
        else:
            why = tp1.get(f"{end}_why", f"{tp1[end]} ({tp1.get(end + '_diff')})")
            notes.append(f"{what} {tp1[end]}: {why.split(': ', 1)[-1][:200]}")
    return "; ".join(notes)


def table(results: dict[str, dict[str, Any]]) -> str:
    import transformers

    counts: dict[str, int] = {}
    for r in results.values():
        counts[status(r)] = counts.get(status(r), 0) + 1
    instantiable = sum(1 for r in results.values() if "tp1" in r)
    exact = counts.get("exact", 0)
    lines = [
        "# Model families: what trtvocab computes for every causal LM of transformers",
        "",
        "Generated by `python tools/model_zoo.py` (do not edit by hand); `tests/layers/test_model_zoo.py` runs",
        f"the same suite in CI. transformers {transformers.__version__}, every model type of its causal-LM auto",
        "mapping. Each instantiable type: a tiny random checkpoint (V = 1001, the head's weight x 40, any head bias",
        "~ N(0, 5), neutral-by-default fields set to real values: soft-caps 10, logit scales 0.5 / 4, multipliers),",
        "loaded by `LMHead.from_checkpoint` and `VocabParallelEmbedding.from_checkpoint` at tp 1 and tp 2 (gloo,",
        "uneven 501 + 500), against transformers' own `model(ids).logits` (log-softmax, the rows `lm_head`",
        "receives; transformers' forward in float64 where the family runs in it) and",
        "`model.get_input_embeddings()(ids)`.",
        f"Exact: within {HEAD_TOL:g} nats (or 2^-20 x max |logit|, the float32 GEMM's rounding of the x 40 logits)",
        f"and {EMB_TOL:g} relative.",
        "",
        f"**{exact} exact, {counts.get('partly refused', 0)} exact at one end and refused at the other, "
        f"{counts.get('refused', 0)} refused, {counts.get('wrong', 0)} wrong, "
        f"{counts.get('not instantiable', 0)} not instantiable, {counts.get('other', 0)} other** "
        f"({len(results)} types; exact: {exact} of {instantiable} instantiable, "
        f"{100.0 * exact / max(instantiable, 1):.0f} %).",
        "",
        "What the ops mean (`docs/architecture.md`, \"Model families\"): the head computes",
        "`softcap(((x @ W.T + b) * scale) / divisor)`, the embedding `W[ids] * embed_scale`; what a body applies",
        "itself (Granite's `embedding_multiplier`, a transform before `lm_head`) stays with the body.",
        "Refused: trtvocab raises a typed error naming the tensor or the field it does not model.",
        "",
        "| model type | class | status | notes |",
        "|---|---|---|---|",
    ]
    for mt in sorted(results):
        r = results[mt]
        note = _reason(r).replace("|", "\\|")
        lines.append(f"| {mt} | {r.get('class', '')} | {status(r)} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--only", nargs="*", help="these model types only (prints, does not write the doc)")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds a type may take (default 90)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--check", action="store_true", help="exit 1 when any type is wrong")
    p.add_argument("--json", metavar="FILE", help="also write the raw results")
    args = p.parse_args(argv)
    if args.worker:
        worker(Path(args.worker))
        return 0
    results = run_zoo(args.only or None, timeout=args.timeout, workers=args.workers)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.only:
        for mt in args.only:
            print(f"{mt}: {status(results[mt])}: {_reason(results[mt])}")
    else:
        DOC.write_text(table(results))
        print(f"wrote {DOC}")
    wrong = sorted(t for t, r in results.items() if status(r) == "wrong")
    if wrong:
        print(f"WRONG: {wrong}", file=sys.stderr)
    return 1 if args.check and wrong else 0


if __name__ == "__main__":
    sys.exit(main())
