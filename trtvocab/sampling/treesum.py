"""A sum over the vocabulary that is bitwise the same at every tp size: a tree on global token ids.

The tree is the pairwise tree over the (power-of-two padded) global id range: node
``(level, i)`` holds ids ``[i * 2**level, (i + 1) * 2**level)`` and is ``left + right``.
A rank owning ``[start, end)`` cuts its range into the largest aligned nodes that fit
(at most ``2 * log2(V)`` of them) and sums each node's elements pairwise: the same adds,
in the same order, that the whole tree does there. The node sums of all ranks are then
gathered (``O(B log V)`` numbers) and every rank merges them bottom-up in the one tree
order (a node beyond the vocabulary is 0). tp 1 runs the same code with one range, so
its result is the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def aligned_nodes(start: int, end: int) -> list[tuple[int, int]]:
    """``[(level, index)]`` of the maximal aligned power-of-two nodes covering ``[start, end)``."""
    nodes = []
    pos = start
    while pos < end:
        level = 0
        while pos % (2 ** (level + 1)) == 0 and pos + 2 ** (level + 1) <= end:
            level += 1
        nodes.append((level, pos >> level))
        pos += 2**level
    return nodes


def _pairwise(values: torch.Tensor) -> torch.Tensor:
    """Sum of ``values [B, 2**k]`` along dim 1 by the pairwise tree (adjacent pairs first)."""
    while values.shape[1] > 1:
        values = values[:, 0::2] + values[:, 1::2]
    return values[:, 0]


def tree_sum(local: torch.Tensor, start: int, vocab_size: int, tp_size: int, group: Any,
             ranges: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """Per-row sum of every rank's ``local [B, n]`` (columns ``start .. start + n``) over the vocab tree.
    ``ranges``: every rank's ``[start, end)`` when the caller knows them (a head's shards): the node
    ids then need no exchange, only the node sums move."""
    n = local.shape[1]
    nodes = aligned_nodes(start, start + n)
    sums = [_pairwise(local[:, (i << lv) - start : ((i + 1) << lv) - start]) for lv, i in nodes]
    return merge_node_sums(nodes, sums, vocab_size, tp_size, group, like=local, ranges=ranges)


def _node_ids(nodes: list[tuple[int, int]], width: int) -> torch.Tensor:
    ids = torch.full((width,), -1, dtype=torch.int64)
    for j, (level, index) in enumerate(nodes):
        ids[j] = (level << 48) | index
    return ids


def merge_node_sums(nodes: list[tuple[int, int]], sums: list[torch.Tensor], vocab_size: int, tp_size: int,
                    group: Any, *, like: torch.Tensor, ranges: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """The tree total ``[B]`` from this rank's node sums (``nodes`` = :func:`aligned_nodes` of its
    range, ``sums`` their ``[B]`` pairwise sums) and every other rank's: one all_gather (two
    without ``ranges``, every rank's ``[start, end)``: then the node ids are exchanged too), then
    the bottom-up merge. ``like``: a ``[B, *]`` tensor giving the rows, dtype and device. A caller
    that streams its columns (:mod:`trtvocab.sampling.chunked`) builds the same node sums chunk by chunk."""
    rows = like.shape[0]
    local = like
    width = 2 * max(1, vocab_size.bit_length()) + 2  # bound on the node count of any range
    ids = _node_ids(nodes, width)
    vals = torch.zeros(rows, width, dtype=local.dtype, device=local.device)
    for j, total in enumerate(sums):
        vals[:, j] = total
    if tp_size > 1:
        all_vals = [torch.empty_like(vals) for _ in range(tp_size)]
        if ranges is None:
            all_ids = [torch.empty_like(ids) for _ in range(tp_size)]
            dist.all_gather(all_ids, ids, group=group)
        else:
            all_ids = [_node_ids(aligned_nodes(a, b), width) for a, b in ranges]
        dist.all_gather(all_vals, vals, group=group)
        ids, vals = torch.cat(all_ids), torch.cat(all_vals, dim=1)
    level_of: dict[tuple[int, int], torch.Tensor] = {}
    for j, key in enumerate(ids.tolist()):
        if key >= 0:
            level_of[(key >> 48, key & ((1 << 48) - 1))] = vals[:, j]
    top = max(1, (vocab_size - 1).bit_length())
    for level in range(top):
        for (lv, i) in sorted(k for k in level_of if k[0] == level):
            if (lv, i) not in level_of:
                continue  # already merged as the right sibling
            left, right = (i, i + 1) if i % 2 == 0 else (i - 1, i)
            if (level, left) in level_of and (level, right) not in level_of and right * 2**level >= vocab_size:
                level_of[(level, right)] = torch.zeros_like(level_of[(level, left)])  # beyond the vocab: 0
            if (level, left) in level_of and (level, right) in level_of:
                level_of[(level + 1, left // 2)] = level_of.pop((level, left)) + level_of.pop((level, right))
    return level_of[(top, 0)] if (top, 0) in level_of else next(iter(level_of.values()))
