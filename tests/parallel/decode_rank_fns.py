"""Rank functions for tests/parallel/test_decode_step.py (importable by spawned processes).

One launch runs every case (:func:`all_cases`); every caught call also records how long it took on
its rank, so "fails fast, no hang" is a measurement inside the ranks, not of the launch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from trtvocab import LMHead, LogitsProcessor, Mapping, sampling
from trtvocab.sampling import SamplingParams, decode, sample

V, H, B = 103, 16, 4


@contextlib.contextmanager
def counting_collectives() -> Iterator[list[str]]:
    """Record every all_gather / all_reduce / all_to_all_single while the block runs (the functional
    all_gather of the prepared step included)."""
    names = ("all_gather", "all_reduce", "all_to_all_single")
    real = {n: getattr(dist, n) for n in names}
    seen: list[str] = []

    def wrap(name: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            seen.append(name)
            return real[name](*args, **kwargs)
        return counted

    from torch.distributed import _functional_collectives as fc

    real_fc = fc.all_gather_single  # the prepared step's gathers (traceable by torch.compile)

    def counted_fc(*args: Any, **kwargs: Any) -> Any:
        seen.append("all_gather")
        return real_fc(*args, **kwargs)

    for n in names:
        setattr(dist, n, wrap(n))
    fc.all_gather_single = counted_fc
    try:
        yield seen
    finally:
        for n, fn in real.items():
            setattr(dist, n, fn)
        fc.all_gather_single = real_fc


def _head(rank: int, world: int, gather_output: bool = False) -> LMHead:
    head = LMHead(V, H, dtype=torch.float32, mapping=Mapping(world_size=world, rank=rank, tp_size=world),
                  gather_output=gather_output)
    head.load_weights({"weight": torch.randn(V, H, generator=torch.Generator().manual_seed(1))})
    return head


def _hidden(step: int, rows: int = B) -> torch.Tensor:
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(100 + step))


def _catch(fn: Callable[[], Any], seconds: list[float] | None = None) -> tuple[str, Any]:
    """``("ok", result)`` or ``(error type name, message)``; the call's duration on this rank is
    appended to ``seconds`` (from the bad input to the raise, for a failing call)."""
    started = time.perf_counter()
    try:
        return "ok", fn()
    except Exception as exc:  # the test compares the error types per rank
        return type(exc).__name__, str(exc)
    finally:
        if seconds is not None:
            seconds.append(time.perf_counter() - started)


def all_cases(rank: int, world: int, bad_calls: list[int]) -> dict[str, Any]:
    """Every case of tests/parallel/test_decode_step.py in one launch (none of them kills a rank); each builds
    its own heads, so one case's handshake state does not reach the next."""
    return {"steady": steady_counts(rank, world), "later calls": bad_input_on_later_calls(rank, world, bad_calls),
            "steady state changes": changes_in_steady_state(rank, world),
            "materialized then chunked": materialized_then_chunked(rank, world)}


def steady_counts(rank: int, world: int) -> dict[str, Any]:
    """Tokens and collectives per step: decode (fused) vs forward + sample, greedy and seeded rows."""
    head = _head(rank, world)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5),
              SamplingParams(temperature=1.3, seed=6), SamplingParams(temperature=0.5, seed=7)]
    out: dict[str, Any] = {"decode": [], "separate": [], "reference": [], "decode_counts": [], "separate_counts": []}
    for step in range(5):
        x = _hidden(step)
        with counting_collectives() as seen:
            out["decode"].append(decode(x, head, params, step=step).tolist())
        out["decode_counts"].append(len(seen))
        with counting_collectives() as seen:
            out["separate"].append(sample(head(x), head, params, step=step).tolist())
        out["separate_counts"].append(len(seen))
    # The reference: the same steps with a handshake before every call.
    ref = _head(rank, world)
    ref.handshake_every_call = True
    for step in range(5):
        out["reference"].append(sample(ref.local_logits(_hidden(step)), ref, params, step=step).tolist())
    # top-k on: two data collectives (the merged top-k carries the verdict, then the race)
    with counting_collectives() as seen:
        for step in range(3):
            decode(_hidden(step), head, SamplingParams(temperature=1.0, top_k=5, seed=1), step=step)
    out["topk_counts"] = len(seen)
    # logprobs: its handshake once, then one collective a call (the vocab tree's node pairs carry
    # the verdict and the picked logits)
    ids = torch.tensor([[0, 1], [5, 90], [7, 7], [100, 3]])
    counts = []
    for step in range(3):
        with counting_collectives() as seen:
            sampling.logprobs(head.local_logits(_hidden(step)), head, ids)
        counts.append(len(seen))
    out["logprobs_counts"] = counts
    return out


def bad_input_on_later_calls(rank: int, world: int, bad_calls: list[int]) -> dict[str, Any]:
    """Rank 1 brings NaN hidden states on the calls in ``bad_calls`` (same signature); every call's
    outcome is recorded on every rank."""
    head = _head(rank, world)
    gathered = _head(rank, world, gather_output=True)
    params = SamplingParams(temperature=0.7, seed=3)
    out: dict[str, list[Any]] = {"decode": [], "forward": [], "sample": [], "logprobs": [], "top_p": [],
                                 "seconds": []}
    seconds = out["seconds"]
    nucleus = SamplingParams(temperature=0.9, top_p=0.8, seed=4)
    ids = torch.tensor([[0, 1], [5, 90], [7, 7], [100, 3]])
    for call in range(max(bad_calls) + 2):
        x = _hidden(call)
        if rank == 1 and call in bad_calls:
            x = x.clone()
            x[2, 3] = float("nan")
        out["decode"].append(_catch(lambda x=x, call=call: decode(x, head, params, step=call).tolist(), seconds))
        out["forward"].append(_catch(lambda x=x: gathered(x).sum().item(), seconds))
        logits = head.local_logits(_hidden(call))
        if rank == 1 and call in bad_calls:
            logits[1, 0] = float("nan")
        out["sample"].append(_catch(lambda lg=logits, call=call: sample(lg, head, params, step=call).tolist(), seconds))
        out["logprobs"].append(_catch(lambda lg=logits: sampling.logprobs(lg, head, ids).tolist(), seconds))
        out["top_p"].append(_catch(lambda x=x, call=call: decode(x, head, nucleus, step=call).tolist(), seconds))
    return out


def changes_in_steady_state(rank: int, world: int) -> dict[str, Any]:
    """After two steady calls: one rank alone changes its batch, one rank alone changes a per-call
    argument, all ranks change the batch together (a renegotiation that succeeds), a bad seq_lens
    before a gathered forward (LogitsProcessor's raise_collectively)."""
    head = _head(rank, world)
    gathered = _head(rank, world, gather_output=True)
    params = SamplingParams(temperature=0.7, seed=3)
    seconds: list[float] = []
    out: dict[str, Any] = {"seconds": seconds}

    def timed(fn: Callable[[], Any]) -> tuple[str, Any]:
        return _catch(fn, seconds)

    for step in range(2):
        decode(_hidden(step), head, params, step=step)
        gathered(_hidden(step))
    out["one rank's batch"] = timed(lambda: decode(_hidden(2, B + 1 if rank == 1 else B), head, params, step=2))
    out["one rank's forward batch"] = timed(lambda: gathered(_hidden(2, B + 1 if rank == 1 else B)).shape[0])
    other = SamplingParams(temperature=0.9 if rank == 2 else 0.7, seed=3)
    out["one rank's temperature"] = timed(lambda: decode(_hidden(3), head, other, step=3))
    out["everyone's batch"] = timed(lambda: decode(_hidden(4, B + 2), head, params, step=4).tolist())
    out["everyone's forward batch"] = timed(lambda: list(gathered(_hidden(4, B + 2)).shape))
    out["healthy after"] = timed(lambda: decode(_hidden(5, B + 2), head, params, step=5).tolist())
    hidden = _hidden(6, 8)
    seq_lens = torch.tensor([3, 5]) if rank != 0 else torch.tensor([3, 6])  # rank 0: sums to 9, not 8
    processor = LogitsProcessor()
    processor(_hidden(7, 8), gathered, torch.tensor([3, 5]))  # a steady gathered forward of 2 rows
    out["bad seq_lens"] = timed(lambda: processor(hidden, gathered, seq_lens).shape[0])
    out["forward healthy after"] = timed(lambda: list(processor(hidden, gathered, torch.tensor([3, 5])).shape))
    return out


def materialized_then_chunked(rank: int, world: int) -> dict[str, Any]:
    """Steady materialized logsumexp calls, then a chunked one with NaN on rank 1: the chunked path
    handshakes every call (its first collective carries no verdict), so every rank still raises."""
    from trtvocab import sampling
    from trtvocab.sampling import chunked

    head = _head(rank, world)
    x = _hidden(0)
    for _ in range(3):
        sampling.logsumexp(head.local_logits(x), head)
    bad = x.clone()
    if rank == 1:
        bad[0, 0] = float("nan")
    seconds: list[float] = []

    def timed(fn: Callable[[], Any]) -> tuple[str, Any]:
        return _catch(fn, seconds)

    return {"seconds": seconds, "chunked": timed(lambda: chunked.stream_logsumexp(bad, head).tolist()),
            "greedy": timed(lambda: chunked.stream_greedy(bad, head).tolist()),
            "after": timed(lambda: sampling.logsumexp(head.local_logits(x), head).tolist())}
