"""Run a function on N local ranks with a real process group (gloo on CPU, NCCL on GPU).

``run_ranks(fn, 3, *args)`` starts three processes, each joins a
``torch.distributed`` group with a timeout, calls ``fn(rank, world_size, *args)``
and sends its return value (or its exception) back. Under ``torchrun`` use
:func:`trtvocab.parallel.distributed.init_from_env` instead; :func:`run_ranks` is for
local launches, tests and the CLI.

The ranks are forked from one server process that has imported torch (and what
:func:`warm_up` named) once, not spawned; they get the caller's directory, ``sys.path`` and
``os.environ`` as a spawned rank would. Why: docs/architecture.md ("Starting ranks").

Results travel back over a ``multiprocessing`` queue as pickles: between this process and
children it started itself, never from a file or a peer it did not start (the one use of
pickle in trtvocab; see docs/threat_model.md).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trtvocab.errors import DistributedError, RankFailures, TrtVocabError
from trtvocab.parallel.distributed import DEFAULT_TIMEOUT_S, default_backend

# Once the outcome is known (a rank raised or died), how long the others get to report
# their own errors (their handshake peers raise PeerRankError within this) before they
# are stopped: a rank blocked in a collective would otherwise wait for its timeout.
FAILURE_GRACE_S = 3.0
# How long the ranks' interpreters may take to start (torch imported) before the work is sent anyway.
# Start-up time depends on the machine's load (tens of seconds on a busy 2-core machine), so it is
# waited for here, before any rank joins the group: the collective timeout then covers only the
# ranks' own work, never a peer that is still importing torch.
STARTUP_S = 600.0
_UP = "up"  # a rank's first message: its interpreter is up and waiting for the work
# What the rank server imports before it forks any rank (more through warm_up()).
_PRELOAD = ["torch", "torch.distributed", "trtvocab.parallel.launch"]


def _context() -> Any:
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))  # read only when the server starts
    return ctx


def warm_up(modules: Sequence[str] = ()) -> None:
    """Start the rank server now, with ``modules`` imported there too, so it starts while this
    process does other work (loading a model): a caller that knows it will run ranks calls this
    first. A module that fails to import there is imported by each rank instead. Without effect
    once the server runs (it keeps what it imported) or where ranks are spawned."""
    for m in modules:
        if m not in _PRELOAD:
            _PRELOAD.append(m)
    ctx = _context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return DistributedError(f"{type(exc).__name__}: {exc}")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _worker(
    rank: int,
    world: int,
    port: int,
    backend: str,
    timeout_s: float,
    results: Any,
    inbox: Any,
    environ: dict[str, str],
) -> None:
    os.environ.clear()  # the parent's environment now, not the rank server's at its start
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    # Each rank gets one thread on small machines: N ranks x all cores would oversubscribe.
    torch.set_num_threads(max(1, usable_cores() // world))
    try:
        results.put(pickle.dumps((rank, _UP, None, "")))
        fn, args = inbox.get(timeout=STARTUP_S + timeout_s)
        if "nccl" in backend:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            out = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle (tensor bytes copied) rather than torch's shared-memory reduction:
        # with the latter the parent fetches the storage from this process *after* it
        # has exited, which fails with "connection reset by peer".
        results.put(pickle.dumps((rank, True, out, "")))
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        results.put(pickle.dumps((rank, False, _picklable(exc), traceback.format_exc())))


def _wait_until_up(procs: list[Any], results: Any) -> None:
    """Wait (up to :data:`STARTUP_S`) until every rank has said it is up, or one has died: then
    every rank gets its work at once, and none waits in the rendezvous for a slow start."""
    up: set[int] = set()
    until = time.monotonic() + STARTUP_S
    early: list[bytes] = []
    while len(up) < len(procs) and time.monotonic() < until:
        try:
            raw = results.get(timeout=0.2)
        except queue.Empty:
            if any(not p.is_alive() for p in procs):
                break  # a rank died while starting: the main loop reports it
            continue
        rank, ok = pickle.loads(raw)[:2]
        if ok == _UP:
            up.add(rank)
        else:
            early.append(raw)  # a report from before the work (an error in start-up)
    for raw in early:
        results.put(raw)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    rank_args: Sequence[tuple[Any, ...]] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    ``rank_args[r]``, when given, is appended to rank ``r``'s arguments (what only some ranks
    need, e.g. a model only the ranks that run it: every argument is sent to its process).

    ``fn`` must be importable (a module-level function). Raises :class:`RankFailures`
    when any rank raised, with every rank's exception in ``.errors``; ranks still
    alive after ``timeout_s`` beyond the collectives' own timeout are killed.

    Returns as soon as the outcome is known: when a rank has raised or died without a
    report, the others get :data:`FAILURE_GRACE_S` to report and are then stopped (a
    rank waiting for the failed one in a collective never returns by itself). The
    message carries the first failing rank's traceback only for an error that is not
    one of trtvocab's typed errors (a bug, worth the trace).
    """
    if world_size < 1:
        raise DistributedError(f"world_size must be >= 1, got {world_size}")
    if rank_args is not None and len(rank_args) != world_size:
        raise DistributedError(f"rank_args: expected one tuple per rank ({world_size}), got {len(rank_args)}")
    if backend is None:
        # One GPU per rank where there are enough; gloo alone otherwise (CPU tensors only).
        enough = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
        backend = default_backend() if enough else "gloo"
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    # The function and its arguments go through a queue once every process has started, not as
    # Process arguments: those are written into a pipe the child reads only after its interpreter
    # and imports are up (spawn), so a large argument (a model, a tokenizer) would start the ranks one
    # after another. From a queue, each child unpickles its share while the others start too.
    inboxes = [ctx.Queue() for _ in range(world_size)]
    environ = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, timeout_s, results, inboxes[r], environ),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    traces: dict[int, str] = {}
    deadline = time.monotonic() + STARTUP_S + timeout_s * 2 + 60
    try:
        _wait_until_up(procs, results)
        for r, inbox in enumerate(inboxes):
            inbox.put((fn, args + (tuple(rank_args[r]) if rank_args is not None else ())))
        deadline = time.monotonic() + timeout_s * 2 + 60
        # Poll instead of one long blocking get: a rank that dies before reporting (a
        # crash in spawn bootstrap, an OOM kill) must not make the parent wait for the
        # whole deadline. A dead rank's report, if it sent one, is already in the pipe.
        all_dead_since: float | None = None
        failed_since: float | None = None
        while len(outputs) + len(errors) < world_size and time.monotonic() < deadline:
            if failed_since is not None and time.monotonic() - failed_since > FAILURE_GRACE_S:
                break  # the outcome is known; the stragglers are stopped below
            try:
                rank, ok, value, trace = pickle.loads(results.get(timeout=0.2))
            except queue.Empty:
                reported = set(outputs) | set(errors)
                if failed_since is None and any(not p.is_alive() and p.exitcode not in (0, None) and r not in reported
                                                for r, p in enumerate(procs)):
                    failed_since = time.monotonic()  # died without a report (killed, crashed)
                if any(p.is_alive() for p in procs):
                    continue
                all_dead_since = all_dead_since or time.monotonic()
                if time.monotonic() - all_dead_since > 2.0:  # grace for the pipe to drain
                    break
                continue
            if ok == _UP:
                continue
            if ok:
                outputs[rank] = value
            else:
                errors[rank], traces[rank] = value, trace
                failed_since = failed_since or time.monotonic()
    finally:
        if failed_since is not None or time.monotonic() >= deadline or len(outputs) < world_size:
            for p in procs:
                if p.is_alive():
                    p.kill()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        # A rank that died before it read its work leaves that work in its inbox's feeder thread,
        # which this process would otherwise wait for at exit, forever (nobody reads the pipe).
        for inbox in inboxes:
            inbox.cancel_join_thread()
            inbox.close()
    missing = [r for r in range(world_size) if r not in outputs and r not in errors]
    for r in missing:
        errors[r] = DistributedError(f"rank {r} exited without a result (exit code {procs[r].exitcode})")
    if errors:
        lines = [f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(errors.items())]
        untyped = sorted(r for r in traces if not isinstance(errors[r], TrtVocabError))
        first = untyped[0] if untyped else None
        detail = f"\n--- traceback of rank {first} ---\n{traces[first]}" if first is not None else ""
        raise RankFailures(f"{len(errors)} of {world_size} ranks failed:\n" + "\n".join(lines) + detail, errors)
    return [outputs[r] for r in range(world_size)]
