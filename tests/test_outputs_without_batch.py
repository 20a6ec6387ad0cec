"""Outputs that do not carry the batch come back whole, with gradients as on one device.

A model may return, beside its per-sample predictions, values that are one for the whole batch: a
regularizer computed from the weights (a vector here, so that it has a dim 0 to be mis-split along) and
a statistic over the batch (a mean over dim 0, as a batch-norm-like auxiliary loss reads it). autopar
splits only the outputs that carry the batch (sharding/strategies.batch_outputs); a weight's function
comes back whole on every rank, a batch statistic is all-reduced or gathered, and neither's gradient is
scaled as a shard's. Under tp the regularizer is computed on the weight's shard (a tp axis may split
dim 0 of an op on weights alone: it is no batch). Each strategy trains 3 steps on 3 ranks (1/3 is
inexact in floating point) with SGD (a wrong gradient scale moves the weights by ~lr x gradient) and
with AdamW, against one device.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autopar
from autopar.testing import run_threaded

WORLD, STEPS = 3, 3
OPTIMIZERS = {"sgd": (torch.optim.SGD, 0.5, 1e-5), "adamw": (torch.optim.AdamW, 1e-3, 1e-5)}


class WithAux(nn.Module):
    def __init__(self, batch_statistic: bool):
        super().__init__()
        self.a, self.b = nn.Linear(8, 12), nn.Linear(12, 6)
        self.batch_statistic = batch_statistic

    def forward(self, x):
        h = torch.relu(self.a(x))
        # (batch, 6) predictions; (12,) from the weights alone; (12,) over the whole batch
        out = self.b(h), (self.a.weight ** 2).sum(1)
        return out + (h.mean(0),) if self.batch_statistic else out


def loss_of(out, y):
    pred, reg = out[:2]
    return ((pred - y) ** 2).mean() + 0.1 * reg.sum() + sum((stat ** 2).sum() for stat in out[2:])


def _train(model, x, y, opt):
    outs = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss_of(out, y).backward()
        opt.step()
        outs.append([o.detach().clone() for o in out])
    return outs


def test_a_batch_statistic_under_a_strategy_that_cannot_gather_the_batch_is_named():
    """ddp never gathers activations, and a mean over a split batch has no rule: the error says which output."""
    torch.manual_seed(0)
    with pytest.raises(autopar.ShardingError, match=r"computed from the batch but is not split by it \(mean \(12,\)"):
        autopar.plan(WithAux(batch_statistic=True), (torch.randn(6, 8),), {"dp": 3}, strategy="ddp")


def _rank(rank, model, x, y, strategy, optimizer):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy=strategy)
    cls, lr, _ = OPTIMIZERS[optimizer]
    (xi,), (yi,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    outs = _train(pm, xi, yi, autopar.ShardedOptimizer(pm, cls, lr=lr))
    return {"first": outs[0], "params": pm.state_dict(full=True), "batch_axes": pm.plan.batch_axes}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp", "tp", "auto"])
def test_outputs_that_do_not_carry_the_batch_come_back_whole(strategy, optimizer):
    torch.manual_seed(0)
    model, x, y = WithAux(batch_statistic=strategy in ("tp", "auto")), torch.randn(6, 8), torch.randn(6, 6)
    ref = copy.deepcopy(model)
    cls, lr, atol = OPTIMIZERS[optimizer]
    want = _train(ref, x, y, cls(ref.parameters(), lr=lr))[0]
    for rank, r in enumerate(run_threaded(WORLD, _rank, model, x, y, strategy, optimizer)):
        shard = want[0].chunk(WORLD)[rank] if r["batch_axes"] else want[0]
        torch.testing.assert_close(r["first"][0], shard, atol=atol, rtol=0)
        for got, whole in zip(r["first"][1:], want[1:]):   # whole: (12,), not a third of it
            torch.testing.assert_close(got, whole, atol=atol, rtol=0)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(r["params"][n], p.detach(), atol=atol, rtol=0, msg=lambda m: f"{n}: {m}")
