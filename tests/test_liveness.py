"""Liveness: a tensor lives from the op that makes it to the last op that reads it; views share storage."""
from __future__ import annotations

import torch

import autopar
from autopar.capture.export import capture
from autopar.cost.liveness import live_sets, storage_owner
from autopar.testing import MLP


class ViewChain(torch.nn.Module):
    def forward(self, x):
        y = x.exp()             # storage 1, read by the view and (through it) by the sum
        z = y.view(-1)          # a view: keeps y alive, is not a tensor of its own
        w = z.sin()             # storage 2
        return w + y.sum()      # y read last here


def test_tensors_live_from_producer_to_last_reader():
    torch.manual_seed(0)
    cap = capture(MLP([4, 8, 4]), (torch.randn(2, 4),))
    assert live_sets(cap) == [("linear", ("linear",)), ("gelu", ("linear", "gelu")),
                              ("linear_1", ("gelu", "linear_1"))]   # the output lives to the end


def test_a_view_keeps_its_base_alive_instead_of_counting_twice():
    cap = capture(ViewChain(), (torch.randn(3, 4),))
    owner = storage_owner(cap)
    view = next(n.name for n in cap.graph.nodes if n.op == "call_function" and "view" in str(n.target))
    exp = next(n.name for n in cap.graph.nodes if n.op == "call_function" and "exp" in str(n.target))
    assert owner[view] == exp
    sets = dict(live_sets(cap))
    assert all(view not in alive for alive in sets.values())
    sum_op = next(n.name for n in cap.graph.nodes if n.op == "call_function" and "sum" in str(n.target))
    assert exp in sets[sum_op]   # read through the view and directly, until the sum


def test_transient_is_the_largest_working_set_not_the_sum():
    """MLP 64 -> 256 -> 64 on one device, batch 32, fp32. The first linear's output (gelu keeps it)
    and gelu's output (the second linear keeps it) are activations, 2 x 32 x 256 x 4 = 64 KiB, and
    so is the input x the first linear keeps for its weight's gradient, 32 x 64 x 4 = 8 KiB; what
    else is alive at any op is at most the second linear's output, which lives to the end:
    32 x 64 x 4 = 8 KiB. (Every op's output summed would be 72 KiB.)"""
    torch.manual_seed(0)
    model, x = MLP([64, 256, 64]), torch.randn(32, 64)
    plan = autopar.plan(model, (x,), {"dp": 1}, strategy="ddp", hardware="cpu")
    assert plan.predicted.memory.activations == 2 * 32 * 256 * 4 + 32 * 64 * 4
    assert plan.predicted.memory.transient == 32 * 64 * 4
