"""Per-rank functions for tests/quant/test_quant_head.py.

``run_ranks`` starts ranks with spawn: a function must live at module level in a module the
child can import. ``tests`` is a package and conftest puts the repository root on ``sys.path``,
which spawn hands to every child, so ``tests.quant.quant_rank_fns`` imports in both.
"""

from __future__ import annotations

import torch

from trtvocab import LMHead, Mapping


def quantized_tp_logits(
    rank: int, world: int, cases: list[tuple[str, bool, str]], x: torch.Tensor
) -> list[tuple[torch.Tensor, int, str]]:
    """Each case ``(checkpoint dir, weight_only, vocab layout)`` -> (gathered logits, resident bytes, label)."""
    mapping = Mapping(world_size=world, rank=rank, tp_size=world)
    out = []
    for path, weight_only, layout in cases:
        head = LMHead.from_checkpoint(path, mapping=mapping, weight_only=weight_only, vocab_layout=layout, pad_to=8)
        label = head.quant_decision.config.label if head.quant_decision.config else "dense"
        out.append((head(x), head.resident_bytes(), label))
    return out
