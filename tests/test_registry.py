"""How a public op reaches its body: directly for plain tensors, through torch's dispatcher otherwise."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from sparsekv.ops import qsa as qsa_ops
from sparsekv.ops._registry import _dispatch_needed


def test_plain_tensors_skip_the_dispatcher_and_everything_else_takes_it():
    plain = torch.zeros(3)
    assert not _dispatch_needed((plain, 4, 2.0, None))
    assert _dispatch_needed((plain, torch.zeros(3, requires_grad=True)))
    assert _dispatch_needed((plain, torch.empty(3, device="meta")))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(plain)
        assert _dispatch_needed((fake,))


def test_entry_and_registered_op_write_the_same_scores():
    gen = torch.Generator().manual_seed(3)
    q, keys = torch.randn(2, 3, 16, generator=gen), torch.randn(2 * 5, 16, generator=gen)
    positions, offsets = torch.tensor([9, 19], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    direct, dispatched = torch.empty(2, 5), torch.empty(2, 5)
    qsa_ops._block_score_op(direct, q, keys, positions, offsets, 4, 2.0)
    assert qsa_ops._block_score_op.custom_op is not None
    torch.ops.sparsekv.qsa_block_score(dispatched, q, keys, positions, offsets, 4, 2.0)
    assert torch.equal(direct, dispatched) and torch.isfinite(direct[:, :2]).all()
