"""A named strategy that cannot split the weights it promises to split is never silent.

Splits must divide evenly, so fsdp (or ZeRO) on an axis of size 3 over a
model whose dims are powers of two splits nothing: the plan would be DDP in
effect. That raises ShardingError; leaving only some weights whole warns
(DivisibilityWarning) with the bytes it costs. Strategies that keep weights
whole on purpose (ddp; biases and norms under tp) say nothing.
"""
import copy
import warnings

import pytest
import torch

import autopar
from autopar.testing import GPT, MLP, GPTConfig, run_threaded


def _divisibility_warnings(fn):
    """fn's result and the DivisibilityWarning messages raised while it ran (in any rank thread)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught if issubclass(w.category, autopar.DivisibilityWarning)]


@pytest.mark.parametrize("strategy, mesh, what", [
    ("fsdp", {"dp": 3}, "every weight"),
    ("zero1", {"dp": 3}, "the optimizer state of every weight"),
    ("fsdp+tp", {"dp": 3, "tp": 2}, "every weight"),
    ("fsdp", {"dp": 6}, "every weight"),
])
def test_axis_that_splits_no_weight_raises(strategy, mesh, what):
    # every dim is 8 or 16: 3 and 6 divide none
    with pytest.raises(autopar.ShardingError) as info:
        autopar.plan(MLP([8, 16, 8]), (torch.randn(6, 8),), mesh, strategy=strategy)
    msg = str(info.value)
    n = mesh["dp"]
    assert f"strategy {strategy!r} splits {what} over mesh axis 'dp'" in msg
    assert f"its size {n} does not divide" in msg and "'layers.0.weight' (16, 8)" in msg
    # what to do: 2 (of 3) or 4 (of 6) divides every dim; or a strategy that keeps weights whole
    assert f"(e.g. {4 if n == 6 else 2})" in msg and "strategy='ddp'" in msg and "strategy='auto'" in msg


def _parallelize_fsdp(rank, model, x):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("dp",))
    try:
        autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy="fsdp")
    except autopar.ShardingError as e:
        return str(e)
    return None


def test_parallelize_on_three_ranks_raises_on_every_rank():
    messages = run_threaded(3, _parallelize_fsdp, MLP([8, 16, 8]), torch.randn(6, 8))
    assert all(m is not None and "'layers.0.weight' (16, 8)" in m and "size 3" in m for m in messages), messages


def test_some_weights_left_whole_warn_once_with_their_cost():
    # 3 divides 15, so both linears split along it; the last bias (8,) cannot
    model, x = MLP([8, 15, 8]), torch.randn(6, 8)
    plan, msgs = _divisibility_warnings(lambda: autopar.plan(model, (x,), {"dp": 3}, strategy="fsdp"))
    assert len(msgs) == 1, msgs
    assert "leaves 1 whole" in msgs[0] and "1 of the 4 weights: 'layers.2.bias' (8,)" in msgs[0]
    # fp32 AdamW: weight, gradient and two states = 16 B per element; 8 elements held whole
    # instead of a third: 128 * 2/3 B more per device
    assert "costs 85 B more per device than splitting them 3 ways" in msgs[0]
    assert plan.param_placements["layers.2.bias"] == ("R",)
    assert plan.param_placements["layers.0.weight"] != ("R",)


def test_dividing_dims_neither_raise_nor_warn():
    torch.manual_seed(0)
    model, idx = GPT(GPTConfig()), torch.randint(0, 64, (4, 16))
    for strategy, mesh in (("ddp", {"dp": 2}), ("zero2", {"dp": 2}), ("fsdp", {"dp": 2}), ("tp", {"tp": 2})):
        plan, msgs = _divisibility_warnings(lambda: autopar.plan(model, (idx,), mesh, strategy=strategy))
        assert not msgs, (strategy, msgs)
        if strategy == "tp":   # norms stay whole under tp, on purpose: no warning for them
            assert plan.param_placements["ln_f.weight"] == ("R",)


def _parallelize_even(rank, model, x):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy="fsdp")
    return pm.plan.param_placements


def test_fsdp_on_two_ranks_with_even_dims_splits_everything_silently():
    placements, msgs = _divisibility_warnings(
        lambda: run_threaded(2, _parallelize_even, MLP([8, 16, 8]), torch.randn(4, 8)))
    assert not msgs, msgs
    assert all(pl != ("R",) for pl in placements[0].values()), placements[0]
