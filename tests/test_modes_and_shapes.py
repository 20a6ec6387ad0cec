"""The parallel module behaves like the model in both modes and on other shapes than the example's.

- pm.eval() runs the eval-mode graph (dropout off), equal to the single-device
  model in eval mode; pm.train() turns dropout back on.
- Batch and sequence dims are dynamic by default: a module made from an (8, 16)
  example takes (4, 16), (8, 8) and (2, 32) batches, forward and backward equal
  to one device; a dim the model fixes raises InputShapeError naming it.

Threaded ranks; inputs are drawn before the threads start (they share one RNG).
"""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.testing import GPT, MLP, GPTConfig, run_threaded
from torch.distributed.device_mesh import init_device_mesh

CASES = [("ddp", (2,)), ("zero1", (2,)), ("zero2", (2,)), ("fsdp", (2,)), ("tp", (2,)), ("tp+sp", (2,)),
         ("fsdp+tp", (2, 2)), ("cp", (2,))]
SGD_LR = 0.5


def _mesh(shape):
    return init_device_mesh("cpu", shape, mesh_dim_names=("a", "b")[:len(shape)])


def _world(shape):
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.parametrize("strategy,shape", CASES)
def test_eval_mode_turns_dropout_off(strategy, shape):
    torch.manual_seed(0)
    model = GPT(GPTConfig(dropout=0.2, block_size=16))
    x = torch.randint(0, 64, (8, 16))
    with torch.no_grad():
        expected = copy.deepcopy(model).eval()(x)

    def run(rank):
        pm = autopar.parallelize(copy.deepcopy(model), _mesh(shape), (x,), strategy=strategy)
        (local,) = pm.plan.local_inputs(x)
        pm.eval()
        with torch.no_grad():
            first, second = pm(local), pm(local)
        pm.train()
        third, fourth = pm(local), pm(local)
        (want,) = pm.plan.local_targets(expected)
        return (first - want).abs().max().item(), (first - second).abs().max().item(), \
            (third - fourth).abs().max().item()

    for err, repeat, train_diff in run_threaded(_world(shape), run):
        # repeat: not bitwise 0, since threaded ranks share torch's intra-op pool, and a kernel that finds it
        # busy runs on one thread and sums in another order (~1e-7); dropout left on would differ by ~1
        assert err < 1e-5 and repeat < 1e-5
        assert train_diff > 1e-3   # dropout is on again in train mode


@pytest.mark.parametrize("strategy,shape", CASES)
def test_other_batch_and_sequence_sizes(strategy, shape):
    """Made from an (8, 16) example, with no dynamic_shapes= given."""
    torch.manual_seed(1)
    model = GPT(GPTConfig(block_size=32))
    example = torch.randint(0, 64, (8, 16))
    batches = [torch.randint(0, 64, s) for s in ((4, 16), (8, 8), (2, 32))]
    expected = []
    for x in batches:   # one SGD step on one device per batch: outputs and parameters after it
        m = copy.deepcopy(model)
        out = m(x)
        out.pow(2).mean().backward()
        torch.optim.SGD(m.parameters(), lr=SGD_LR).step()
        expected.append((out.detach(), {k: v.detach() for k, v in m.named_parameters()}))

    def run(rank):
        pm = autopar.parallelize(copy.deepcopy(model), _mesh(shape), (example,), strategy=strategy)
        start = {k: v.clone() for k, v in pm.state_dict(full=True).items()}   # (R ones alias the parameters)
        errs = []
        for x, (want_out, want_params) in zip(batches, expected):
            pm.load_state_dict(start)
            opt = autopar.ShardedOptimizer(pm, torch.optim.SGD, lr=SGD_LR)
            opt.zero_grad(set_to_none=True)
            (local,) = pm.plan.local_inputs(x)
            out = pm(local)
            out.pow(2).mean().backward()
            opt.step()
            (want,) = pm.plan.local_targets(want_out)
            params = pm.state_dict(full=True)
            errs.append(max([(out - want).abs().max().item()] +
                            [(params[k] - v).abs().max().item() for k, v in want_params.items()]))
        return errs

    for errs in run_threaded(_world(shape), run):
        assert max(errs) < 1e-5, errs


def test_a_dim_that_cannot_vary_is_named():
    torch.manual_seed(2)
    model = MLP([16, 8, 4])
    x = torch.randn(8, 16)

    def run(rank):
        pm = autopar.parallelize(copy.deepcopy(model), _mesh((2,)), (x,), strategy="ddp")
        static = autopar.parallelize(copy.deepcopy(model), _mesh((2,)), (x,), strategy="ddp", dynamic_shapes=None)
        messages = []
        for module, bad in ((pm, torch.randn(4, 12)), (static, torch.randn(2, 16)), (pm, torch.randn(4, 16, 1))):
            try:
                module(bad)
            except autopar.InputShapeError as e:
                messages.append(str(e))
        pm(torch.randn(3, 16))   # a smaller batch: dynamic by default
        return messages

    messages = run_threaded(2, run)[0]
    assert len(messages) == 3
    assert "dim 1 of input 'x'" in messages[0] and "is 12" in messages[0] and "16" in messages[0]
    assert "dynamic_shapes=" in messages[0]
    assert "dim 0 of input 'x'" in messages[1] and "captured with 8" in messages[1]
    assert "3 dims" in messages[2]
