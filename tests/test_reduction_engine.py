"""The reduction engine (runtime/reduction/engine.py) under its two launchers.

DDP's buckets (norm weights' gradients under tp+sp among them), FSDP's layer groups and ZeRO's buckets
all issue their collectives through engine.launch. With Comm.functional they go out as torch's functional
collectives, the form torch.compile can trace: the training must not change by a bit, and must still equal
one device.
"""
import copy

import pytest
import torch

import autopar
from autopar.runtime.reduction.engine import BackwardEnd, InFlight, InOrder
from autopar.testing import GPT, GPTConfig, gpt_loss, run_threaded, single_device_reference

STEPS, LR = 2, 1e-2


def _train(rank, model, x, y, strategy, mesh_shape, functional, optimizer):
    from torch.distributed.device_mesh import init_device_mesh
    names = ("dp", "tp")[:len(mesh_shape)]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy=strategy, record_comm=True)
    pm.comm.functional = functional
    opt = autopar.ShardedOptimizer(pm, optimizer, lr=LR)
    (xi,), (yi,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        gpt_loss(pm(xi), yi).backward()
        opt.step()
    kinds = sorted({(k, phase) for k, _, _, phase in pm.comm.log.records})
    return {k: v.clone() for k, v in pm.state_dict(full=True).items()}, kinds


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW], ids=["sgd", "adamw"])
@pytest.mark.parametrize("strategy, mesh_shape", [("ddp", (2,)), ("fsdp", (2,)), ("zero2", (2,)), ("zero1", (2,)),
                                                  ("tp+sp", (2,)), ("fsdp+tp", (2, 2))])
def test_functional_collectives_train_bit_for_bit_as_the_eager_ones(strategy, mesh_shape, optimizer, monkeypatch):
    import autopar.runtime.reduction.engine as engine
    issued, original = [], engine.functional_collectives

    def counted():
        return tuple((lambda t, g, f=f: issued.append(f) or f(t, g)) for f in original()[:3]) + (original()[3],)
    monkeypatch.setattr(engine, "functional_collectives", counted)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    x, y = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) > 1 else 1)
    eager = run_threaded(world, _train, model, x, y, strategy, mesh_shape, False, optimizer)
    assert not issued
    functional = run_threaded(world, _train, model, x, y, strategy, mesh_shape, True, optimizer)
    assert issued   # the functional launcher ran
    ref = single_device_reference(lambda: copy.deepcopy(model), x, y, gpt_loss, steps=STEPS, lr=LR,
                                  optimizer=optimizer)
    for (params_e, kinds_e), (params_f, kinds_f) in zip(eager, functional):
        # the engine's reductions ran (the log names them), the same under both launchers
        assert kinds_e == kinds_f and any(k in ("all_reduce", "reduce_scatter") for k, _ in kinds_e), kinds_e
        for name, p in params_e.items():
            torch.testing.assert_close(params_f[name], p, atol=0, rtol=0, msg=name)
            # AdamW divides each step by the gradient's own size, so a gradient within float32 rounding of zero
            # moves its weight by up to a share of lr either way (2.1e-5 seen on one CPU at lr 1e-2); SGD does not
            atol = 1e-5 if optimizer is torch.optim.SGD else 1e-2 * LR
            torch.testing.assert_close(p, ref["params"][name], atol=atol, rtol=0, msg=name)


def _train_with_labels(rank, model, batch, strategy, runs):
    """A Hugging Face model as its authors train it (`model(**batch).loss`, `labels=` in the batch), its
    reductions issued as functional collectives."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, example_kwargs=batch, strategy=strategy)
    pm.comm.functional = True
    local, start = pm.plan.local_kwargs(**batch), {k: v.clone() for k, v in pm.state_dict(full=True).items()}
    out = {}
    for name, (optimizer, lr) in runs.items():
        pm.load_state_dict(start)
        opt = autopar.ShardedOptimizer(pm, optimizer, lr=lr)
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=True)
            pm(**local).loss.backward()
            opt.step()
        out[name] = {k: v.clone() for k, v in pm.state_dict(full=True).items()}
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2"])
def test_functional_collectives_train_a_hugging_face_model_called_with_labels(strategy, monkeypatch):
    """GPT-2 as shipped (tied embeddings, Conv1D), a padded batch with `labels=`: under the functional
    launcher it trains equal to one device, with SGD and with AdamW."""
    from autopar.testing import padded_batch, shipped_causal_lm
    from autopar.testing.harness import keyword_reference
    import autopar.runtime.reduction.engine as engine
    issued, original = [], engine.functional_collectives

    def counted():
        return tuple((lambda t, g, f=f: issued.append(f) or f(t, g)) for f in original()[:3]) + (original()[3],)
    monkeypatch.setattr(engine, "functional_collectives", counted)
    torch.manual_seed(0)
    model = shipped_causal_lm("gpt2")
    batch = padded_batch(vocab=model.config.vocab_size)
    runs = {"sgd": (torch.optim.SGD, 0.5), "adamw": (torch.optim.AdamW, 1e-3)}
    atol = {"sgd": 1e-5, "adamw": 2e-4}
    records = run_threaded(2, _train_with_labels, model, batch, strategy, runs)
    assert issued
    for name, (optimizer, lr) in runs.items():
        ref = keyword_reference(model, batch, optimizer, lr, steps=STEPS)["params"]
        for rec in records:
            for fqn, value in ref.items():
                torch.testing.assert_close(rec[name][fqn], value, atol=atol[name], rtol=0, msg=f"{name} {fqn}")


# ---------------------------------------------------------------- the engine's parts, alone

def test_in_order_launches_a_ready_bucket_only_after_every_one_before_it():
    ready, launched = set(), []
    order = InOrder([0, 1, 2], lambda b: b in ready, launched.append)
    ready.add(1)
    order.advance()
    assert launched == []                    # bucket 1 is ready, but 0 is not: every rank waits the same way
    ready.add(0)
    order.advance()
    assert launched == [0, 1]
    order.rest()
    assert launched == [0, 1, 2] and order.next == 0


def test_in_flight_retires_the_oldest_before_another_goes_out():
    retired = []
    flight = InFlight(retire=retired.append, limit=2)
    for k in range(4):
        flight.make_room()
        flight.add(k)
    assert retired == [0, 1] and flight.entries == [2, 3]
    flight.drain()
    assert retired == [0, 1, 2, 3] and not flight.entries


def test_backward_end_runs_once_per_backward_and_drops_what_a_raising_backward_left():
    calls = []
    end = BackwardEnd(lambda: calls.append("finish"), lambda: calls.append("drop"))

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, fail):
            ctx.fail = fail
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            end.queue()
            end.queue()   # a second arrival in the same backward queues nothing more
            if ctx.fail:
                raise RuntimeError("boom")
            return g, None

    x = torch.ones(2, requires_grad=True)
    Probe.apply(x, False).sum().backward()
    assert calls == ["finish"]
    with pytest.raises(RuntimeError, match="boom"):
        Probe.apply(x, True).sum().backward()
    assert calls == ["finish"]   # torch dropped the callback of the backward that raised
    Probe.apply(x, False).sum().backward()
    assert calls == ["finish", "drop", "finish"]
