"""ZeRO-1/2 (and 3 = fsdp): each shards exactly the parts it promises, and trains like one device.

ZeRO-1 splits the optimizer state over the data-parallel ranks, ZeRO-2 the
gradients too, ZeRO-3 (strategy "fsdp") the weights as well. The plan's
predicted bytes are checked against the bytes allocated on every rank
(autopar.audit with an autopar.ShardedOptimizer), and 3 AdamW steps against
the single-device run.
"""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

import autopar
from autopar.testing import GPT, MLP, GPTConfig, gpt_loss, parallel_record, run_threaded, single_device_reference

ATOL = 1e-5


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _mlp():
    torch.manual_seed(0)
    return MLP([16, 32, 16]), torch.randn(8, 16), torch.randn(8, 16), _mse


def _gpt():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8)
    x = torch.randint(0, cfg.vocab_size, (4, 8))
    return GPT(cfg), x, torch.randint(0, cfg.vocab_size, (4, 8)), gpt_loss


def _numel(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("make", [_mlp, _gpt], ids=["mlp", "gpt"])
def test_zero_levels_shard_what_they_promise(make):
    """Per device, fp32 AdamW (4 bytes weight, 4 gradient, 8 state per element), n = 4 ranks:
    ddp 4+4+8; zero1 4+4+8/n; zero2 4+(4+8)/n; zero3 (fsdp) (4+4+8)/n -- for every parameter
    whose flat size divides by n (all of them here)."""
    model, x, _, _ = make()
    n, numel = 4, _numel(model)
    expect = {"ddp": (4, 4, 8), "zero1": (4, 4, 8 / n), "zero2": (4, 4 / n, 8 / n), "fsdp": (4 / n, 4 / n, 8 / n)}
    for strategy, (w, g, o) in expect.items():
        m = autopar.plan(model, (x,), {"dp": n}, strategy=strategy, hardware="cpu").predicted.memory
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        assert (m.params - buffers, m.grads, m.optimizer) == (w * numel, g * numel, o * numel), strategy


def _audit(rank, model, x, mesh_shape, names, strategy):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy=strategy, record_comm=True)
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=1e-3)
    return autopar.audit(pm, *pm.plan.local_inputs(x), optimizer=opt), pm.plan


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
@pytest.mark.parametrize("make", [_mlp, _gpt], ids=["mlp", "gpt"])
def test_zero_allocates_and_moves_what_the_plan_predicts(make, strategy):
    model, x, _, _ = make()
    for report, plan in run_threaded(2, _audit, model, x, (2,), ("dp",), strategy):
        assert plan.param_zero and all(lvl == int(strategy[-1]) for lvl, _ in plan.param_zero.values())
        for quantity in ("comm bytes on dp", "parameters", "gradients", "optimizer state"):
            row = report.row(quantity)
            assert row.measured == pytest.approx(row.predicted, rel=1e-12), (quantity, str(report))


@pytest.mark.parametrize("strategy, mesh_shape", [("zero1", (2,)), ("zero2", (2,)), ("zero2", (2, 2))])
@pytest.mark.parametrize("make", [_mlp, _gpt], ids=["mlp", "gpt"])
def test_zero_trains_like_one_device(make, strategy, mesh_shape):
    model, x, y, loss_fn = make()
    ref = single_device_reference(lambda: copy.deepcopy(model), x, y, loss_fn, steps=3, lr=1e-4)
    names = ("a", "b")[:len(mesh_shape)]
    world = 1
    for s in mesh_shape:
        world *= s
    for rec in run_threaded(world, parallel_record, model, mesh_shape, names, x, y, loss_fn, 3, 1e-4,
                            {"strategy": strategy, "hardware": "cpu"}):
        assert rec["plan"].param_zero
        for name, g in ref["grads"].items():
            torch.testing.assert_close(rec["grads"][name], g, atol=ATOL, rtol=0, msg=name)
        for name, p in ref["params"].items():
            torch.testing.assert_close(rec["params"][name], p, atol=ATOL, rtol=0, msg=name)
        plan = rec["plan"]
        launched = Counter((k, axis, float(b), phase) for k, axis, b, phase in rec["comm"])
        predicted = Counter((c.kind, plan.mesh.axis_names.index(c.axis), c.bytes, c.phase) for c in plan.collectives)
        assert launched == predicted
        # no parameter gradient is all-reduced: each is reduce-scattered, then the weight all-gathered
        params = {c.tensor for c in plan.collectives if c.tensor.startswith("p_")}
        assert not [c for c in plan.collectives if c.kind == "all_reduce" and c.tensor in params]
        assert {(c.kind, c.phase) for c in plan.collectives if c.tensor in params} == {
            ("reduce_scatter", "backward" if strategy == "zero2" else "optimizer"), ("all_gather", "optimizer")}


def _plain_optimizer_backward(rank, model, x):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy="zero1")
    torch.optim.AdamW(pm.parameters())   # not the wrapper: ZeRO gradients would stay unreduced
    try:
        pm(*pm.plan.local_inputs(x)).sum().backward()
    except autopar.PlanError as e:
        return str(e)
    return None


def test_a_zero_plan_without_the_wrapper_fails_loudly():
    model, x, _, _ = _mlp()
    for message in run_threaded(2, _plain_optimizer_backward, model, x):
        assert message is not None and "ShardedOptimizer" in message


def test_zero_over_several_axes_only_where_every_rank_divides():
    """Beside an uneven split on another axis, ranks hold flat tensors of different lengths: ZeRO over two
    axes would cut them unlike the plan's slices, so only one-axis ZeRO (padded) is offered there."""
    from autopar.capture.export import TensorMeta
    from autopar.mesh import MeshSpec
    from autopar.sharding.strategies import zero_variants
    mesh = MeshSpec(("a", "b", "c"), (2, 2, 2))
    meta = TensorMeta((3, 2), (3, 2), torch.float32)   # rows 2 + 1 over axis a: flat 4 and 2 elements
    axes = {s.zero_axes for s in zero_variants(("S(0)", "R", "R"), meta, mesh)}
    assert axes == {(1,), (2,)}
    even = TensorMeta((4, 2), (4, 2), torch.float32)
    assert (1, 2) in {s.zero_axes for s in zero_variants(("S(0)", "R", "R"), even, mesh)}


def _gpt_for_three():
    """Every weight's flat size divides by 3, so every one is ZeRO-2's on 3 ranks."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=24, vocab_size=48, block_size=6)
    x = torch.randint(0, cfg.vocab_size, (6, 6))
    return GPT(cfg), x, torch.randint(0, cfg.vocab_size, (6, 6)), gpt_loss


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW], ids=["sgd", "adamw"])
def test_zero2_reduce_scatters_buckets_while_backward_computes(optimizer):
    """ZeRO-2 on 3 ranks with 4 KiB buckets: the gradients go out in a few bucketed reduce-scatters, the
    first before backward reaches the position embedding (whose partial gradient the graph all-reduces
    there, at backward's end), and training equals one device with SGD (which a wrong scale would show)
    and AdamW. One reduce-scatter per weight, or every bucket launched when backward ends, fails it."""
    model, x, y, loss_fn = _gpt_for_three()
    ref = single_device_reference(lambda: copy.deepcopy(model), x, y, loss_fn, steps=3, lr=1e-2, optimizer=optimizer)
    for rec in run_threaded(3, parallel_record, model, (3,), ("dp",), x, y, loss_fn, 3, 1e-2,
                            {"strategy": "zero2", "hardware": "cpu", "bucket_bytes": 4096}, optimizer):
        plan = rec["plan"]
        assert len(plan.param_zero) == _numel_params(model)
        buckets = [c for c in plan.collectives if c.kind == "reduce_scatter"]
        assert 3 <= len(buckets) < len(plan.param_zero) and all("ZeRO-2" in c.where for c in buckets)
        # after the step the updated slices come back a bucket at a time, not a weight at a time
        gathers = [c for c in plan.collectives if c.kind == "all_gather"]
        assert len(gathers) == len(buckets) and all("ZeRO-2 weight bucket" in c.where for c in gathers)
        launched = Counter((k, axis, float(b), phase) for k, axis, b, phase in rec["comm"])
        predicted = Counter((c.kind, plan.mesh.axis_names.index(c.axis), c.bytes, c.phase) for c in plan.collectives)
        assert launched == predicted
        kinds = [k for k, _, _, phase in rec["comm"] if phase == "backward"]
        assert kinds.index("reduce_scatter") < kinds.index("all_reduce")
        for name, p in ref["params"].items():
            torch.testing.assert_close(rec["params"][name], p, atol=ATOL, rtol=0, msg=name)


def _numel_params(model):
    return len(dict(model.named_parameters()))


def test_zero1_reduce_scatters_buckets_at_the_optimizer_step():
    """ZeRO-1 on 3 ranks with 4 KiB buckets: the whole gradients are reduce-scattered at step() in a few
    buckets, the updated slices all-gathered in the same buckets, as the plan lists them, and training
    equals one device (SGD)."""
    model, x, y, loss_fn = _gpt_for_three()
    ref = single_device_reference(lambda: copy.deepcopy(model), x, y, loss_fn, steps=3, lr=1e-2,
                                  optimizer=torch.optim.SGD)
    for rec in run_threaded(3, parallel_record, model, (3,), ("dp",), x, y, loss_fn, 3, 1e-2,
                            {"strategy": "zero1", "hardware": "cpu", "bucket_bytes": 4096}, torch.optim.SGD):
        plan = rec["plan"]
        buckets = [c for c in plan.collectives if c.kind == "reduce_scatter"]
        assert 3 <= len(buckets) < len(plan.param_zero)
        assert all(c.phase == "optimizer" and "ZeRO-1" in c.where for c in buckets)
        gathers = [c for c in plan.collectives if c.kind == "all_gather"]
        assert len(gathers) == len(buckets) and all("ZeRO-1 weight bucket" in c.where for c in gathers)
        launched = Counter((k, axis, float(b), phase) for k, axis, b, phase in rec["comm"])
        predicted = Counter((c.kind, plan.mesh.axis_names.index(c.axis), c.bytes, c.phase) for c in plan.collectives)
        assert launched == predicted
        for name, p in ref["params"].items():
            torch.testing.assert_close(rec["params"][name], p, atol=ATOL, rtol=0, msg=name)


def test_zero2_weights_padded_on_their_axis_reduce_alone_beside_the_buckets():
    """n_embd 16 on 3 ranks: the norms' and biases' 16 elements split 6 + 6 + 4 (padded), so they cannot be
    a bucket's equal rows; they reduce and gather alone, the others in buckets, and training equals one
    device."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=48, block_size=6)
    model, x, y = GPT(cfg), torch.randint(0, 48, (6, 6)), torch.randint(0, 48, (6, 6))
    ref = single_device_reference(lambda: copy.deepcopy(model), x, y, gpt_loss, steps=3, lr=1e-2,
                                  optimizer=torch.optim.SGD)
    for rec in run_threaded(3, parallel_record, model, (3,), ("dp",), x, y, gpt_loss, 3, 1e-2,
                            {"strategy": "zero2", "hardware": "cpu"}, torch.optim.SGD):
        plan = rec["plan"]
        scatters = [c for c in plan.collectives if c.kind == "reduce_scatter"]
        assert any("ZeRO-2" in c.where for c in scatters) and any("ZeRO-2" not in c.where for c in scatters)
        gathers = [c for c in plan.collectives if c.kind == "all_gather"]
        assert any("weight bucket" in c.where for c in gathers) and any("bucket" not in c.where for c in gathers)
        launched = Counter((k, axis, float(b), phase) for k, axis, b, phase in rec["comm"])
        predicted = Counter((c.kind, plan.mesh.axis_names.index(c.axis), c.bytes, c.phase) for c in plan.collectives)
        assert launched == predicted
        for name, p in ref["params"].items():
            torch.testing.assert_close(rec["params"][name], p, atol=ATOL, rtol=0, msg=name)


# SGD with dampening: a momentum buffer made before the first step (even of zeros) changes that step
_FIRST_STEP_SENSITIVE = {"AdamW": (torch.optim.AdamW, {"lr": 1e-3}),
                         "SGD": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.5})}


def _train_after_an_early_state_dict(rank, model, x, y, strategy, optimizer, kwargs):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy=strategy)
    (local_x,), (local_y,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    opt = autopar.ShardedOptimizer(pm, optimizer, **kwargs)
    early = opt.state_dict()   # before any step: a checkpoint's structure, as torch's get_optimizer_state_dict
    for _ in range(3):
        opt.zero_grad()
        _mse(pm(local_x), local_y).backward()
        opt.step()
    return early, pm.state_dict(full=True)


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_state_dict_before_the_first_step_changes_no_step(strategy):
    model, x, y, _ = _mlp()
    for name, (optimizer, kwargs) in _FIRST_STEP_SENSITIVE.items():
        ref = copy.deepcopy(model)
        opt = optimizer(ref.parameters(), **kwargs)
        for _ in range(3):
            opt.zero_grad()
            _mse(ref(x), y).backward()
            opt.step()
        for early, params in run_threaded(2, _train_after_an_early_state_dict, model, x, y, strategy, optimizer,
                                          kwargs):
            if name == "AdamW":   # the early state has the structure a checkpoint loads into, and no step taken
                assert early["state"] and all(float(s["step"]) == 0 for s in early["state"].values())
            for n, p in ref.named_parameters():
                torch.testing.assert_close(params[n], p.detach(), atol=ATOL, rtol=0,
                                           msg=lambda m: f"{strategy} {name} {n}: {m}")
