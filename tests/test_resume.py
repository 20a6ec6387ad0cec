"""Resume anywhere: 2 steps under plan A, a DCP checkpoint of model + optimizer (autopar.checkpoint.save),
loaded under plan B (another layout, a pipeline, another world size), 2 more steps: the 4 losses and the final
parameters equal 4 single-device steps (fp32; 1e-5 with SGD-momentum, 1e-3 with AdamW, whose state the
checkpoint must carry exactly or its next steps go astray).

gloo processes (run_gloo): DCP writes one file per rank, and each launch is one world. The optimizer state
moves between ZeRO slices, FSDP shards and TP splits, which exercises every conversion the
ShardedOptimizer's state_dict makes (optim_state.py).
"""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.testing import GPT, GPTConfig, gpt_loss, run_gloo, run_threaded

OPTIMIZERS = {"sgd-momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9), 1e-5),
              "adamw": (torch.optim.AdamW, dict(lr=1e-3), 1e-3)}
# (name, (mesh shape, axis names, strategy) before, after): on 4 ranks
PAIRS = {"fsdp -> fsdp2 x tp2": (((4,), ("dp",), "fsdp"), ((2, 2), ("dp", "tp"), "fsdp+tp")),
         "zero2 -> tp4": (((4,), ("dp",), "zero2"), ((2, 2), ("a", "b"), "tp")),
         "fsdp2 x tp2 -> pp2 x dp2": (((2, 2), ("dp", "tp"), "fsdp+tp"), ((2, 2), ("pp", "dp"), "ddp")),
         "pp2 x dp2 -> fsdp": (((2, 2), ("pp", "dp"), "ddp"), ((4,), ("dp",), "fsdp"))}


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)


def _one_device(optimizer: str) -> dict:
    model = _model()
    cls, kwargs, _ = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **kwargs)
    x, y = _batch()
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = gpt_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def _steps(pm, opt, n: int) -> list:
    """n steps; the global loss of each (the mean of the ranks' local means: every batch shard is held by
    as many ranks as every other)."""
    import torch.distributed as dist
    x, y = _batch()
    (xl,), (yl,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    out = []
    for _ in range(n):
        opt.zero_grad()
        if pm.plan.pipeline is not None:   # forward + backward over the microbatches; this rank's mean loss
            loss = pm.train_step(xl, loss_fn=gpt_loss, targets=yl)
        else:
            loss = gpt_loss(pm(xl), yl)
            loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        out.append(t.item() / dist.get_world_size())
    return out


def _run(mesh_def, optimizer: str):
    from torch.distributed.device_mesh import init_device_mesh
    shape, names, strategy = mesh_def
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    x, _ = _batch()
    pipeline = {"pipeline_axis": "pp", "microbatches": 2} if "pp" in names else {}
    pm = autopar.parallelize(_model(), mesh, (x,), strategy=strategy, hardware="cpu", **pipeline)
    cls, kwargs, _ = OPTIMIZERS[optimizer]
    return pm, autopar.ShardedOptimizer(pm, cls, **kwargs)


def _full_params(pm) -> dict:
    """Every parameter whole on every rank (a pipelined module's stages are gathered from their ranks)."""
    import torch.distributed as dist
    mine = pm.state_dict(full=True)
    if pm.plan.pipeline is None:
        return mine
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for d in everyone for k, v in d.items()}


def _save_then_resume(rank, root, pairs, optimizers):
    out = {}
    for (name, (before, after)), optimizer in ((pair, o) for o in optimizers for pair in pairs.items()):
        path = f"{root}/{name.replace(' ', '_')}-{optimizer}"
        pm, opt = _run(before, optimizer)
        losses = _steps(pm, opt, 2)
        autopar.checkpoint.save(path, pm, opt, step=2)
        pm, opt = _run(after, optimizer)
        step = autopar.checkpoint.load(path, pm, opt)
        losses += _steps(pm, opt, 2)
        out[(name, optimizer)] = {"losses": losses, "step": step, "params": _full_params(pm)}
    return out


def _save(rank, path, before, optimizer):
    pm, opt = _run(before, optimizer)
    losses = _steps(pm, opt, 2)
    autopar.checkpoint.save(path, pm, opt, step=2)
    return losses


def _resume(rank, path, after, optimizer):
    pm, opt = _run(after, optimizer)
    step = autopar.checkpoint.load(path, pm, opt)
    return {"losses": _steps(pm, opt, 2), "step": step, "params": _full_params(pm)}


def _check(got: dict, want: dict, atol: float, where: str):
    assert got["step"] == 2, where
    assert got["losses"] == pytest.approx(want["losses"], abs=atol), where
    for k, v in want["params"].items():
        torch.testing.assert_close(got["params"][k], v, atol=atol, rtol=0, msg=lambda m: f"{where}, {k}: {m}")


def test_resume_under_another_plan_equals_one_device(tmp_path):
    want = {o: _one_device(o) for o in OPTIMIZERS}   # one launch of 4 processes for every pair and optimizer
    for rank, res in enumerate(run_gloo(4, _save_then_resume, str(tmp_path), PAIRS, list(OPTIMIZERS), timeout=600)):
        assert len(res) == len(PAIRS) * len(OPTIMIZERS)
        for (name, optimizer), got in res.items():
            _check(got, want[optimizer], OPTIMIZERS[optimizer][2], f"{name} with {optimizer}, rank {rank}")


def test_resume_on_fewer_ranks_equals_one_device(tmp_path):
    """Saved by 4 ranks under fsdp+tp, loaded by 2 under tp: DCP reshards what each rank reads."""
    optimizer, path = "adamw", str(tmp_path / "four")
    want = _one_device(optimizer)
    first = run_gloo(4, _save, path, ((2, 2), ("dp", "tp"), "fsdp+tp"), optimizer)
    second = run_gloo(2, _resume, path, ((2,), ("tp",), "tp"), optimizer)
    for rank, got in enumerate(second):
        _check({**got, "losses": first[0] + got["losses"]}, want, OPTIMIZERS[optimizer][2], f"4 -> 2 ranks, rank {rank}")


def test_checkpoint_refuses_a_plain_optimizer(tmp_path):
    model = _model()
    with pytest.raises(autopar.PlanError, match="takes an autopar.ShardedOptimizer"):
        autopar.checkpoint.run.run_state(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.1), None)


def _state_dict_mid_step(rank):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    x, y = _batch()
    pm = autopar.parallelize(_model(), mesh, (x,), strategy="ddp", hardware="cpu")
    opt = autopar.ShardedOptimizer(pm, torch.optim.SGD, lr=0.1)   # keeps no state at all
    (xl,), (yl,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    gpt_loss(pm(xl), yl).backward()
    before = {n: p.grad.clone() for n, p in pm.named_parameters()}
    sd = opt.state_dict()   # between backward and step: must leave the gradients alone
    return all(torch.equal(p.grad, before[n]) for n, p in pm.named_parameters()), sd["state"], sd["param_groups"]


def test_state_dict_between_backward_and_step_keeps_the_gradients():
    for same, state, groups in run_threaded(2, _state_dict_mid_step):
        assert same and state == {}
        assert groups[0]["lr"] == 0.1 and "wte.weight" in groups[0]["params"]
