"""Liveness: a tensor lives from the op that makes it to the last op that reads it; views share storage."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.capture.export import capture
from autopar.cost.liveness import backward_start, live_sets, storage_owner
from autopar.cost.terms import needs_grad
from autopar.testing import MLP

ROOT = Path(__file__).resolve().parents[1]


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
    else is alive at any forward op is at most the second linear's output, which lives to the end:
    32 x 64 x 4 = 8 KiB (every op's output summed would be 72 KiB). Backward starts with more: the
    output's gradient (8 KiB) and what the second linear's backward makes, the gradients of gelu's
    output (32 x 256 x 4 = 32 KiB), of its weight (64 x 256 x 4 = 64 KiB) and of its bias (256 B)."""
    torch.manual_seed(0)
    model, x = MLP([64, 256, 64]), torch.randn(32, 64)
    plan = autopar.plan(model, (x,), {"dp": 1}, strategy="ddp", hardware="cpu")
    assert plan.predicted.memory.activations == 2 * 32 * 256 * 4 + 32 * 64 * 4
    assert plan.predicted.memory.transient == 32 * 64 * 4 + 32 * 256 * 4 + 64 * 256 * 4 + 64 * 4


def test_backward_start_names_the_outputs_gradients_and_the_head_ops_inputs():
    cap = capture(MLP([4, 8, 4]), (torch.randn(2, 4),))
    start = backward_start(cap, needs_grad(cap))
    assert start.output == "output" and start.graded == (0,)
    # linear_1(gelu, weight, bias): all three get a gradient (x, the first linear's input, would not)
    assert start.heads == (("linear_1", (0, 1, 2)),)


def _env() -> dict:
    """This checkout's autopar, whatever the environment has installed; one thread per rank."""
    path = [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))


@pytest.mark.gloo
def test_train_step_peak_is_within_the_prediction_where_the_heads_backward_peaks():
    """Measured (benchmarks/peak_memory.py, 2 gloo ranks, ddp): a GPT whose head weight (1024 x 256,
    1 MiB) outweighs its logits (64 tokens a rank x 1024, 256 KiB), so a train step peaks in the head's
    backward, with the logits' gradient and the head weight's whole gradient (before its bucket takes
    it) beside every saved activation. Without backward_start in the transient the prediction is 0.81
    MiB under the measured peak of step 2."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peak_memory.py"), "--strategy", "ddp",
                           "--world", "2", "--n-layer", "4", "--n-embd", "256", "--n-head", "4",
                           "--vocab-size", "1024", "--block-size", "32", "--batch", "4", "--steps", "2"],
                          capture_output=True, text=True, timeout=600,
                          env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for step in (1, 2):
        assert re.search(rf"^train step {step} .* yes$", proc.stdout, re.M), proc.stdout
