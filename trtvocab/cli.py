"""The ``trtvocab`` command line: plan, build, infer, inspect, hidden (+ quantize, compare)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trtvocab.errors import InputError, PeerRankError, RankFailures, TrtVocabError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="The vocabulary dimension of LLM inference: plan, build and run TP-sharded LM heads.")
# Piped output gets wide lines: rich would otherwise wrap tables at 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def _fail(exc: Exception) -> typer.Exit:
    """Print ``exc`` as one ``error:`` line (its text escaped: a message naming a path or a token
    is never read as rich markup) and return the exit-code-2 to raise. A :class:`RankFailures`
    shows the error of the first rank that failed on its own (not a PeerRankError echo); a
    typed error never carries a traceback."""
    shown: BaseException = exc
    note = ""
    if isinstance(exc, RankFailures) and exc.errors:
        own = {r: e for r, e in exc.errors.items() if not isinstance(e, PeerRankError)} or exc.errors
        rank = min(own)
        if isinstance(own[rank], TrtVocabError):
            shown = own[rank]
            note = f" (rank {rank}; {len(exc.errors)} rank(s) failed)"
    err_console.print(f"[bold red]error:[/] {escape(type(shown).__name__)}: {escape(str(shown))}{escape(note)}",
                      highlight=False, soft_wrap=True)
    return typer.Exit(code=2)


INT64_MAX = 2**63 - 1


def _int_list(text: str, option: str, lo: int = -INT64_MAX, hi: int = INT64_MAX) -> list[int]:
    """Comma-separated integers in ``[lo, hi]``; :class:`InputError` naming ``option`` otherwise."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise InputError(f"{option}: expected comma-separated integers, got {text[:80]!r}") from None
    bad = [v for v in values if not lo <= v <= hi]
    if bad:
        shown = str(bad[0]) if len(str(bad[0])) <= 40 else f"{str(bad[0])[:37]}..."
        raise InputError(f"{option}: {shown} is out of range; each value must be in [{lo}, {hi}]")
    return values


def _check_output_file(path: Path | None, option: str) -> None:
    """Refuse, before any work, an output path that cannot be written: a folder, or in a folder that
    does not exist."""
    if path is None:
        return
    if path.is_dir():
        raise InputError(f"{option} {path}: is a folder; expected a file path to write")
    if not path.parent.is_dir():
        raise InputError(f"{option} {path}: folder {path.parent} does not exist")


# ---- plan -----------------------------------------------------------------------------------
@app.command()
def plan(
    checkpoint: Annotated[Path | None, typer.Argument(help="HF directory or .safetensors file")] = None,
    vocab: Annotated[int | None, typer.Option(help="vocabulary size (instead of a checkpoint)")] = None,
    hidden: Annotated[int | None, typer.Option(help="hidden size (instead of a checkpoint)")] = None,
    tp: Annotated[int, typer.Option(help="tensor-parallel size")] = 1,
    batch: Annotated[int, typer.Option(help="rows of logits (sequences per step)")] = 256,
    layout: Annotated[str, typer.Option(help="uneven | padded")] = "uneven",
    pad_to: Annotated[int, typer.Option(help="padded layout: pad V to a multiple of pad_to * tp")] = 64,
    tokens: Annotated[int, typer.Option(help="tokens per step through the input embedding (its all-reduce)")] = 8192,
    link_gbs: Annotated[float, typer.Option(help="effective interconnect bandwidth, GB/s (decimal)")] = 300.0,
    tflops: Annotated[float, typer.Option(help="effective GEMM throughput, TFLOP/s")] = 600.0,
    tied: Annotated[bool | None, typer.Option("--tied/--untied", help="the head is the input embedding (one "
                                              "matrix); default: the checkpoint's, else untied")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
) -> None:
    """The vocabulary ledger: shards, weight bytes (bf16/fp8/nvfp4), logits, collectives, FLOPs, replication."""
    from trtvocab.errors import ConfigError
    from trtvocab.plan import ledger_rows, make_plan
    from trtvocab.units import human_bytes as human

    try:
        if checkpoint is not None:
            from trtvocab.loader import open_head

            source = open_head(checkpoint)
            vocab, hidden = source.vocab_size, source.hidden_size
            _, stored_tied = source.checkpoint.lm_head_name()
            if tied is not None and tied != stored_tied:
                raise ConfigError(f"--{'tied' if tied else 'untied'} contradicts the checkpoint, whose head is "
                                  f"{'tied to' if stored_tied else 'separate from'} the input embedding; "
                                  "allowed: the checkpoint's choice or neither flag")
            tied = stored_tied
        if vocab is None or hidden is None:
            raise ConfigError("give a CHECKPOINT or both --vocab and --hidden")
        p = make_plan(vocab, hidden, tp, batch, layout, pad_to,  # type: ignore[arg-type]
                      tokens=tokens, link_gbs=link_gbs, tflops=tflops, tied=bool(tied))
    except (TrtVocabError, OSError) as exc:
        raise _fail(exc) from None
    if as_json:
        print(p.model_dump_json(indent=2))
        return
    table = Table(title=f"V={p.vocab_size:,}  H={p.hidden_size:,}  tp={p.tp_size}  batch={p.batch}  layout={p.layout}"
                        f"  {'tied' if p.matrices.tied else 'untied'}")
    for col in ("rank", "vocab range", "rows", "W bf16", "W fp8", "W nvfp4", "logits bf16", "logits fp32",
                "all-gather send / recv (bf16)", "tied matrix bf16" if p.matrices.tied else "emb + head bf16"):
        table.add_column(col, justify="right")
    for r in p.ranks:
        table.add_row(str(r.rank), f"[{r.start:,}, {r.end:,})", f"{r.rows:,}", human(r.weight_bytes["bf16"]),
                      human(r.weight_bytes["fp8"]), human(r.weight_bytes["nvfp4"]),
                      human(r.local_logits_bytes["bf16"]), human(r.local_logits_bytes["fp32"]),
                      f"{human(r.allgather_send_bytes['bf16'])} / {human(r.allgather_recv_bytes['bf16'])}",
                      human(r.matrices_bytes))
    fw, gl = p.full_weight_bytes, p.gathered_logits_bytes
    table.add_row("total", f"[0, {p.vocab_size:,})", f"{p.vocab_size:,}", human(fw["bf16"]), human(fw["fp8"]),
                  human(fw["nvfp4"]), human(gl["bf16"]), human(gl["fp32"]), "(gathered: batch x V)",
                  human(p.matrices.replicated_bytes_per_card), style="bold")
    console.print(table)
    ledger = Table(title=f"per step: T={p.tokens:,} tokens, B={p.batch} rows, link {p.link_gbs:g} GB/s, "
                         f"GEMM {p.tflops:g} TFLOP/s (MB/GB decimal, MiB/GiB binary)")
    for col, justify in (("ledger", "left"), ("figure", "right"), ("time", "right")):
        ledger.add_column(col, justify=justify)  # type: ignore[arg-type]
    for row in ledger_rows(p):
        ledger.add_row(*row)
    console.print(ledger)


# ---- build ----------------------------------------------------------------------------------
@app.command()
def build(
    recipe: Annotated[Path, typer.Argument(help="builders/*.toml")],
    out: Annotated[Path | None, typer.Option(help="artifact folder (default: the recipe's [output] dir)")] = None,
    ranks: Annotated[str | None, typer.Option(help="comma-separated ranks to build (default: all)")] = None,
    force: Annotated[bool, typer.Option(help="replace an existing artifact (atomically)")] = False,
    require_engine: Annotated[bool, typer.Option(help="fail unless a TensorRT engine is built")] = False,
) -> None:
    """Build per-rank weights, ONNX graphs (checked on CPU) and TensorRT engines where possible."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from trtvocab.build import build as run_build
    from trtvocab.recipe import load_recipe
    from trtvocab.units import human_bytes as human

    try:
        rec = load_recipe(recipe)
        if require_engine:
            rec = rec.model_copy(update={"engine": rec.engine.model_copy(update={"require": True})})
        rank_list = _int_list(ranks, "--ranks", 0, 4095) if ranks else None
        stages = ["load shard", "save weights", "export onnx", "verify onnx", "build engine", "export embedding"]
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[stage]}"),
                      TimeElapsedColumn(), console=err_console, transient=False) as bar:
            tasks: dict[int, int] = {}

            def progress(rank: int, stage: str) -> None:
                if rank not in tasks:
                    tasks[rank] = bar.add_task(f"rank {rank}", total=len(stages), stage=stage)
                done = stages.index(stage) if stage in stages else 0
                bar.update(tasks[rank], completed=done, stage=stage)

            path, manifest = run_build(rec, out, ranks=rank_list, force=force, progress=progress)
            for t in tasks.values():
                bar.update(t, completed=len(stages), stage="done")
    except (TrtVocabError, OSError) as exc:
        raise _fail(exc) from None
    table = Table(title=f"built {escape(str(path))}  ({escape(manifest.quant.label)}, tp={manifest.mapping.tp_size})")
    for col in ("rank", "vocab range", "format", "weights", "onnx check (max |err| / tol)", "engine"):
        table.add_column(col)
    for e in manifest.ranks:
        v = e.verify
        check = (f"{'ok' if v.ok else 'FAILED'} on {v.backend}: {v.max_abs_err:.2e} / {v.tolerance:.2e}"
                 if v else "skipped")
        table.add_row(str(e.rank), escape(f"[{e.start:,}, {e.end:,})"), str(e.weight_format),
                      human(e.resident_bytes), escape(check), "built" if e.engine.built else "skipped")
    console.print(table)
    reasons = {e.engine.reason for e in manifest.ranks if not e.engine.built}
    for reason in sorted(r for r in reasons if r):
        console.print(f"[yellow]TensorRT engine not built:[/] {escape(reason)}. "
                      "Wrote the ONNX graphs and the PyTorch fallback weights instead.", highlight=False)


# ---- infer ----------------------------------------------------------------------------------
@app.command()
def infer(
    artifact: Annotated[Path, typer.Argument(help="folder written by trtvocab build")],
    hidden: Annotated[Path, typer.Option(help=".safetensors with hidden_states [T, H] (and optional seq_lens)")],
    seq_lens: Annotated[str | None, typer.Option(help="comma-separated lengths (override the file's)")] = None,
    backend: Annotated[str, typer.Option(help="auto | tensorrt | onnx | torch (onnxruntime: alias of onnx)")] = "auto",
    top_k: Annotated[int, typer.Option(help="tokens to print per sequence")] = 5,
    out: Annotated[Path | None, typer.Option(help="save logits [B, V] float32 to this .safetensors")] = None,
) -> None:
    """Run every rank of an artifact on hidden states and print each sequence's top-k tokens."""
    import torch

    from trtvocab.hidden import decoder, load_hidden, load_last_tokens
    from trtvocab.runtime import infer as run_infer

    try:
        from trtvocab.distributed import init_from_env

        # Everything that can be refused is refused before the ranks start (and before
        # minutes of inference): the options, the output path, the hidden file and its metadata.
        if top_k < 1:
            raise InputError(f"--top-k: must be >= 1 (tokens to print per sequence), got {top_k}")
        _check_output_file(out, "--out")
        init_from_env()  # under torchrun each process serves one rank; otherwise a no-op
        states, lens = load_hidden(hidden)
        last = load_last_tokens(hidden) or []
        if seq_lens:
            lens = torch.tensor(_int_list(seq_lens, "--seq-lens", 1, 2**31 - 1), dtype=torch.int32)
        logits, ran_on, manifest = run_infer(artifact, states, lens, backend)
    except TrtVocabError as exc:
        raise _fail(exc) from None
    finally:
        _leave_process_group()
    if logits is None:  # a non-zero rank under torchrun
        return
    console.print(f"backend: [bold]{escape(ran_on)}[/] ({escape(manifest.quant.label)}, tp={manifest.mapping.tp_size}, "
                  f"{len(manifest.ranks)} rank(s))", highlight=False)
    decode = decoder(manifest.checkpoint if manifest.checkpoint != "synthetic" else None)
    probs = torch.softmax(logits, dim=-1)
    top = probs.topk(min(top_k, logits.shape[-1]), dim=-1)
    vocab = logits.shape[-1]
    table = Table(title=f"top-{top_k} tokens of each sequence's last row (global softmax over all {vocab:,})")
    table.add_column("seq")
    if len(last) == logits.shape[0]:
        table.add_column("last input token")
    table.add_column("tokens (probability)")
    for b in range(logits.shape[0]):
        toks = ", ".join(f"{decode(i)} ({p:.3f})" for p, i in zip(top.values[b].tolist(), top.indices[b].tolist(),
                                                                   strict=True))
        # Tokens and file metadata are text, never markup: "[lowercase]" must print as itself.
        table.add_row(str(b), *([escape(last[b])] if len(last) == logits.shape[0] else []), escape(toks))
    console.print(table)
    if out is not None:
        try:
            _save_logits(out, logits)
        except OSError as exc:
            raise _fail(exc) from None
        console.print(f"saved logits {list(logits.shape)} to {escape(str(out))}", highlight=False)


def _leave_process_group() -> None:
    """Under torchrun: tear the group down on every rank before exiting. A rank that exits
    with a live gloo group aborts in its destructor ("terminate called without an active
    exception"), which torchrun reports as a failed job."""
    from trtvocab import distributed as D

    if D.is_initialized():
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def _save_logits(path: Path, logits) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import save

    from trtvocab.fsutil import atomic_write_bytes

    atomic_write_bytes(path, save({"logits": logits.contiguous()}))


# ---- inspect --------------------------------------------------------------------------------
@app.command()
def inspect(artifact: Annotated[Path, typer.Argument(help="folder written by trtvocab build")],
            as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Manifest summary, per-rank shard ranges and bytes, checksum verification."""
    from trtvocab.artifacts import read_manifest
    from trtvocab.units import human_bytes as human

    try:
        manifest = read_manifest(artifact)
    except TrtVocabError as exc:
        raise _fail(exc) from None
    if as_json:
        print(json.dumps(manifest.model_dump(mode="json"), indent=2))
        return
    h = manifest.head
    console.print(f"[bold]{escape(str(artifact))}[/]: V={h.vocab_size:,} H={h.hidden_size:,} dtype={h.dtype} "
                  f"layout={h.vocab_layout} tp={manifest.mapping.tp_size} quant={escape(manifest.quant.label)}"
                  f" ({escape(manifest.quant.reason)})", highlight=False)
    built_with = ", ".join(f"{k} {v}" for k, v in manifest.versions.items())
    console.print(escape(f"built {manifest.created} with {built_with}"), highlight=False)
    table = Table()
    for col in ("rank", "vocab range", "rows", "files", "bytes", "engine"):
        table.add_column(col)
    for e in manifest.ranks:
        files = [f for f in manifest.files if f.startswith(f"rank{e.rank}/")]
        size = sum(manifest.files[f].bytes for f in files)
        table.add_row(str(e.rank), escape(f"[{e.start:,}, {e.end:,})"), f"{e.end - e.start:,}",
                      escape(", ".join(Path(f).name for f in files)), human(size),
                      "built" if e.engine.built else escape(f"skipped: {e.engine.reason or ''}"))
    console.print(table)
    console.print(f"[green]checksums ok[/] ({len(manifest.files)} files)")


# ---- hidden ---------------------------------------------------------------------------------
@app.command()
def hidden(
    model: Annotated[Path, typer.Argument(help="HF model directory (transformers AutoModel, offline)")],
    out: Annotated[Path, typer.Option(help="output .safetensors (hidden_states [T, H], seq_lens [B])")],
    text: Annotated[list[str] | None,
                    typer.Option(help="a text (repeatable); default: four built-in sentences")] = None,
    layer: Annotated[int, typer.Option(help="which hidden states: 0 = embeddings, -1 = final layer")] = -1,
) -> None:
    """Compute real hidden states of some texts (packed, no special tokens) for infer/compare."""
    from trtvocab.hidden import DEFAULT_TEXTS, hidden_states_from_text, save_hidden

    try:
        _check_output_file(out, "--out")
        states, lens, last = hidden_states_from_text(model, list(text or DEFAULT_TEXTS), layer=layer)
        save_hidden(out, states, lens, last)
    except (TrtVocabError, OSError) as exc:
        raise _fail(exc) from None
    console.print(f"wrote hidden_states {list(states.shape)} and seq_lens {lens.tolist()} to {escape(str(out))}",
                  highlight=False)


# ---- quantize -------------------------------------------------------------------------------
@app.command()
def quantize(
    checkpoint: Annotated[Path, typer.Argument(help="dense HF directory or .safetensors file")],
    algo: Annotated[str, typer.Option(help="fp8 | nvfp4")],
    out: Annotated[Path, typer.Option(help="output directory (ModelOpt export format, written atomically)")],
    calib: Annotated[Path | None, typer.Option(help=".safetensors with hidden_states [T, H]: static activation "
                                               "scale (FP8 W8A8 / NVFP4 W4A4)")] = None,
    weight_only: Annotated[bool, typer.Option(help="write no activation scale (FP8 W8A16 at load with "
                                              "weight_only, NVFP4 W4A16)")] = False,
    tensor_name: Annotated[str | None, typer.Option(help="tensor holding the [V, H] head (default: lm_head.weight "
                                                    "or the tied embedding)")] = None,
    batch_rows: Annotated[int, typer.Option(help="calibration rows per batch")] = 256,
    force: Annotated[bool, typer.Option(help="replace an existing OUT (atomically)")] = False,
) -> None:
    """Quantize the LM head with ModelOpt (FP8 or NVFP4) into a checkpoint LMHead.from_checkpoint picks up."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from trtvocab.quantize import quantize_checkpoint

    try:
        with Progress(TextColumn("calibrating"), BarColumn(), MofNCompleteColumn(), TextColumn("batches"),
                      TimeElapsedColumn(), console=err_console, transient=True, disable=calib is None) as bar:
            task = bar.add_task("calibrate", total=None)

            def progress(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            result = quantize_checkpoint(checkpoint, out, algo=algo, calib=calib, weight_only=weight_only,
                                         tensor_name=tensor_name, batch_rows=batch_rows, force=force,
                                         progress=progress)
    except (TrtVocabError, OSError) as exc:
        raise _fail(exc) from None
    console.print(f"wrote [bold]{escape(str(result.out))}[/] ({escape(result.label)}) from "
                  f"{escape(result.source_tensor)} {escape(f'[{result.vocab_size:,} x {result.hidden_size:,}]')}",
                  highlight=False)
    table = Table()
    table.add_column("tensor")
    table.add_column("dtype")
    table.add_column("shape")
    for name, (dtype, shape) in result.tensors.items():
        table.add_row(escape(name), escape(dtype), escape(str(shape)))
    console.print(table)
    amax = f"weight amax {result.weight_amax:.4g}"
    if result.input_amax is not None:
        amax += f", activation amax {result.input_amax:.4g} over {result.calib_rows:,} calibration rows"
    console.print(amax, highlight=False)
    for note in result.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)


# ---- compare --------------------------------------------------------------------------------
@app.command()
def compare(
    baseline: Annotated[Path, typer.Argument(help="dense (bf16 / fp32) checkpoint")],
    hidden: Annotated[Path, typer.Option(help=".safetensors with hidden_states [T, H] (+ seq_lens)")],
    variants: Annotated[list[Path] | None, typer.Argument(help="quantized checkpoints to compare")] = None,
    simulate: Annotated[str | None, typer.Option(help="in-memory variants of the baseline, comma-separated: "
                                                 "fp8[-row][-dyn|-w8a8|-w8a16], nvfp4[-w4a16|-w4a4]")] = None,
    calib: Annotated[Path | None, typer.Option(help="hidden states for --simulate static activation scales "
                                               "(default: the compared rows)")] = None,
    tp: Annotated[int, typer.Option(help="tensor-parallel ranks (gloo processes) per head")] = 1,
    all_tokens: Annotated[bool, typer.Option("--all-tokens/--last-tokens",
                                             help="compare every row (default) or only each sequence's last "
                                                  "token (needs seq_lens)")] = True,
    dtype: Annotated[str, typer.Option(help="head dtype: auto (the baseline's) | bf16 | fp16 | fp32")] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="print a GitHub markdown table")] = False,
    plot: Annotated[Path | None, typer.Option(help="write a PNG: per-row KL and logit-error histograms")] = None,
) -> None:
    """Accuracy of quantized LM heads against the baseline: top-1/top-5, KL (global softmax), logit error."""
    from trtvocab.compare import COLUMNS, plot_report
    from trtvocab.compare import compare as run_compare
    from trtvocab.hidden import load_hidden

    try:
        states, lens = load_hidden(hidden)
        calib_states = load_hidden(calib)[0] if calib is not None else None
        specs = [s for s in (simulate or "").split(",") if s.strip()]
        report = run_compare(baseline, list(variants or []), states, lens, simulate=specs, calib=calib_states,
                             tp=tp, all_tokens=all_tokens, dtype=dtype)
        if plot is not None:
            plot_report(report, plot)
    except (TrtVocabError, OSError) as exc:
        raise _fail(exc) from None
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    elif markdown:
        print(report.to_markdown(), end="")
    else:
        table = Table(title=escape(report.title()))
        for i, col in enumerate(COLUMNS):
            table.add_column(escape(col), justify="left" if i < 2 else "right")
        for row in report.table_rows():
            table.add_row(*(escape(str(cell)) for cell in row))
        console.print(table)
        for v in report.variants:
            if v.note:
                console.print(f"[dim]{escape(v.name)}: {escape(v.note)}[/]", highlight=False)
    if plot is not None and not as_json:
        err_console.print(f"wrote {escape(str(plot))}", highlight=False)


def main() -> None:  # pragma: no cover
    sys.exit(app())
