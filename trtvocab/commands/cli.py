"""The ``trtvocab`` command line: plan, models, build, infer, inspect, hidden, quantize, compare, generate."""

from __future__ import annotations

import functools
import json
import re
import sys
import textwrap
import time
import typing
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Only torch-free modules at the top: `trtvocab --help` must not import torch (tests/commands/test_cli_help.py). The
# commands import the library (and so torch) inside their bodies: the one kind of function-local import kept.
from trtvocab.base.limits import GRAMMAR_LIMITS_HELP, MAX_REGEX_CHARS
from trtvocab.base.publish import atomic_write_bytes
from trtvocab.base.units import human_bytes as human
from trtvocab.checkpoints.real_models import MODELS, find, model_path
from trtvocab.checkpoints.real_models import assemble as assemble_model
from trtvocab.errors import ConfigError, InputError, PeerRankError, RankFailures, TrtVocabError

_STARTED = time.perf_counter()  # about when the command line started (start-up times: _time_line)

# typer's click (typer >= 0.2x vendors its own): its Context and HelpFormatter, whichever it is.
_ClickContext = typer.core.TyperCommand.context_class


class _HelpFormatter(_ClickContext.formatter_class):  # type: ignore[name-defined,misc]
    """click's help, wrapped only at spaces: ``--json-schema``, ``tensorrt-rtx`` and a long value list never
    break inside a word (click's wrapper breaks at hyphens)."""

    @staticmethod
    def _wrap(text: str, width: int, indent: str = "") -> list[str]:
        wrapper = textwrap.TextWrapper(width, initial_indent=indent, subsequent_indent=indent,
                                       break_on_hyphens=False, break_long_words=False)
        lines: list[str] = []
        for para in text.split("\n\n"):
            lines += [*(wrapper.wrap(" ".join(para.split())) or [""]), ""]
        return lines[:-1]

    def write_text(self, text: str) -> None:
        self.write("\n".join(self._wrap(text, self.width, " " * self.current_indent)) + "\n")

    def write_dl(self, rows: Any, col_max: int = 30, col_spacing: int = 2) -> None:
        rows = list(rows)
        first_col = min(max((len(first) for first, _ in rows), default=0), col_max) + col_spacing
        pad = " " * (first_col + self.current_indent)
        for first, second in rows:
            self.write(f"{'':>{self.current_indent}}{first}")
            if not second:
                self.write("\n")
                continue
            if len(first) <= first_col - col_spacing:
                self.write(" " * (first_col - len(first)))
            else:
                self.write("\n" + pad)
            lines = self._wrap(second, max(self.width - first_col - 2, 10))
            self.write("\n".join([lines[0], *(pad + line if line else "" for line in lines[1:])]) + "\n")


class _Context(_ClickContext):  # type: ignore[valid-type,misc]
    formatter_class = _HelpFormatter


class _Group(typer.core.TyperGroup):
    context_class = _Context


class _Command(typer.core.TyperCommand):
    context_class = _Context


# Help is plain text (rich_markup_mode=None): "[output]", "[engine]" and "E[h^2]" are words, not markup.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  cls=_Group,
                  help="The vocabulary dimension of LLM inference: plan, build and run TP-sharded LM heads.")
# Piped output gets wide lines: rich would otherwise wrap tables at 80 columns.
# emoji=False: a name a user gives (':X:', 'a:b:c') prints as itself, never as an emoji.
console = Console(width=None if sys.stdout.isatty() else 160, emoji=False)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160, emoji=False)


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    """A warning as one ``warning:`` line (no source file, line number or source line)."""
    err_console.print(f"[yellow]warning:[/] {escape(str(message))}", highlight=False, soft_wrap=True)


@app.callback()
def _cli() -> None:
    """The vocabulary dimension of LLM inference: plan, build and run TP-sharded LM heads."""
    warnings.showwarning = _show_warning


# How the library names a command's fields in its errors: in backquotes (`kv_cache`); each command
# line spells them as its own flags (_flags), so no layer below this one spells a flag.
_FIELD = re.compile(r"`([a-z][a-z0-9_]*)`")
# Fields whose flag is not their name in kebab case (the rest: `top_p` -> --top-p).
_FLAG_NAMES = {"prompts": "--prompt", "loras": "--lora", "stop_token_ids": "--stop-token-id",
               "adp_rows": "--attention-dp-rows"}


def _flags(command: Callable[..., None]) -> dict[str, str]:
    """A command's field -> flag map: every parameter as the command line spells it (its first ``--``
    declaration, else ``--kebab-name``; an argument as its NAME), and :data:`_FLAG_NAMES`."""
    out = dict(_FLAG_NAMES)
    for name, hint in typing.get_type_hints(command, include_extras=True).items():
        info = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, typer.models.ParameterInfo)), None)
        if isinstance(info, typer.models.ArgumentInfo):
            out[name] = name.upper()
        elif info is not None:
            # Inside Annotated, typer takes an Option's first positional (kept as its default) as a declaration.
            first = (info.default,) if isinstance(info.default, str) else ()
            decls = [d.split("/")[0] for d in (*first, *(info.param_decls or ())) if d.startswith("--")]
            out[name] = decls[0] if decls else "--" + name.replace("_", "-")
    return out


def _spelled(text: str, flags: dict[str, str]) -> str:
    """``text`` with each backquoted field the command has as its flag (`kv_cache` -> --kv-cache)."""
    return _FIELD.sub(lambda m: flags.get(m[1], m[0]), text)


def _fail(exc: Exception, flags: dict[str, str] | None = None) -> typer.Exit:
    """Print ``exc`` as one ``error:`` line (its text escaped: a message naming a path or a token
    is never read as rich markup; the fields it names spelled as ``flags``) and return the exit-code-2
    to raise. A :class:`RankFailures` shows the error of the first rank that failed on its own (not a
    PeerRankError echo); a typed error never carries a traceback."""
    shown: BaseException = exc
    note = ""
    if isinstance(exc, RankFailures) and exc.errors:
        own = {r: e for r, e in exc.errors.items() if not isinstance(e, PeerRankError)} or exc.errors
        rank = min(own)
        if isinstance(own[rank], TrtVocabError):
            shown = own[rank]
            note = f" (rank {rank}; {len(exc.errors)} rank(s) failed)"
    text = _spelled(str(shown), flags or {})
    err_console.print(f"[bold red]error:[/] {escape(type(shown).__name__)}: {escape(text)}{escape(note)}",
                      highlight=False, soft_wrap=True)
    return typer.Exit(code=2)


def cli_errors(fn: Callable[..., None] | None = None, *,
               cleanup: Callable[[], None] | None = None) -> Any:
    """A command's one error path: a :class:`~trtvocab.errors.TrtVocabError` or an ``OSError`` (a path that
    cannot be read or written) becomes one ``error:`` line, the fields it names spelled as the command's
    flags, and exit code 2 (:func:`_fail`); anything else is a bug and keeps its traceback. ``cleanup`` runs
    after the command either way (after the error line)."""
    def wrap(command: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> None:
            try:
                command(*args, **kwargs)
            except (TrtVocabError, OSError) as exc:
                raise _fail(exc, _flags(command)) from None
            finally:
                if cleanup is not None:
                    cleanup()
        return run

    return wrap(fn) if fn is not None else wrap


def _time_line(startup: list[tuple[str, float]], work: str, work_s: float) -> str:
    """``time: start-up S s (imports a s, load b s) + decode W s = T s``: where a command's wall clock went
    (``imports`` runs from the command line's start to ``startup``'s first phase)."""
    up = sum(s for _, s in startup)
    parts = ", ".join(f"{name} {s:.1f} s" for name, s in startup)
    return f"time: start-up {up:.1f} s ({parts}) + {work} {work_s:.1f} s = {up + work_s:.1f} s"


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
@app.command(cls=_Command)
@cli_errors
def plan(
    checkpoint: Annotated[Path | None, typer.Argument(help="HF directory, .safetensors or llama.cpp .gguf "
                                                      "file")] = None,
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
    lora: Annotated[list[Path] | None, typer.Option(help="a PEFT LoRA adapter folder to count per rank "
                                                    "(repeatable)")] = None,
    top_k: Annotated[int, typer.Option(help="decode step priced with top-k (0: off)")] = 0,
    top_p: Annotated[bool, typer.Option("--top-p", help="decode step priced with top-p (its cut's rounds)")] = False,
    min_p: Annotated[bool, typer.Option("--min-p", help="decode step priced with min-p")] = False,
    typical_p: Annotated[bool, typer.Option("--typical-p", help="decode step priced with typical-p")] = False,
    logprobs: Annotated[int | None, typer.Option(help="decode step priced returning top-N logprobs")] = None,
    logits_per_seq: Annotated[int, typer.Option(help="rows per sequence (speculative verification)")] = 1,
    gather_output: Annotated[str, typer.Option(help="LMHead gather mode priced: true | false | rank0")] = "true",
    gather_chunk_rows: Annotated[int | None, typer.Option(help="LMHead rows per gather (bounded all-gather)")] = None,
    head_dtype: Annotated[str, typer.Option(help="logits / hidden dtype of LMHead.forward: bf16 | fp32")] = "bf16",
    attention_dp_rows: Annotated[str | None, typer.Option(help="attention DP: every rank's row count, e.g. "
                                                          "3,0,5 (LMHead.forward's row exchange)")] = None,
    embedding_dtype: Annotated[str, typer.Option(help="embedding table: bf16 | fp32 | fp8")] = "bf16",
    kv_bytes_per_token: Annotated[int | None, typer.Option(help="KV-cache bytes per token per layer: price "
                                                           "replication in KV tokens")] = None,
    layers: Annotated[int, typer.Option(help="layers holding KV (with --kv-bytes-per-token)")] = 1,
    lm_head_tp: Annotated[int | None, typer.Option(help="the vocabulary split over head groups of N of the --tp "
                                                   "ranks (Mapping.lm_head_tp_size; default: --tp)")] = None,
    overlap_chunks: Annotated[int | None, typer.Option(help="LMHead.forward's all-gather in k column chunks "
                                                       "overlapping the GEMM (default: LMHead's rule)")] = None,
) -> None:
    """The vocabulary ledger: shards, weight bytes (bf16/fp8/nvfp4), logits, collectives, FLOPs, replication."""
    from trtvocab.pipeline.plan import DTYPE_BYTES, Sampler, collective_rows, ledger_rows, make_plan

    if checkpoint is not None:
        from trtvocab.weights.loader import open_head

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
    from trtvocab.weights.lora import open_adapter

    adapters = [open_adapter(folder, other_modules="ignore") for folder in lora or []]
    modes = {"true": True, "false": False, "rank0": "rank0"}
    if gather_output.lower() not in modes:
        raise ConfigError(f"--gather-output must be one of {', '.join(modes)}, got {gather_output!r}")
    if head_dtype not in DTYPE_BYTES:
        raise ConfigError(f"--head-dtype must be one of {', '.join(DTYPE_BYTES)}, got {head_dtype!r}")
    try:
        adp_rows = None if attention_dp_rows is None else [int(r) for r in attention_dp_rows.split(",")]
    except ValueError:
        raise ConfigError(f"--attention-dp-rows: expected comma-separated row counts, got {attention_dp_rows!r}") \
            from None
    if adp_rows is not None and (len(adp_rows) != tp or min(adp_rows) < 0):
        raise ConfigError(f"--attention-dp-rows: expected {tp} row counts >= 0 (one per rank), "
                          f"got {attention_dp_rows!r}")
    sampler = Sampler(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                      logprobs=logprobs)
    p = make_plan(vocab, hidden, tp, batch, layout, pad_to,  # type: ignore[arg-type]
                  tokens=tokens, link_gbs=link_gbs, tflops=tflops, tied=bool(tied), adapters=adapters,
                  sampler=sampler, logits_per_seq=logits_per_seq, gather_output=modes[gather_output.lower()],
                  gather_chunk_rows=gather_chunk_rows, logits_bytes=DTYPE_BYTES[head_dtype], adp_rows=adp_rows,
                  embedding_dtype=embedding_dtype, kv_bytes_per_token=kv_bytes_per_token, layers=layers,
                  lm_head_tp=lm_head_tp, overlap_chunks=overlap_chunks)
    if as_json:
        print(p.model_dump_json(indent=2))
        return
    groups = f" as {p.head_groups} head groups of {p.lm_head_tp_size}" if p.head_groups > 1 else ""
    table = Table(title=f"V={p.vocab_size:,}  H={p.hidden_size:,}  tp={p.tp_size}{groups}  batch={p.batch}  "
                        f"layout={p.layout}"
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
    if p.decode_step is not None:
        wire = Table(title="every collective, bytes one rank puts in (steady: the verdict's header rides on the "
                           "first)")
        for col, justify in (("collective", "left"), ("bytes per rank", "right"), ("kind", "right")):
            wire.add_column(col, justify=justify)  # type: ignore[arg-type]
        for row in collective_rows(p):
            wire.add_row(*row)
        console.print(wire)
    if p.kv is not None:
        k = p.kv
        console.print(f"KV: {k.kv_bytes_per_token:,} B per token ({k.kv_bytes_per_token_per_layer:,} B x "
                      f"{k.kv_layers} layers); replicated instead: extra per card = "
                      f"{k.kv_tokens_replicated_extra_per_card:,} KV tokens; matrices per rank = "
                      f"{k.kv_tokens_shard_per_rank:,} KV tokens")


# ---- models ---------------------------------------------------------------------------------
@app.command(cls=_Command)
@cli_errors
def models(
    name: Annotated[str | None, typer.Argument(help="print only this model's path (smollm2 | minilm | gemma3), "
                                               "e.g. trtvocab generate $(trtvocab models smollm2) ...")] = None,
    assemble: Annotated[bool, typer.Option(help="write a chunked model's file first (gemma3: its package's four "
                                           "chunks, sha256 checked; once)")] = False,
) -> None:
    """Where the real models of the README and the recipes are installed (SmolLM2's GGUF, MiniLM's folder,
    Gemma 3 270M's GGUF)."""
    if assemble:
        if name is None:
            raise InputError("--assemble needs a model name (gemma3)")
        assemble_model(name)
    if name is not None:
        print(model_path(name))
        return
    for m in MODELS:
        path = find(m)
        print(f"{m.name:<8} {path if path is not None else 'not installed: ' + m.install}")
        print(f"{'':<8} {m.what}")


# ---- build ----------------------------------------------------------------------------------
@app.command(cls=_Command)
@cli_errors
def build(
    recipe: Annotated[Path, typer.Argument(help="builders/*.toml")],
    out: Annotated[Path | None, typer.Option(help="artifact folder (default: the recipe's [output] dir)")] = None,
    ranks: Annotated[str | None, typer.Option(help="comma-separated ranks to build (default: all)")] = None,
    force: Annotated[bool, typer.Option(help="replace an existing artifact (atomically)")] = False,
    require_engine: Annotated[bool, typer.Option(help="fail unless a TensorRT engine is built")] = False,
    compiler: Annotated[str | None, typer.Option(help="engine compiler: auto | tensorrt | tensorrt-rtx "
                                                 "(overrides [engine] compiler)")] = None,
    targets: Annotated[str | None, typer.Option(help="comma-separated TensorRT-RTX targets, e.g. sm89,sm120 "
                                                "(overrides [engine] targets)")] = None,
) -> None:
    """Build per-rank weights, ONNX graphs (checked on CPU) and TensorRT engines where possible."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from trtvocab.artifact.recipe import load_recipe
    from trtvocab.pipeline.build import build as run_build

    imported = time.perf_counter()
    rec = load_recipe(recipe)
    rec = _engine_overrides(rec, require_engine, compiler, targets)
    rank_list = _int_list(ranks, "--ranks", 0, 4095) if ranks else None
    loaded = time.perf_counter()
    stages = ["load shard", "save weights", "export onnx", "verify onnx", "build engine", "export embedding",
              "build embedding engine"]
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[stage]}"),
                  TimeElapsedColumn(), console=err_console, transient=False) as bar:
        tasks: dict[int, int] = {}

        def finish(task: int) -> None:  # its clock stops: the bar shows this rank's own time
            if not bar.tasks[task].finished:
                bar.update(task, completed=len(stages), stage="done")

        def progress(rank: int, stage: str) -> None:
            if rank not in tasks:  # ranks build one after another: a new rank ends the one before
                for t in tasks.values():
                    finish(t)
                tasks[rank] = bar.add_task(f"rank {rank}", total=len(stages), stage=stage)
            done = stages.index(stage) if stage in stages else 0
            bar.update(tasks[rank], completed=done, stage=stage)

        path, manifest = run_build(rec, out, ranks=rank_list, force=force, progress=progress)
        for t in tasks.values():
            finish(t)
    built = time.perf_counter()
    table = Table(title=f"built {escape(str(path))}  ({escape(manifest.quant.label)}, tp={manifest.mapping.tp_size})")
    for col in ("rank", "vocab range", "format", "weights", "onnx check (max |err| / tol)", "engine"):
        table.add_column(col)
    for e in manifest.ranks:
        v = e.verify
        check = (f"{'ok' if v.ok else 'FAILED'} on {v.backend}: {v.max_abs_err:.2e} / {v.tolerance:.2e}"
                 if v else "skipped")
        table.add_row(str(e.rank), escape(f"[{e.start:,}, {e.end:,})"), str(e.weight_format),
                      human(e.resident_bytes), escape(check), escape(engine_summary(e.engine)))
    console.print(table)
    for e in manifest.ranks:
        for warning in e.engine.build.warnings if e.engine.build is not None else []:
            console.print(f"[yellow]rank {e.rank} engine warning:[/] {escape(warning)}", highlight=False)
    reasons = {e.engine.reason for e in manifest.ranks if not e.engine.built}
    for reason in sorted(r for r in reasons if r):
        wrote = ("Wrote the ONNX graphs and the PyTorch fallback weights instead" if manifest.backends.onnx
                 else "Wrote the PyTorch fallback weights only")
        console.print(f"[yellow]TensorRT engine not built:[/] {escape(reason)}. {wrote}.", highlight=False)
    err_console.print(_time_line([("imports", imported - _STARTED), ("recipe", loaded - imported)],
                                 f"build of {len(manifest.ranks)} rank(s)", built - loaded), highlight=False)


def _engine_overrides(rec: Any, require: bool, compiler: str | None, targets: str | None) -> Any:
    """The recipe with the command line's engine options applied (validated as the recipe is)."""
    from trtvocab.artifact.recipe import EngineSection

    update = rec.engine.model_dump()
    if require:
        update["require"] = True
    if compiler is not None:
        update["compiler"] = compiler
    if targets is not None:
        update["targets"] = [t for t in targets.split(",") if t.strip()]
    try:
        section = EngineSection(**update)
    except ValidationError as exc:
        flags = {"compiler": f"--compiler {compiler!r}", "targets": f"--targets {targets!r}"}
        raise ConfigError("; ".join(
            f"{flags.get(str(e['loc'][0]), '--compiler / --targets') if e['loc'] else '--compiler / --targets'}: "
            f"{e['msg']}" for e in exc.errors())) from None
    return rec.model_copy(update={"engine": section})


def engine_summary(engine: Any) -> str:
    """One cell: the compiler, targets, engine size and the GEMM's datatypes (or why there is no engine)."""

    if not engine.built or engine.build is None:
        return "skipped"
    b = engine.build
    where = ",".join(b.targets) if b.targets else (b.compute_capability or "")
    text = f"{b.compiler} {b.tensorrt_version} [{where}] {human(b.bytes)}"
    c = b.compute
    if c is not None and c.gemm is not None:
        text += f" {c.gemm.activation} x {c.gemm.weight}"
    elif c is not None and c.table is not None:
        text += f" table {c.table}"
    if c is not None and c.weight_path is not None:  # a GGUF graph: fused on the codes, or a dequantized copy
        text += f" ({c.weight_path})"
    if c is not None and c.problems:
        text += " CONTRACT BROKEN"
    return text


# ---- infer ----------------------------------------------------------------------------------
@app.command(cls=_Command)
@cli_errors(cleanup=lambda: _leave_process_group())
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

    from trtvocab.checkpoints.hidden_file import load_hidden, load_last_tokens
    from trtvocab.checkpoints.hidden_states import decoder
    from trtvocab.parallel.distributed import init_from_env
    from trtvocab.pipeline.infer import infer as run_infer

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
        _save_logits(out, logits)
        console.print(f"saved logits {list(logits.shape)} to {escape(str(out))}", highlight=False)


def _leave_process_group() -> None:
    """Under torchrun: tear the group down on every rank before exiting. A rank that exits
    with a live gloo group aborts in its destructor ("terminate called without an active
    exception"), which torchrun reports as a failed job."""
    from trtvocab.parallel import distributed as D

    if D.is_initialized():
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def _save_logits(path: Path, logits) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import save

    atomic_write_bytes(path, save({"logits": logits.contiguous()}))


# ---- inspect --------------------------------------------------------------------------------
@app.command(cls=_Command)
@cli_errors
def inspect(artifact: Annotated[Path, typer.Argument(help="folder written by trtvocab build")],
            as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Manifest summary, per-rank shard ranges and bytes, checksum verification."""
    from trtvocab.artifact.store import read_manifest

    manifest = read_manifest(artifact)
    if as_json:
        print(json.dumps(manifest.model_dump(mode="json"), indent=2))
        return
    h = manifest.head
    console.print(f"[bold]{escape(str(artifact))}[/]: V={h.vocab_size:,} H={h.hidden_size:,} dtype={h.dtype} "
                  f"layout={h.vocab_layout} tp={manifest.mapping.tp_size} quant={escape(manifest.quant.label)}"
                  f" ({escape(manifest.quant.reason)})"
                  + (f" stored={escape(manifest.quant.stored)}" if manifest.quant.stored else ""), highlight=False)
    fam = h.family
    if not (fam.head.is_identity and fam.embedding.is_identity):
        console.print(escape(f"family {fam.architecture or '(none)'}: logits = {fam.head.describe()}, embedding "
                             f"rows = {fam.embedding.describe()}"), highlight=False)
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
                      escape(engine_summary(e.engine)) if e.engine.built
                      else escape(f"skipped: {e.engine.reason or ''}"))
    console.print(table)
    for e in manifest.ranks:
        for what, rec in (("lm_head", e.engine), ("embedding", e.embedding_engine)):
            b = rec.build if rec is not None else None
            if b is None or b.compute is None:
                continue
            c = b.compute
            verdict = "[green]holds[/]" if c.ok else "[red]BROKEN: " + escape("; ".join(c.problems)) + "[/]"
            gemm = (f"GEMM {c.gemm.layer} ({c.gemm.kind}): {c.gemm.activation} x {c.gemm.weight} -> {c.gemm.output}"
                    if c.gemm is not None else f"table {c.table}")
            det = "; DISTRIBUTIVE_INDEPENDENCE" if b.distributive_independence else ""
            console.print(f"rank {e.rank} {what}.plan: {escape(b.compiler)} {escape(b.tensorrt_version)} for "
                          f"{escape(', '.join(b.targets))}, {human(b.bytes)} (ONNX {human(b.onnx_bytes)}), "
                          f"{c.layers} layers, {escape(gemm)}{det}"
                          + (f" [{escape(c.weight_path)}]" if c.weight_path else "")
                          + f"; contract ({escape(c.expected)}) {verdict}",
                          highlight=False)
    if manifest.head.deterministic:
        engines = [e.engine.build for e in manifest.ranks if e.engine.build is not None]
        if engines and all(b.distributive_independence for b in engines):
            console.print("deterministic: the PyTorch fallback is bitwise tp/batch-invariant; the engines are built "
                          "with DISTRIBUTIVE_INDEPENDENCE (a row's logits do not depend on the rest of the batch)",
                          highlight=False)
        else:
            console.print("deterministic: the guarantee holds for the PyTorch fallback only", highlight=False)
    console.print(f"[green]checksums ok[/] ({len(manifest.files)} files, every plan's sha256 included)")


# ---- hidden ---------------------------------------------------------------------------------
@app.command(cls=_Command)
@cli_errors
def hidden(
    model: Annotated[Path, typer.Argument(help="HF model directory or a llama.cpp .gguf file (transformers, "
                                          "offline)")],
    out: Annotated[Path, typer.Option(help="output .safetensors (hidden_states [T, H], seq_lens [B], input_ids [T], "
                                      "next_token_ids [T] for a causal LM)")],
    text: Annotated[list[str] | None,
                    typer.Option(help="a text (repeatable); default: four built-in sentences")] = None,
    text_file: Annotated[Path | None, typer.Option(help="UTF-8 file, one document per line (with or instead of "
                                                   "--text)")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="stop after this many rows in all")] = None,
    max_len: Annotated[int | None, typer.Option(help="split longer documents into sequences of this many tokens "
                                                "(default: the model's max_position_embeddings)")] = None,
    layer: Annotated[int, typer.Option(help="which hidden states: 0 = embeddings, -1 = final layer (a causal LM: "
                                       "after the final norm, what its head consumes)")] = -1,
) -> None:
    """Compute real hidden states of some texts (packed, no special tokens) and their token ids, for infer/compare."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from trtvocab.checkpoints.hidden_file import save_hidden
    from trtvocab.checkpoints.hidden_states import DEFAULT_TEXTS, read_text_file, text_hidden_states

    _check_output_file(out, "--out")
    texts = list(text or [])
    if text_file is not None:
        texts += read_text_file(text_file)
    texts = texts or list(DEFAULT_TEXTS)
    with Progress(TextColumn("hidden states"), BarColumn(), MofNCompleteColumn(), TextColumn("documents"),
                  TimeElapsedColumn(), console=err_console, transient=True, disable=len(texts) < 16) as bar:
        task = bar.add_task("hidden", total=len(texts))

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        result = text_hidden_states(model, texts, layer=layer, max_tokens=max_tokens, max_len=max_len,
                                    progress=progress)
    save_hidden(out, result.states, result.seq_lens, result.last_tokens, input_ids=result.input_ids,
                next_token_ids=result.next_token_ids)
    extra = ", input_ids"
    if result.next_token_ids is not None:
        scored = int((result.next_token_ids >= 0).sum())
        extra += f" and next_token_ids ({scored} rows with a next token)"
    lens = result.seq_lens.tolist()
    shown = str(lens) if len(lens) <= 16 else f"[{len(lens)} sequences, {sum(lens)} tokens]"
    console.print(f"wrote hidden_states {list(result.states.shape)}, seq_lens {shown}{extra} to {escape(str(out))}",
                  highlight=False)


# ---- quantize -------------------------------------------------------------------------------
def _gate_options(max_kld_mean: float | None, min_same_top: float | None, max_ppl_ratio: float | None):  # type: ignore[no-untyped-def]
    from trtvocab.accuracy.gates import Gates

    return Gates(max_kld_mean=max_kld_mean, min_same_top=min_same_top, max_ppl_ratio=max_ppl_ratio)


MAX_KLD_HELP = "gate: fail (exit 1) when a variant's teacher-forced mean KL(base || Q) exceeds this (nats)"
MIN_TOP_HELP = "gate: fail (exit 1) when a variant's Same top p is below this fraction (e.g. 0.98)"
MAX_PPL_HELP = "gate: fail (exit 1) when a variant's PPL(Q)/PPL(base) exceeds this (e.g. 1.01)"


@app.command(cls=_Command)
@cli_errors
def quantize(
    checkpoint: Annotated[Path, typer.Argument(help="dense HF directory, .safetensors or .gguf file")],
    algo: Annotated[str, typer.Option(help="fp8 | nvfp4")],
    out: Annotated[Path, typer.Option(help="output directory (in --format's layout, written atomically)")],
    calib: Annotated[Path | None, typer.Option(help=".safetensors with hidden_states [T, H]: static activation "
                                               "scale (FP8 W8A8 / NVFP4 W4A4)")] = None,
    weight_only: Annotated[bool, typer.Option(help="write no activation scale (FP8 W8A16: ModelOpt at load with "
                                              "weight_only, compressed-tensors as input_activations null; NVFP4 "
                                              "W4A16)")] = False,
    tensor_name: Annotated[str | None, typer.Option(help="tensor holding the [V, H] head (default: lm_head.weight "
                                                    "or the tied embedding)")] = None,
    batch_rows: Annotated[int, typer.Option(help="calibration rows per batch")] = 256,
    force: Annotated[bool, typer.Option(help="replace an existing OUT (atomically)")] = False,
    scale_search: Annotated[str, typer.Option(help="NVFP4 block scales: max (ModelOpt's amax / 6) | mse "
                                              "(per-block squared-error search, same format) | mse-act (the "
                                              "same, error weighted by --calib's E[h^2] per column)")] = "max",
    gate: Annotated[Path | None, typer.Option(help="hidden file with next_token_ids: judge the quantized head "
                                              "on it against the source head and write nothing if it misses a "
                                              "gate")] = None,
    max_kld_mean: Annotated[float | None, typer.Option(help=MAX_KLD_HELP)] = None,
    min_same_top: Annotated[float | None, typer.Option(help=MIN_TOP_HELP)] = None,
    max_ppl_ratio: Annotated[float | None, typer.Option(help=MAX_PPL_HELP)] = None,
    checkpoint_format: Annotated[str, typer.Option("--format", help="modelopt (ModelOpt's export, TensorRT-LLM) | "
                                                   "compressed-tensors (written by the compressed-tensors library: "
                                                   "llm-compressor / vLLM)")] = "modelopt",
) -> None:
    """Quantize the LM head (FP8 or NVFP4) with ModelOpt or the compressed-tensors library into a checkpoint
    LMHead.from_checkpoint picks up."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from trtvocab.accuracy.compare import quantize_gate
    from trtvocab.quant.quantize import parse_format, quantize_checkpoint

    checkpoint_format = parse_format(checkpoint_format)  # before anything else is looked at
    gates = _gate_options(max_kld_mean, min_same_top, max_ppl_ratio)
    if gates.active and gate is None:
        raise ConfigError("--max-kld-mean / --min-same-top / --max-ppl-ratio need --gate HIDDEN (the rows "
                          "to judge the quantized head on)")
    if gate is not None and not gates.active:
        raise ConfigError("--gate needs at least one of --max-kld-mean, --min-same-top, --max-ppl-ratio")
    gate_fn = quantize_gate(checkpoint, gate, gates, tensor_name, out) if gate is not None else None
    with Progress(TextColumn("calibrating"), BarColumn(), MofNCompleteColumn(), TextColumn("batches"),
                  TimeElapsedColumn(), console=err_console, transient=True, disable=calib is None) as bar:
        task = bar.add_task("calibrate", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        result = quantize_checkpoint(checkpoint, out, algo=algo, calib=calib, weight_only=weight_only,
                                     tensor_name=tensor_name, batch_rows=batch_rows, force=force,
                                     progress=progress, scale_search=scale_search, gate=gate_fn,
                                     checkpoint_format=checkpoint_format)
    if not result.published:
        for line in result.gate_failures:  # each names the gate's field: shown as this command's flag
            err_console.print(f"{escape(_spelled(line, _flags(quantize)))}; nothing written to {escape(str(out))}",
                              highlight=False, soft_wrap=True)
        raise typer.Exit(code=1)
    console.print(f"wrote [bold]{escape(str(result.out))}[/] ({escape(result.label)}, "
                  f"{escape(result.checkpoint_format)}) from "
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
@app.command(cls=_Command)
@cli_errors
def compare(
    baseline: Annotated[Path, typer.Argument(help="dense (bf16 / fp32) checkpoint: HF dir, .safetensors or .gguf")],
    hidden: Annotated[Path, typer.Option(help=".safetensors with hidden_states [T, H] (+ seq_lens, next_token_ids)")],
    variants: Annotated[list[Path] | None, typer.Argument(help="quantized checkpoints to compare")] = None,
    variant_specs: Annotated[list[str] | None, typer.Option(
        "--variant", help="a quantized checkpoint named with its toolchain, [TOOLCHAIN:]NAME=DIR (TOOLCHAIN: "
                          "modelopt | compressed-tensors, checked against DIR), repeatable: e.g. --variant "
                          "modelopt:NVFP4=a/ --variant compressed-tensors:NVFP4=b/")] = None,
    simulate: Annotated[str | None, typer.Option(help="in-memory variants of the baseline, comma-separated: "
                                                 "fp8[-row][-dyn|-w8a8|-w8a16], "
                                                 "nvfp4[-mse|-mse-act][-w4a16|-w4a4]")] = None,
    calib: Annotated[Path | None, typer.Option(help="hidden states for --simulate static activation scales "
                                               "(default: the compared rows)")] = None,
    tp: Annotated[int, typer.Option(help="tensor-parallel ranks (gloo processes) per head")] = 1,
    all_tokens: Annotated[bool, typer.Option("--all-tokens/--last-tokens",
                                             help="compare every row (default) or only each sequence's last "
                                                  "token (needs seq_lens)")] = True,
    dtype: Annotated[str, typer.Option(help="head dtype: auto (the baseline's) | bf16 | fp16 | fp32")] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="print GitHub markdown tables")] = False,
    plot: Annotated[Path | None, typer.Option(help="write a PNG: KL CDF, KLD and Δp histograms, logit error, "
                                              "PPL and Same top p / EAR per variant")] = None,
    bootstrap: Annotated[int, typer.Option(help="bootstrap resamples for the 95% intervals (0: none)")] = 1000,
    seed: Annotated[int, typer.Option(help="bootstrap seed")] = 0,
    max_kld_mean: Annotated[float | None, typer.Option(help=MAX_KLD_HELP)] = None,
    min_same_top: Annotated[float | None, typer.Option(help=MIN_TOP_HELP)] = None,
    max_ppl_ratio: Annotated[float | None, typer.Option(help=MAX_PPL_HELP)] = None,
    lora: Annotated[list[str] | None, typer.Option(help="NAME=DIR: the baseline's head with this PEFT LoRA adapter "
                                                   "as a variant (repeatable)")] = None,
) -> None:
    """Accuracy of quantized LM heads against the baseline: top-1/top-5, KL, logit error, and llama.cpp's
    teacher-forced PPL / KLD / Δp block (with EAR and intervals) where the hidden file has next tokens."""
    from trtvocab.accuracy.compare import compare as run_compare
    from trtvocab.accuracy.compare import plot_report
    from trtvocab.accuracy.gates import check_gates
    from trtvocab.checkpoints.hidden_file import load_hidden_file

    imported = time.perf_counter()
    gates = _gate_options(max_kld_mean, min_same_top, max_ppl_ratio)
    _check_output_file(plot, "--plot")
    data = load_hidden_file(hidden)
    calib_states = load_hidden_file(calib).states if calib is not None else None
    specs = [s for s in (simulate or "").split(",") if s.strip()]
    loaded = time.perf_counter()
    report = run_compare(baseline, list(variants or []), data.states, data.seq_lens, simulate=specs,
                         calib=calib_states, tp=tp, all_tokens=all_tokens, dtype=dtype,
                         next_token_ids=data.next_token_ids, bootstrap=bootstrap, seed=seed,
                         variant_specs=list(variant_specs or []), loras=list(lora or []))
    compared = time.perf_counter()
    flags = _flags(compare)  # the report's notes name compare's fields: shown as this command's flags
    for v in report.variants:
        v.note = _spelled(v.note, flags)
    report.teacher_forced_note = _spelled(report.teacher_forced_note, flags)
    failures = check_gates(report, gates)
    if plot is not None:
        plot_report(report, plot)
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    elif markdown:
        print(report.to_markdown(), end="")
    else:
        console.print(report.rich_table())
        for v in report.variants:
            if v.note:
                console.print(f"[dim]{escape(v.name)}: {escape(v.note)}[/]", highlight=False)
        tools = [v for v in report.variants if v.toolchain and v.toolchain != "dense"]
        if tools:
            console.print("[dim]toolchains: " + "; ".join(escape(f"{v.name} {v.toolchain}") for v in tools) + "[/]",
                          highlight=False)
        block = report.llamacpp_text()
        if block:
            print()
            print(block, end="")
    if report.teacher_forced_note and not as_json:
        err_console.print(f"note: {escape(report.teacher_forced_note)}", highlight=False, soft_wrap=True)
    if plot is not None and not as_json:
        err_console.print(f"wrote {escape(str(plot))}", highlight=False)
    if not as_json:  # --json: the JSON only, whichever stream a caller reads
        err_console.print(_time_line([("imports", imported - _STARTED), ("hidden states", loaded - imported)],
                                     f"heads loaded and scored{f' on {tp} ranks' if tp > 1 else ''}",
                                     compared - loaded), highlight=False)
    if failures:
        for line in failures:
            err_console.print(escape(_spelled(line, flags)), highlight=False, soft_wrap=True)
        raise typer.Exit(code=1)
    if gates.active and not as_json:
        held = ", ".join(f"{option} {value:g}" for option, value in (
            ("--max-kld-mean", max_kld_mean), ("--min-same-top", min_same_top), ("--max-ppl-ratio", max_ppl_ratio))
            if value is not None)
        err_console.print(f"gates passed: all {len(report.variants)} variant(s) hold {held}", highlight=False,
                          soft_wrap=True)


# ---- generate -------------------------------------------------------------------------------
@app.command(cls=_Command)
@cli_errors
def generate(
    model: Annotated[Path, typer.Argument(help="HF causal-LM directory or a llama.cpp .gguf file (transformers, "
                                          "offline)")],
    prompt: Annotated[list[str], typer.Option(help="a prompt (repeatable: prompts decode together as one batch)")],
    chat: Annotated[bool, typer.Option(help="wrap each prompt in the tokenizer's chat template")] = False,
    tp: Annotated[int | None, typer.Option(help="tensor-parallel ranks of the vocabulary dimension (local gloo "
                                           "processes; 1 runs in this process); default 1, or the artifact's")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="stop each prompt after this many new tokens")] = 32,
    temperature: Annotated[float, typer.Option(help="0 = greedy (the default)")] = 0.0,
    top_k: Annotated[int, typer.Option(help="keep the k largest logits (0 = off)")] = 0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling (1 = off)")] = 1.0,
    min_p: Annotated[float, typer.Option(help="keep p >= min_p * p_max (0 = off)")] = 0.0,
    seed: Annotated[int | None, typer.Option(help="seed of the noise: the same tokens at every --tp")] = None,
    repetition_penalty: Annotated[float, typer.Option(help="ids of the prompt and output: positive logits divided "
                                                      "by it, negative ones multiplied (1 = off)")] = 1.0,
    presence_penalty: Annotated[float, typer.Option(help="subtracted from ids present in the output, in [-2, 2] "
                                                    "(0 = off)")] = 0.0,
    frequency_penalty: Annotated[float, typer.Option(help="subtracted once per occurrence in the output, in "
                                                     "[-2, 2] (0 = off)")] = 0.0,
    logit_bias: Annotated[list[str] | None, typer.Option(help="ID=BIAS added to that token's logit (repeatable)")
                          ] = None,
    bad_words: Annotated[list[str] | None, typer.Option(help="a word never to complete (repeatable; tokenized as "
                                                        "vLLM does, with and without a leading space)")] = None,
    min_tokens: Annotated[int, typer.Option(help="eos and the stop ids are banned until this many new tokens")] = 0,
    stop: Annotated[list[str] | None, typer.Option(help="a stop string: the answer ends once its text holds it, "
                                                   "cut before it (repeatable)")] = None,
    stop_token_id: Annotated[list[int] | None, typer.Option(help="a token id that ends the answer besides eos "
                                                            "(repeatable)")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="eos does not end the answer")] = False,
    typical_p: Annotated[float, typer.Option(help="locally typical sampling mass (1 = off)")] = 1.0,
    logprobs: Annotated[int | None, typer.Option(help="return the top-N logprobs of each generated token and the "
                                                 "sampled one's (with --json)")] = None,
    logprobs_mode: Annotated[str, typer.Option(help="raw_logprobs | processed_logprobs | raw_logits | "
                                               "processed_logits")] = "raw_logprobs",
    n: Annotated[int, typer.Option("--n", help="completions per prompt, each its own seed stream")] = 1,
    beam_width: Annotated[int, typer.Option(help="greedy beam search with this many beams (1 = off)")] = 1,
    prompt_logprobs: Annotated[int | None, typer.Option(help="return each prompt token's logprob and the top-N of "
                                                        "its position (with --json; streamed, never [T, V])")] = None,
    json_schema: Annotated[Path | None, typer.Option(help="constrain every answer to this JSON schema file "
                                                     f"(xgrammar). {GRAMMAR_LIMITS_HELP}")] = None,
    regex: Annotated[str | None, typer.Option(help="constrain every answer to this regular expression "
                                              f"(xgrammar; at most {MAX_REGEX_CHARS} characters; the other limits as "
                                              "for --json-schema)")] = None,
    deterministic: Annotated[bool, typer.Option(help="batch- and tp-invariant head logits (LMHead deterministic "
                                                "mode, where this trtvocab has it)")] = False,
    backend: Annotated[str, typer.Option(help="torch (the model's head, or the artifact's fallback) | onnx | "
                                         "tensorrt | auto; all but torch need --artifact")] = "torch",
    artifact: Annotated[Path | None, typer.Option(help="run the head from this built artifact "
                                                  "(trtvocab build)")] = None,
    attention_dp: Annotated[bool, typer.Option(help="tp > 1: each rank runs the body for its own block of prompts "
                                               "(data parallel); the vocabulary stays split over the ranks")] = False,
    body_ranks: Annotated[int | None, typer.Option(help="with --attention-dp: how many ranks run a body (default: one "
                                                   "per usable CPU core, at most --tp); the rest hold only their "
                                                   "vocab slices")] = None,
    lm_head_tp: Annotated[int | None, typer.Option(help="with --attention-dp: the head split over groups of N of the "
                                                   "--tp ranks (default: all of them), each group decoding its "
                                                   "own body ranks' prompts")] = None,
    allow_other_checkpoint: Annotated[bool, typer.Option(help="run an --artifact built from another checkpoint "
                                                          "than MODEL anyway (said in the output)")] = False,
    gguf_blocks: Annotated[bool, typer.Option(help="a GGUF Q8_0 / Q6_K head stays in its stored blocks "
                                              "(--no-gguf-blocks: dequantized to float32)")] = True,
    kv_cache: Annotated[str, typer.Option(help="the body's KV cache: dynamic (grown each step) or static "
                                          "(allocated once)")] = "dynamic",
    compile_step: Annotated[bool, typer.Option(help="torch.compile the body's one-token step (needs --kv-cache "
                                               "static; the first run compiles, a minute or more)")] = False,
    body_kernels: Annotated[bool, typer.Option(help="the body's float32 linear layers multiply decode batches on "
                                               "trtvocab's dense kernel (faster at a few rows)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help='print {"results": [{"prompt", "token_ids", '
                                          '"text"[, "logprobs", "prompt_logprobs"]}]} only')] = False,
    lora: Annotated[list[str] | None, typer.Option(help="NAME=DIR: a PEFT LoRA adapter (lm_head / embed_tokens) "
                                                   "(repeatable)")] = None,
    lora_for: Annotated[list[str] | None, typer.Option(help="INDEX=NAME: prompt INDEX (0-based) uses adapter NAME; "
                                                       "a bare INDEX names the only adapter (default: one adapter "
                                                       "applies to every prompt)")] = None,
) -> None:
    """Decode with the vocabulary dimension split over --tp ranks: embedding, head and sampler in trtvocab."""
    from trtvocab.pipeline.generate import GenerateOptions, prepare, sampling_params
    from trtvocab.pipeline.generate import generate as run_generate

    imported = time.perf_counter()
    params = sampling_params(temperature, top_k, top_p, min_p, seed, logit_bias=logit_bias or [],
                             repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                             frequency_penalty=frequency_penalty, min_tokens=min_tokens,
                             stop_token_ids=stop_token_id or [], ignore_eos=ignore_eos, typical_p=typical_p,
                             logprobs=logprobs, logprobs_mode=logprobs_mode, prompt_logprobs=prompt_logprobs,
                             n=n, beam_width=beam_width)
    options = GenerateOptions(prompts=tuple(prompt), chat=chat, tp=tp, max_new_tokens=max_new_tokens, params=params,
                              json_schema=json_schema, regex=regex, deterministic=deterministic, backend=backend,
                              artifact=artifact, allow_other_checkpoint=allow_other_checkpoint,
                              attention_dp=attention_dp, body_ranks=body_ranks, lm_head_tp=lm_head_tp,
                              loras=lora, lora_for=lora_for,
                              gguf_blocks=gguf_blocks, bad_words=tuple(bad_words or ()), stop=tuple(stop or ()),
                              kv_cache=kv_cache, compile_step=compile_step, body_kernels=body_kernels)
    spec, loaded = prepare(model, options)
    prepared = time.perf_counter()
    report = run_generate(spec, loaded)
    ran = time.perf_counter()
    if as_json:
        print(json.dumps(report.as_json(loaded.tokenizer)))
        return
    _print_generated(model, report, spec, params, backend, artifact)
    # The decode loop's rate leaves out what came before it: said on stderr (stdout stays the answer).
    setup = ("ranks" if report.tp > 1 else "set-up", max(ran - prepared - report.seconds - report.compile_s, 0.0))
    compiled = [("compile", report.compile_s)] if report.compile_s > 0 else []
    err_console.print(_time_line([("imports", imported - _STARTED), ("model load", prepared - imported), setup,
                                  *compiled], "decode", report.seconds), highlight=False, soft_wrap=True)


def _print_generated(model: Path, report: Any, spec: Any, params: Any, backend: str, artifact: Path | None) -> None:
    """``generate``'s answer on stdout: what ran, each prompt and its text, the rates (and a compiled
    step's compile on its own line: it is in neither rate)."""
    how = "greedy" if params.greedy else f"temperature {params.temperature:g}, seed {params.seed}"
    chosen = f", as --backend {backend} chose" if backend != "auto" else ", --backend auto"
    notes = [f"tp {report.tp}", f"head: {report.head}" + (f" ({artifact}{chosen})" if artifact is not None else ""),
             how]
    if report.grammar:
        notes.append(report.grammar)
    if report.deterministic:  # what ran: a deterministic head, or a deterministic artifact on its PyTorch fallback
        notes.append("deterministic")
    console.print(escape(f"{model.name}: " + ", ".join(notes)), highlight=False)
    if report.tp > 1:
        ran = [r for r, (lo, hi) in enumerate(spec.blocks()) if lo < hi] if report.attention_dp else []
        bodies = "rank 0 ran the body for every prompt" if ran == [0] else \
            ("each rank" if len(ran) == report.tp else
             f"ranks 0-{len(ran) - 1}" if ran == list(range(len(ran))) else
             "ranks " + ", ".join(map(str, ran))) + " ran the body, each for its own prompts"
        split = f"the vocabulary split over {report.tp} ranks" if not report.lm_head_tp else \
            (f"the head split over {report.tp // report.lm_head_tp} groups of {report.lm_head_tp} ranks, each "
             "decoding its own ranks' prompts")
        console.print(f"(attention DP: {bodies}; {split})"
                      if report.attention_dp else
                      f"(every one of the {report.tp} ranks ran the whole body on every prompt; only the vocabulary "
                      "is split: --attention-dp gives each rank its own prompts)", highlight=False)
    if spec.artifact is not None and spec.artifact.note:
        console.print(escape(f"({_spelled(spec.artifact.note, _flags(generate))})"), highlight=False)
    for i, r in enumerate(report.results):
        console.print(f"[bold][{i + 1}][/] [dim]{escape(r.prompt)}[/]", highlight=False)
        console.print(escape(r.text.rstrip("\n")), highlight=False, soft_wrap=True)
    after = report.decode_tokens_per_s
    then = f", then {after:.1f} tokens/s" if after is not None else ""
    console.print(f"{report.new_tokens} new tokens in {report.seconds:.2f} s (prefill {report.prefill_s:.2f} s{then}): "
                  f"{report.tokens_per_s:.1f} tokens/s", highlight=False)
    if report.compile_s > 0:
        console.print(f"compile: {report.compile_s:.2f} s (torch.compile of the body's one-token step, in this run; "
                      "not in the times above)", highlight=False)


def main() -> None:  # pragma: no cover
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover  (python -m trtvocab.commands.cli)
    main()
