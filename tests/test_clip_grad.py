"""autopar.clip_grad_norm_ clips like torch.nn.utils.clip_grad_norm_ on one device, under every plan.

Each case: one backward of a small GPT, clip, one SGD step (SGD shows a wrong gradient scale; Adam
hides it). The returned norm must equal torch's on the single-device copy (rtol 1e-5), on every
rank, and the parameters after the step must equal one device's (atol 1e-5). max_norm is a
quarter of the norm, so clipping happens (one case sets it above the norm: the clamp to 1).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import autopar
from autopar.testing import GPT, GPTConfig, gpt_loss, run_gloo, run_threaded

LR = 0.5
ATOL = 1e-5


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 32, (12, 8), generator=g), torch.randint(0, 32, (12, 8), generator=g)


def _reference(norm_type, fraction):
    """One device: the unclipped norm, max_norm = fraction of it, torch's returned norm, params after SGD."""
    model, (x, y) = _gpt(), _batch()
    gpt_loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    max_norm = fraction * torch.linalg.vector_norm(torch.stack([g.norm(norm_type) for g in grads]), norm_type).item()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return max_norm, norm, {n: p.detach().clone() for n, p in model.named_parameters()}


def _clip_and_step(rank, model, mesh_shape, names, plan_kwargs, max_norm, norm_type):
    from torch.distributed.device_mesh import init_device_mesh
    x, y = _batch()
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), hardware="cpu", **plan_kwargs)
    opt = autopar.ShardedOptimizer(pm, torch.optim.SGD, lr=LR)
    (local_y,) = pm.plan.local_targets(y)
    pm.train_step(*pm.plan.local_inputs(x), loss_fn=gpt_loss, targets=local_y)
    norm = autopar.clip_grad_norm_(pm, max_norm, norm_type, optimizer=opt)
    opt.step()
    return norm, pm.state_dict(full=True), dict(pm.plan.param_zero), pm.plan.pipeline is not None


CASES = {   # name: (mesh shape, axis names, plan kwargs, norm_type, max_norm / norm)
    "ddp": ((2,), ("dp",), {"strategy": "ddp"}, 2.0, 0.25),
    "zero1": ((2,), ("dp",), {"strategy": "zero1"}, 2.0, 0.25),
    "zero2": ((2,), ("dp",), {"strategy": "zero2"}, 2.0, 0.25),
    "fsdp": ((2,), ("dp",), {"strategy": "fsdp"}, 2.0, 0.25),
    "tp": ((2,), ("tp",), {"strategy": "tp"}, 2.0, 0.25),
    "tp+sp": ((2,), ("tp",), {"strategy": "tp+sp"}, 2.0, 0.25),
    "fsdp+tp 2x2": ((2, 2), ("dp", "tp"), {"strategy": "fsdp+tp"}, 2.0, 0.25),
    "fsdp on 3 (uneven)": ((3,), ("dp",), {"strategy": "fsdp"}, 2.0, 0.25),
    "zero2 2x2": ((2, 2), ("a", "b"), {"strategy": "zero2"}, 2.0, 0.25),
    "zero1, inf-norm": ((2,), ("dp",), {"strategy": "zero1"}, math.inf, 0.25),
    "fsdp+tp 2x2, inf-norm": ((2, 2), ("dp", "tp"), {"strategy": "fsdp+tp"}, math.inf, 0.25),
    "fsdp, max_norm above the norm": ((2,), ("dp",), {"strategy": "fsdp"}, 2.0, 2.0),
    # 4 gloo processes (torch's pipelining cannot send on the threaded group): the slowest case by far
    "pipeline dp2 x pp2 (ddp)": ((2, 2), ("dp", "pp"), {"pipeline_axis": "pp", "microbatches": 2, "strategy": "ddp"},
                                 2.0, 0.25),
}


@pytest.mark.parametrize("case", list(CASES))
def test_clip_grad_norm_matches_one_device(case):
    mesh_shape, names, plan_kwargs, norm_type, fraction = CASES[case]
    max_norm, ref_norm, ref_params = _reference(norm_type, fraction)
    assert (ref_norm > max_norm) == (fraction < 1)
    world = math.prod(mesh_shape)
    run = run_gloo if "pipeline_axis" in plan_kwargs else run_threaded   # pipelining sends: not on threads
    results = run(world, _clip_and_step, _gpt(), mesh_shape, names, plan_kwargs, max_norm, norm_type)
    held = set()
    for norm, params, zero, pipelined in results:
        assert norm.dtype == torch.float32 and norm.dim() == 0
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        assert bool(zero) == plan_kwargs.get("strategy", "").startswith("zero")
        assert pipelined == ("pipeline_axis" in plan_kwargs)
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
        held |= set(params)
    assert held == set(ref_params)


def _without_optimizer(rank, model):
    from torch.distributed.device_mesh import init_device_mesh
    x, y = _batch()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), hardware="cpu", strategy="zero2")
    autopar.ShardedOptimizer(pm, torch.optim.SGD, lr=LR)
    gpt_loss(pm(*pm.plan.local_inputs(x)), *pm.plan.local_targets(y)).backward()
    with pytest.raises(autopar.PlanError, match="optimizer="):
        autopar.clip_grad_norm_(pm, 1.0)
    return True


def test_a_zero_plan_needs_the_optimizer():
    assert all(run_threaded(2, _without_optimizer, _gpt()))
