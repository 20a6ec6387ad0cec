"""A DeviceMesh whose ranks are not laid out row-major: plan.local_inputs, local_targets and data_shard cut
the batch by the coordinates the runtime uses (DeviceMesh.get_coordinate), not by the row-major guess."""
from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import DeviceMesh

import autopar
from autopar.testing import MLP, run_threaded, single_device_reference

# ranks 0 and 2 share dp coordinate 0: a row-major guess would put rank 2 at dp 1, tp 0
PERMUTED = [[0, 2], [1, 3]]
STEPS, LR = 3, 1e-2


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _train_on_permuted_mesh(rank, model, x, y, optimizer):
    mesh = DeviceMesh("cpu", torch.tensor(PERMUTED), mesh_dim_names=("dp", "tp"))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy="fsdp+tp")
    (local_x,), (local_y,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    opt = autopar.ShardedOptimizer(pm, optimizer, lr=LR)
    outputs = None
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        out = pm(local_x)
        _mse(out, local_y).backward()
        outputs = out.detach() if outputs is None else outputs
        opt.step()
    return {"coordinate": tuple(mesh.get_coordinate()), "data_shard": pm.plan.data_shard(),
            "outputs": outputs, "params": {k: v.clone() for k, v in pm.state_dict(full=True).items()}}


def test_permuted_mesh_cuts_the_batch_by_the_meshs_coordinates():
    torch.manual_seed(0)
    model, x, y = MLP([8, 16, 8]), torch.randn(8, 8), torch.randn(8, 8)
    for optimizer in (torch.optim.SGD, torch.optim.AdamW):
        ref = single_device_reference(lambda: copy.deepcopy(model), x, y, _mse, STEPS, LR, optimizer)
        results = run_threaded(4, _train_on_permuted_mesh, model, x, y, optimizer)
        for rank, r in enumerate(results):
            dp, _ = r["coordinate"]
            assert r["data_shard"] == (dp, 2), (rank, r["coordinate"], r["data_shard"])
            torch.testing.assert_close(r["outputs"], ref["outputs"].chunk(2)[dp], atol=1e-5, rtol=0)
            for name, p in ref["params"].items():
                torch.testing.assert_close(r["params"][name], p, atol=1e-5, rtol=0,
                                           msg=lambda m: f"{optimizer.__name__} rank {rank} {name}: {m}")


def test_explicit_rank_is_looked_up_on_the_modules_mesh():
    """rank= names a global rank; on a module's plan it is placed where the module's mesh puts it."""
    torch.manual_seed(0)
    model, x = MLP([8, 16, 8]), torch.randn(8, 8)
    plans = run_threaded(4, _plan_of_permuted_module, model, x)
    x_cut = x.chunk(2)
    for plan in plans:
        for rank in range(4):
            dp = 0 if rank in PERMUTED[0] else 1
            assert torch.equal(plan.local_inputs(x, rank=rank)[0], x_cut[dp]), rank


def _plan_of_permuted_module(rank, model, x):
    mesh = DeviceMesh("cpu", torch.tensor(PERMUTED), mesh_dim_names=("dp", "tp"))
    return autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy="fsdp+tp").plan


def _data_shard_on_submesh(rank, model, x):
    from torch.distributed.device_mesh import init_device_mesh
    dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"]   # ranks [0, 2] and [1, 3]
    pm = autopar.parallelize(copy.deepcopy(model), dp, (x,), strategy="ddp")
    return dp.get_local_rank(), pm.plan.data_shard(), pm.plan.local_inputs(x)[0]


def test_submesh_cuts_the_batch_by_the_submeshs_coordinates():
    torch.manual_seed(0)
    model, x = MLP([8, 16, 8]), torch.randn(8, 8)
    for rank, (coord, shard, local_x) in enumerate(run_threaded(4, _data_shard_on_submesh, model, x)):
        assert shard == (coord, 2), (rank, coord, shard)
        assert torch.equal(local_x, x.chunk(2)[coord]), rank
