"""A rank that fails while a peer is stuck (``trtvocab/parallel/launch.py``): ``run_ranks`` returns within
seconds of the failure with the failing rank's typed error, not after the peers' timeout.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.distributed as dist

from trtvocab.errors import InputError, RankFailures


def fail_or_block(rank: int, world: int, stamp: str) -> None:
    """Rank 1 fails outside any handshake (writing ``time.monotonic()``, system-wide on Linux, to
    ``stamp`` first); rank 0 is stuck (as in a collective of a subgroup the failed rank never enters,
    or a long local step) and would not return for minutes."""
    if rank == 1:
        Path(stamp).write_text(repr(time.monotonic()))
        raise InputError("seq_lens: rank 1 was handed a bad batch before the handshake")
    time.sleep(600)
    dist.barrier()


@pytest.mark.ranks
@pytest.mark.timeout(180)
def test_run_ranks_returns_once_a_peer_failed(tmp_path: Path) -> None:
    from trtvocab.parallel.launch import run_ranks

    stamp = tmp_path / "failed_at"
    with pytest.raises(RankFailures) as info:
        run_ranks(fail_or_block, 2, str(stamp), timeout_s=90)  # the old launcher waited 2 * 90 + 60 s
    elapsed = time.monotonic() - float(stamp.read_text())  # from the failure, not from the ranks' start-up
    assert elapsed < 45, elapsed
    assert isinstance(info.value.errors[1], InputError) and "seq_lens" in str(info.value.errors[1])
    assert "rank 0 exited without a result" in str(info.value)  # stopped once the outcome was known
    assert "Traceback" not in str(info.value)  # a typed error carries no traceback
