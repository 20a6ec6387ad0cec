"""Autograd patterns beside one forward and one backward per step: each equals one device, or is refused in words.

- two backwards through one graph kept with retain_graph=True add their gradients (2x one backward's), as
  one device does, under the gradient buckets (ddp) and the FSDP layer groups as under tp;
- a forward whose output is dropped (a validation loss in train mode) or one under no_grad in eval mode,
  between training steps, changes nothing;
- two forward/backward pairs on batches of different sizes (the last, smaller batch of an epoch) before
  one step accumulate as on one device, and so do two forwards whose backwards run after both;
- torch.autograd.grad with respect to parameters whose gradient the module reduces itself (ddp buckets,
  FSDP layers, tp+sp's norm weights) or ShardedOptimizer reduces (ZeRO-1/2) raises UnsupportedAutogradError,
  and training goes on right after it; with respect to inputs, and under plain tp, it works.

Parameters after steps are compared under SGD (a wrong gradient scale shows) and AdamW. Threaded ranks; the
data are drawn before the threads start (they share one RNG). Each mesh case runs all patterns on one
ParallelModule (parallelize dominates the time), the weights loaded back between them.
"""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.testing import GPT, MLP, GPTConfig, gpt_loss, run_threaded
from torch.distributed.device_mesh import init_device_mesh

ATOL = 1e-5
# the two optimizers each pattern trains with. AdamW's first step moves each weight by about lr * g / (|g| + eps):
# for a gradient near zero that is not a function of its value but of its last digits, which the ranks'
# other order of additions changes (h.0.ln_2.bias[11] on 3 ranks: 1.15e-08 against 1.08e-08 on one device,
# with eps=1e-8 and lr=0.1 a 1.5e-3 difference in the weight). eps=1e-5 bounds that to lr * 1e-9 / eps,
# and lr=0.01 keeps it and the second step's echo of it well under ATOL, while a wrong gradient's direction
# still moves a weight by ~lr. SGD (lr=0.1) is the check of the gradients' scale.
OPTIMIZERS = {"SGD": (torch.optim.SGD, {"lr": 0.1}), "AdamW": (torch.optim.AdamW, {"lr": 0.01, "eps": 1e-5})}
# a small bucket: the ddp weights spread over several buckets and routed groups, so a second backward's
# gradients come after some bucket was launched (one bucket for all hid that)
PLAN_KWARGS = {"bucket_bytes": 4096}
# one parallelize per case runs every pattern in turn (parallelize dominates the time): a pattern that left
# state behind in the reductions (use counts, pending gradients) shows in the patterns after it
CASES = [("ddp", (2,)), ("fsdp", (2,)), ("fsdp+tp", (2, 2)), ("tp", (2,)), ("fsdp", (3,))]
PATTERNS = ["retain_graph", "dropped_forward", "no_grad_eval", "smaller_second_batch", "two_graphs_alive"]


def _mesh(shape):
    return init_device_mesh("cpu", shape, mesh_dim_names=("a", "b")[:len(shape)])


def _world(shape):
    return shape[0] * (shape[1] if len(shape) > 1 else 1)


def _gpt_and_data(num_ranks: int):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=24, vocab_size=32, block_size=8)
    big, small = 4 * num_ranks, 2 * num_ranks   # each divides over the data axis
    data = [(torch.randint(0, cfg.vocab_size, (n, 8)), torch.randint(0, cfg.vocab_size, (n, 8)))
            for n in (big, big, small, big)]   # two training batches, a smaller one, a validation batch
    return GPT(cfg), data


def _step(model, data, pattern: str, run_forward, shard):
    """One optimizer step's forwards and backwards in `pattern`. `run_forward(x)`: the model's output on the
    global batch x; `shard(x, y)`: (x, y) as the model takes them (whole on one device, this rank's share)."""
    (x, y), (x2, y2), (x_small, y_small), (x_val, y_val) = data
    if pattern == "retain_graph":
        loss = gpt_loss(run_forward(*shard(x, y)[:1]), shard(x, y)[1])
        loss.backward(retain_graph=True)
        loss.backward()
    elif pattern == "dropped_forward":
        gpt_loss(run_forward(*shard(x_val, y_val)[:1]), shard(x_val, y_val)[1])   # a validation loss, no backward
        gpt_loss(run_forward(*shard(x, y)[:1]), shard(x, y)[1]).backward()
    elif pattern == "no_grad_eval":
        model.eval()
        with torch.no_grad():
            gpt_loss(run_forward(*shard(x_val, y_val)[:1]), shard(x_val, y_val)[1])
        model.train()
        gpt_loss(run_forward(*shard(x, y)[:1]), shard(x, y)[1]).backward()
    elif pattern == "smaller_second_batch":   # the last batch of an epoch
        gpt_loss(run_forward(*shard(x2, y2)[:1]), shard(x2, y2)[1]).backward()
        gpt_loss(run_forward(*shard(x_small, y_small)[:1]), shard(x_small, y_small)[1]).backward()
    else:   # two forwards, then their backwards: the second's uses are counted while the first's backward runs
        first = gpt_loss(run_forward(*shard(x, y)[:1]), shard(x, y)[1])
        second = gpt_loss(run_forward(*shard(x2, y2)[:1]), shard(x2, y2)[1])
        first.backward()
        second.backward()


def _train(model, data, pattern: str, make_optimizer, shard, full_grads, full_params) -> dict:
    """Two optimizer steps in `pattern`: the first step's whole gradients and the whole parameters after."""
    opt = make_optimizer()
    grads = None
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        _step(model, data, pattern, model, shard)
        grads = grads or full_grads(opt)
        opt.step()
    # copies: a whole replicated parameter is the parameter itself (as torch's state_dict), trained on
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in full_params().items()}}


def _reference(model, data, pattern: str, optimizer: str) -> dict:
    m = copy.deepcopy(model)
    cls, kwargs = OPTIMIZERS[optimizer]
    return _train(m, data, pattern, lambda: cls(m.parameters(), **kwargs), lambda x, y: (x, y),
                  lambda _: {n: p.grad.clone() for n, p in m.named_parameters()}, lambda: dict(m.named_parameters()))


def _parallel(rank, model, data, strategy, shape) -> dict:
    """(pattern, optimizer) -> what _train returns, every pattern on one ParallelModule, reset in between."""
    pm = autopar.parallelize(copy.deepcopy(model), _mesh(shape), (data[0][0],), strategy=strategy, **PLAN_KWARGS)
    start = {k: v.clone() for k, v in pm.state_dict(full=True).items()}

    def shard(x, y):
        return pm.plan.local_inputs(x)[0], pm.plan.local_targets(y)[0]

    out = {}
    for pattern in PATTERNS:
        for name, (cls, kwargs) in OPTIMIZERS.items():
            pm.load_state_dict(start)
            out[pattern, name] = _train(pm, data, pattern, lambda: autopar.ShardedOptimizer(pm, cls, **kwargs),
                                        shard, lambda opt: opt.full_grads(), lambda: pm.state_dict(full=True))
    return out


def _mismatches(got: dict, want: dict, what: str) -> list:
    """What differs between two _train results, in words (empty when they are equal)."""
    out = []
    for kind in ("grads", "params"):
        if set(got[kind]) != set(want[kind]):
            out.append(f"{what} {kind}: names {sorted(set(got[kind]) ^ set(want[kind]))} differ")
            continue
        for n, w in want[kind].items():
            try:
                torch.testing.assert_close(got[kind][n], w, atol=ATOL, rtol=0)
            except AssertionError as e:
                out.append(f"{what} {kind} {n}: {str(e).splitlines()[2:5]}")
    return out


@pytest.mark.parametrize("strategy,shape", CASES)
def test_patterns_train_as_on_one_device(strategy, shape):
    model, data = _gpt_and_data(shape[0])
    wants = {(p, o): _reference(model, data, p, o) for p in PATTERNS for o in OPTIMIZERS}
    problems = []
    for rank, result in enumerate(run_threaded(_world(shape), _parallel, model, data, strategy, shape)):
        for (pattern, optimizer), want in wants.items():
            what = f"{strategy} {shape} {pattern} {optimizer} rank {rank}"
            problems += _mismatches(result[pattern, optimizer], want, what)
    assert not problems, f"{len(problems)} mismatches:\n" + "\n".join(problems[:20])


def _autograd_grad_then_train(rank, model, data, strategy, shape):
    """torch.autograd.grad with respect to the parameters (caught), then a normal forward/backward: its whole
    gradients (ZeRO ones reduced by the ShardedOptimizer)."""
    pm = autopar.parallelize(copy.deepcopy(model), _mesh(shape), (data[0][0],), strategy=strategy, **PLAN_KWARGS)
    opt = autopar.ShardedOptimizer(pm, torch.optim.SGD, lr=0.1)
    (x, y) = data[0]
    (lx,), (ly,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    message = None
    try:
        torch.autograd.grad(gpt_loss(pm(lx), ly), list(pm.parameters()), allow_unused=True)
    except autopar.UnsupportedAutogradError as e:
        message = str(e)
    got_grads = {n: p.grad for n, p in pm.named_parameters() if p.grad is not None}
    gpt_loss(pm(lx), ly).backward()
    return message, got_grads, opt.full_grads()


@pytest.mark.parametrize("strategy,shape", [("ddp", (2,)), ("fsdp", (2,)), ("fsdp+tp", (2, 2)), ("tp+sp", (2,)),
                                            ("ddp", (3,)), ("zero1", (2,)), ("zero2", (2,))])
def test_autograd_grad_with_respect_to_reduced_parameters_is_refused(strategy, shape):
    model, data = _gpt_and_data(shape[0])
    ref = copy.deepcopy(model)
    gpt_loss(ref(data[0][0]), data[0][1]).backward()
    for message, stray, grads in run_threaded(_world(shape), _autograd_grad_then_train, model, data, strategy, shape):
        assert message is not None, "torch.autograd.grad returned (None for the reduced weights) instead of raising"
        assert "torch.autograd.grad" in message and "loss.backward()" in message and "p.grad" in message
        assert "report this" not in message
        if strategy.startswith("zero"):   # says who reduces the gradient, and where the whole one is
            assert "ShardedOptimizer" in message and "opt.full_grads()" in message
        assert not stray   # nothing reached .grad from the refused call
        for n, p in ref.named_parameters():   # and the module trains on right after it
            torch.testing.assert_close(grads[n], p.grad, atol=ATOL, rtol=0, msg=lambda m: f"{strategy} {n}: {m}")


def _meta_built_zero_checks(rank, model, data, strategy):
    """A model built on meta, parallelized, allocated (to_empty gives the shards new parameters) and loaded:
    whether autograd.grad with respect to its ZeRO weights, and a backward without ShardedOptimizer, raise."""
    pm = autopar.parallelize(copy.deepcopy(model).to("meta"), _mesh((2,)), (data[0][0],), strategy=strategy,
                             **PLAN_KWARGS)
    pm.to_empty(device="cpu")
    pm.load_state_dict(model.state_dict())
    (lx,), (ly,) = pm.plan.local_inputs(data[0][0]), pm.plan.local_targets(data[0][1])
    zero_params = [p for n, p in pm.named_parameters() if n in pm.plan.param_zero]
    refused = checked = False
    try:
        torch.autograd.grad(gpt_loss(pm(lx), ly), zero_params)
    except autopar.UnsupportedAutogradError:
        refused = True
    try:   # a plain torch optimizer would step on the unreduced gradients
        gpt_loss(pm(lx), ly).backward()
    except autopar.PlanError as e:
        checked = "ShardedOptimizer" in str(e)
    return bool(zero_params), refused, checked


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_meta_built_zero_module_keeps_its_gradient_checks_after_to_empty(strategy):
    model, data = _gpt_and_data(2)
    for has_zero, refused, checked in run_threaded(2, _meta_built_zero_checks, model, data, strategy):
        assert has_zero
        assert refused, "torch.autograd.grad returned the unreduced gradient of a ZeRO weight after to_empty"
        assert checked, "a backward without ShardedOptimizer went on after to_empty"


def _autograd_grad_under_tp(rank, model, data):
    pm = autopar.parallelize(copy.deepcopy(model), _mesh((2,)), (data[0][0],), strategy="tp", **PLAN_KWARGS)
    (lx,), (ly,) = pm.plan.local_inputs(data[0][0]), pm.plan.local_targets(data[0][1])
    params = list(pm.parameters())
    returned = torch.autograd.grad(gpt_loss(pm(lx), ly), params, allow_unused=True)
    gpt_loss(pm(lx), ly).backward()
    return [(g is None, None if g is None else (g - p.grad).abs().max().item()) for g, p in zip(returned, params)]


def test_autograd_grad_with_respect_to_parameters_works_under_tp():
    model, data = _gpt_and_data(2)
    for rows in run_threaded(2, _autograd_grad_under_tp, model, data):
        assert not any(none for none, _ in rows)
        assert max(err for _, err in rows) < ATOL


def _input_grads(rank, model, x, strategy, shape):
    pm = autopar.parallelize(copy.deepcopy(model), _mesh(shape), (x,), strategy=strategy, **PLAN_KWARGS)
    autopar.ShardedOptimizer(pm, torch.optim.SGD, lr=0.1)   # ZeRO's backward needs it
    (lx,) = pm.plan.local_inputs(x)
    lx = lx.detach().requires_grad_()
    (returned,) = torch.autograd.grad(pm(lx).pow(2).mean(), [lx])
    stray = [n for n, p in pm.named_parameters() if p.grad is not None]
    pm(lx).pow(2).mean().backward()
    return returned, lx.grad, stray


@pytest.mark.parametrize("strategy,shape", [("ddp", (2,)), ("fsdp", (2,)), ("fsdp+tp", (2, 2)), ("zero2", (2,))])
def test_autograd_grad_with_respect_to_inputs_works(strategy, shape):
    torch.manual_seed(3)
    model, x = MLP([16, 32, 8]), torch.randn(8, 16)
    for returned, accumulated, stray in run_threaded(_world(shape), _input_grads, model, x, strategy, shape):
        assert returned.abs().max() > 0
        torch.testing.assert_close(returned, accumulated, atol=ATOL, rtol=0)
        assert not stray   # the weights' reductions did not run for a gradient nobody asked of them
