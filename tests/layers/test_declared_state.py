"""The state a head keeps is declared: constructor arguments and attributes, no ``__dict__`` entries."""

from __future__ import annotations

import torch

from trtvocab.lm_head import LMHead
from trtvocab.parallel import distributed as D


def test_switches_are_constructor_arguments_and_attributes() -> None:
    head = LMHead(10, 4, dtype=torch.float32)
    assert head.check_finite is True and head.handshake_every_call is False and head.quant_decision is None
    other = LMHead(10, 4, dtype=torch.float32, check_finite=False, handshake_every_call=True)
    assert other.check_finite is False and other.handshake_every_call is True
    head.handshake_every_call = True  # the attribute stays settable
    assert D.agreement_of(head, "LMHead.forward") is None


def test_agreements_live_in_the_declared_handshake_state() -> None:
    head = LMHead(10, 4, dtype=torch.float32)
    assert isinstance(head.handshake_state, D.HandshakeState)
    first = D.agreement_of(head, "sampling.top_k")
    assert first is D.agreement_of(head, "sampling.top_k") is head.handshake_state.agreements["sampling.top_k"]
    assert "_agreements" not in head.__dict__
    assert not hasattr(head.handshake_state, "pending")  # a call's verdict is a value it passes on, not state
