"""A model built on the meta device, parallelized, allocated shard by shard and filled from a
DCP checkpoint that the single-device model wrote, trains like the single-device model.

This is how a model too big for one device is trained: no rank ever holds the whole model.
The standard DCP round trip is what loads it:
    pm.to_empty(device="cpu"); sd = pm.state_dict(); dcp.load(sd, checkpoint_id=...); pm.load_state_dict(sd)
each rank reading only the slices its shards hold.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.testing import GPT, GPTConfig, gpt_loss, run_gloo, run_threaded, single_device_reference

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
LR = 0.1
# (strategy, mesh shape, axis names, optimizer): SGD everywhere (a wrong gradient scale shows in it),
# AdamW on the 2-D mesh
# on 3 (and 3 x 2) ranks, where 3 divides no dim of the model: every split there is uneven (padded)
CASES = [("fsdp", (2,), ("dp",), torch.optim.SGD), ("fsdp", (4,), ("dp",), torch.optim.SGD),
         ("fsdp+tp", (2, 2), ("dp", "tp"), torch.optim.SGD), ("fsdp+tp", (2, 2), ("dp", "tp"), torch.optim.AdamW),
         ("auto", (4,), ("a",), torch.optim.SGD),
         ("fsdp", (3,), ("dp",), torch.optim.SGD), ("fsdp", (3,), ("dp",), torch.optim.AdamW),
         ("fsdp+tp", (3, 2), ("dp", "tp"), torch.optim.SGD), ("auto", (3,), ("a",), torch.optim.AdamW)]


def _model():
    torch.manual_seed(0)
    return GPT(CFG)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_dcp")
    dcp.save(_model().state_dict(), checkpoint_id=str(path), no_dist=True)   # as a single-device user would
    return str(path)


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CFG.vocab_size, (12, CFG.block_size), generator=g)   # 12: splits over 2, 3, 4 and 6
    y = torch.randint(0, CFG.vocab_size, (12, CFG.block_size), generator=g)
    return x, y


def _meta_rank(rank, shape, axes, optimizer, kwargs, checkpoint, x, y):
    """One rank: build on meta, parallelize, allocate, load the DCP checkpoint, train 3 steps."""
    with torch.device("meta"):
        model = GPT(CFG)
    pm = autopar.parallelize(model, init_device_mesh("cpu", shape, mesh_dim_names=axes), (x,), **kwargs)
    on_meta = all(p.is_meta for p in pm.parameters())
    pm.to_empty(device="cpu")
    sd = pm.state_dict()
    dcp.load(sd, checkpoint_id=checkpoint)
    pm.load_state_dict(sd)
    local_bytes = sum(p.numel() * p.element_size() for p in pm.parameters())
    (local_x,) = pm.plan.local_inputs(x)
    (local_y,) = pm.plan.local_targets(y)
    opt = autopar.ShardedOptimizer(pm, optimizer, lr=LR)
    losses = []
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = gpt_loss(pm(local_x), local_y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {k: v.clone() for k, v in pm.state_dict(full=True).items()}
    # what this rank allocated for gradients and optimizer state (AdamW's scalar step counters aside)
    grads = [p.grad for p in pm.parameters() if p.grad is not None] + opt.slice_grads()
    states = [t for st in opt.state.values() for k, t in st.items() if k != "step" and torch.is_tensor(t)]
    measured = {"params": local_bytes, "grads": _bytes(grads), "optimizer": _bytes(states)}
    predicted = {part: float(getattr(pm.plan.predicted.memory, part)) for part in measured}
    return on_meta, measured, predicted, losses, params


def _check_meta_run(results, strategy, optimizer, world, x, y):
    """The ranks' losses and final weights are one device's; each rank's bytes are the prediction's."""
    ref = single_device_reference(_model, x, y, gpt_loss, steps=3, lr=LR, optimizer=optimizer)
    whole_bytes = sum(p.numel() * p.element_size() for p in _model().parameters())
    atol = 1e-5 if optimizer is torch.optim.SGD else 1e-3
    # each rank's loss is the mean over its shard of the batch; equal shards: their mean is the global loss
    mean_losses = torch.tensor([r[3] for r in results]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(ref["losses"]), atol=atol, rtol=0)
    # the plan prices the largest shard: the busiest rank allocates exactly that, the others no more
    for part in ("params", "grads", "optimizer"):
        measured = [r[1][part] for r in results]
        assert max(measured) == results[0][2][part], (part, measured, results[0][2][part])
    if strategy == "fsdp":   # a 1/N share of every weight, plus at most one padded row of each
        padding = sum(p.numel() // min(p.shape) * p.element_size() for p in _model().parameters() if p.dim())
        assert max(r[1]["params"] for r in results) <= whole_bytes / world + padding
    for on_meta, measured, _, _, params in results:
        assert on_meta, "parallelize allocated parameters of a meta-built model"
        assert measured["params"] < whole_bytes   # every case splits some weight: no rank holds the whole model
        assert params.keys() == ref["params"].keys()
        for name, want in ref["params"].items():
            torch.testing.assert_close(params[name], want, atol=atol, rtol=0, msg=name)


def _kwargs(strategy, shape, axes, optimizer, x) -> dict:
    kwargs = {"strategy": strategy, "hardware": "cpu", "optimizer": "sgd" if optimizer is torch.optim.SGD else "adamw"}
    if strategy == "auto":   # unlimited, auto replicates a model this small (fastest); a limit makes it shard
        ddp = autopar.plan(_model(), (x,), dict(zip(axes, shape)), **dict(kwargs, strategy="ddp"))
        kwargs["memory_limit"] = int(0.7 * ddp.predicted.memory.total)
    return kwargs


@pytest.mark.filterwarnings("ignore::UserWarning")   # dcp.save without a process group says it assumes one
@pytest.mark.parametrize("strategy,shape,axes,optimizer", CASES)
def test_meta_built_model_loaded_from_dcp_trains_like_one_device(checkpoint, strategy, shape, axes, optimizer):
    x, y = _batch()
    world = math.prod(shape)
    kwargs = _kwargs(strategy, shape, axes, optimizer, x)
    results = run_threaded(world, _meta_rank, shape, axes, optimizer, kwargs, checkpoint, x, y)
    _check_meta_run(results, strategy, optimizer, world, x, y)


# the same on real processes, where each rank's memory is its own: 3 ranks, every split uneven
@pytest.mark.gloo
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_meta_built_model_on_three_gloo_processes_trains_like_one_device(checkpoint):
    x, y = _batch()
    kwargs = _kwargs("fsdp", (3,), ("dp",), torch.optim.SGD, x)
    results = run_gloo(3, _meta_rank, (3,), ("dp",), torch.optim.SGD, kwargs, checkpoint, x, y)
    _check_meta_run(results, "fsdp", torch.optim.SGD, 3, x, y)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _initialized_on_one_device(seed: int) -> dict:
    """What a single device gets initializing a meta-built GPT module by module, in modules() order."""
    with torch.device("meta"):
        model = GPT(CFG)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _init_rank(rank, strategy, shape, axes):
    with torch.device("meta"):
        model = GPT(CFG)
    x, _ = _batch()
    pm = autopar.parallelize(model, init_device_mesh("cpu", shape, mesh_dim_names=axes), (x,),
                             strategy=strategy, hardware="cpu")
    with pytest.raises(autopar.PlanError, match="to_empty"):
        pm.init_weights()     # the shards are still on meta
    pm.to_empty(device="cpu")
    torch.manual_seed(123)    # every rank alike, as a single device would seed
    pm.init_weights()
    return {k: v.clone() for k, v in pm.state_dict(full=True).items()}


# real processes: threaded ranks would share (and interleave draws from) one random generator
@pytest.mark.gloo
@pytest.mark.parametrize("strategy,shape,axes", [("fsdp", (2,), ("dp",)), ("fsdp+tp", (2, 2), ("dp", "tp"))])
def test_init_weights_fills_the_shards_as_one_device_would(strategy, shape, axes):
    want = _initialized_on_one_device(seed=123)
    world = shape[0] * (shape[1] if len(shape) > 1 else 1)
    for got in run_gloo(world, _init_rank, strategy, shape, axes):
        assert got.keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, atol=0, rtol=0, msg=name)


def test_init_weights_refuses_a_model_built_with_real_tensors():
    x, _ = _batch()

    def run(rank):
        pm = autopar.parallelize(_model(), init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), (x,),
                                 strategy="fsdp", hardware="cpu")
        with pytest.raises(autopar.PlanError, match="meta device"):
            pm.init_weights()
        return True

    assert all(run_threaded(2, run))
