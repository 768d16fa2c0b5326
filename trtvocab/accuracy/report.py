"""The report of ``trtvocab compare``: the baseline, the rows compared and each variant, as a rich
table, markdown, JSON (``as_dict``) and llama.cpp's KL-divergence blocks (as ``llama-perplexity``
prints them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtvocab.accuracy.metrics import LogitMetrics
from trtvocab.accuracy.stats import LlamaCppStats, format_block, markdown_table
from trtvocab.base.units import human_bytes


@dataclass
class VariantResult:
    """A compared head: its name, label, resident bytes per rank, :class:`LogitMetrics` and, where the
    rows have next tokens, its llama.cpp statistics (:class:`~trtvocab.accuracy.stats.LlamaCppStats`)."""

    name: str
    label: str
    head_bytes_per_rank: int
    metrics: LogitMetrics
    note: str = ""
    llamacpp: LlamaCppStats | None = None
    toolchain: str = ""
    path: str | None = None

    def as_dict(self) -> dict[str, Any]:
        m = self.metrics
        return {"name": self.name, "label": self.label, "toolchain": self.toolchain, "path": self.path,
                "rows": m.rows, "top1_agreement": m.top1_agreement,
                "top5_overlap": m.top5_overlap, "kl_mean": m.kl_mean, "kl_p99": m.kl_p99, "kl_max": m.kl_max,
                "max_abs_logit_err": m.max_abs_logit_err, "mean_abs_logprob_err": m.mean_abs_logprob_err,
                "head_bytes_per_rank": self.head_bytes_per_rank, "note": self.note,
                "llamacpp": None if self.llamacpp is None else self.llamacpp.as_dict()}


TEACHER_FORCED_NOTE = ("teacher-forced statistics left out: the hidden file has no next_token_ids "
                       "(write it with `trtvocab hidden` on a causal LM)")


@dataclass
class CompareReport:
    """Everything ``trtvocab compare`` prints: the baseline, the rows compared and each variant."""

    baseline: str
    baseline_label: str
    baseline_bytes_per_rank: int
    rows: int
    rows_mode: str  # "all tokens" | "last tokens"
    tp: int
    dtype: str
    vocab_size: int
    variants: list[VariantResult]
    teacher_forced_rows: int = 0  # rows with a next token (0: no llama.cpp block)
    teacher_forced_note: str = ""  # why there is no llama.cpp block

    def as_dict(self) -> dict[str, Any]:
        return {"baseline": {"name": self.baseline, "label": self.baseline_label,
                             "head_bytes_per_rank": self.baseline_bytes_per_rank},
                "rows": self.rows, "rows_mode": self.rows_mode, "tp": self.tp, "dtype": self.dtype,
                "vocab_size": self.vocab_size, "kl": "KL(baseline || variant), nats, global softmax in float64",
                "teacher_forced_rows": self.teacher_forced_rows,
                "llamacpp": ("llama.cpp llama-perplexity KL-divergence statistics of the rows with a next token, "
                             "full vocabulary in float64; probabilities as fractions; *_pm = llama.cpp's ±; "
                             "ci95 = bootstrap 95% interval"),
                "teacher_forced_note": self.teacher_forced_note,
                "variants": [v.as_dict() for v in self.variants]}

    def rich_table(self, title: str | None = None) -> Any:
        """The report as a ``rich`` table (title: :meth:`title` by default); every cell escaped, so names
        and paths print as themselves."""
        from rich.markup import escape
        from rich.table import Table

        table = Table(title=escape(self.title() if title is None else title))
        for i, col in enumerate(COLUMNS):
            table.add_column(escape(col), justify="left" if i < 2 else "right")
        for row in self.table_rows():
            table.add_row(*(escape(str(cell)) for cell in row))
        return table

    def table_rows(self) -> list[list[str]]:
        """Rows for a text table (rich or markdown), baseline first."""
        out = [[self.baseline_label, _short(self.baseline), "—", "—", "—", "—", "—", "—", "—",
                human_bytes(self.baseline_bytes_per_rank, digits=2)]]
        for v in self.variants:
            m = v.metrics
            out.append([v.label, _short(v.name), f"{m.top1_agreement:.2%}", f"{m.top5_overlap:.3f}",
                        f"{m.kl_mean:.2e}", f"{m.kl_p99:.2e}", f"{m.kl_max:.2e}", f"{m.max_abs_logit_err:.3f}",
                        f"{m.mean_abs_logprob_err:.2e}", human_bytes(v.head_bytes_per_rank, digits=2)])
        return out

    def title(self) -> str:
        return (f"{self.rows} rows ({self.rows_mode}), V={self.vocab_size:,}, tp={self.tp}, head dtype {self.dtype}; "
                "KL(baseline || variant) in nats")

    def llamacpp_named(self) -> list[tuple[str, LlamaCppStats]]:
        """``(name, stats)`` per variant with a llama.cpp block; the name carries the variant's toolchain
        (where its name does not already) and its resident head bytes."""
        per = " / rank" if self.tp > 1 else ""
        out = []
        for v in self.variants:
            if v.llamacpp is None:
                continue
            short = _short(v.name)
            parts = [short] + ([v.toolchain] if v.toolchain and not short.startswith(v.toolchain + ":") else [])
            parts.append(human_bytes(v.head_bytes_per_rank, digits=2) + per)
            out.append((f"{v.label} ({', '.join(parts)})", v.llamacpp))
        return out

    def llamacpp_text(self) -> str:
        """Every variant's llama.cpp block, as ``llama-perplexity`` prints it in its KL-divergence mode."""
        parts = []
        for name, stats in self.llamacpp_named():
            parts.append(f"###### {name} vs {self.baseline_label} ({_short(self.baseline)}): {stats.n} "
                         "teacher-forced rows ######\n" + format_block(stats))
        return "\n".join(parts)

    def to_markdown(self) -> str:
        lines = [f"_{self.title()}_", "", "| " + " | ".join(c.replace("|", "\\|") for c in COLUMNS) + " |",
                 "|" + "|".join(["---"] * 2 + ["---:"] * (len(COLUMNS) - 2)) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in self.table_rows()]
        text = "\n".join(lines) + "\n"
        named = self.llamacpp_named()
        if named:
            text += (f"\n_llama.cpp statistics vs {self.baseline_label}, {self.teacher_forced_rows} teacher-forced "
                     "rows (full vocabulary, float64); ± = standard error, [ ] = bootstrap 95% interval_\n\n"
                     + markdown_table(named))
        return text


COLUMNS = ["format", "head", "top-1 agree", "top-5 overlap", "KL mean", "KL p99", "KL max", "max |Δlogit|",
           "mean |Δlogp| top-1", "bytes / rank"]


def _short(name: str) -> str:
    return name if name.startswith(("sim:", "quantized:")) else Path(name).name or name



__all__ = ["COLUMNS", "TEACHER_FORCED_NOTE", "CompareReport", "VariantResult"]
