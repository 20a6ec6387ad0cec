"""Mixed precision at run time, as priced: precision="bf16-mixed" trains with float32 master weights,
gradients and optimizer state, bf16 compute and saved activations, bf16 weight all-gathers and float32
gradient reductions -- and every byte of that equals the plan's prediction.

bf16 has an 8-bit mantissa: its losses follow the float32 single-device run to within about a percent,
not to float32 rounding; the checks on bytes and dtypes are exact.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.testing import GPT, GPTConfig, gpt_loss, run_threaded, single_device_reference

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
STEPS = 20
LR = {torch.optim.SGD: 0.1, torch.optim.AdamW: 3e-3}


def _model():
    torch.manual_seed(0)
    return GPT(CFG)


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CFG.vocab_size, (8, CFG.block_size), generator=g)
    y = torch.randint(0, CFG.vocab_size, (8, CFG.block_size), generator=g)
    return x, y


def _world(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# models are built before the rank threads start and copied in them: threaded ranks share torch's
# global random generator, so building one per rank would interleave its draws

def _train(rank, model, strategy, shape, axes, optimizer, x, y):
    pm = autopar.parallelize(copy.deepcopy(model), init_device_mesh("cpu", shape, mesh_dim_names=axes), (x,),
                             strategy=strategy, precision="bf16-mixed", hardware="cpu")
    opt = autopar.ShardedOptimizer(pm, optimizer, lr=LR[optimizer])
    (local_x,), (local_y,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    losses, first_grads = [], None
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        logits = pm(local_x)
        loss = gpt_loss(logits, local_y)
        loss.backward()
        first_grads = first_grads or opt.full_grads()
        opt.step()
        losses.append(loss.item())
    dtypes = {"logits": logits.dtype, "params": {p.dtype for p in pm.parameters()},
              "grads": {g.dtype for g in [p.grad for p in pm.parameters() if p.grad is not None] + opt.slice_grads()},
              "state": {t.dtype for s in opt.state.values() for k, t in s.items() if k != "step"}}
    return losses, dtypes, first_grads


@pytest.mark.parametrize("strategy, shape, axes, optimizer", [
    ("ddp", (2,), ("dp",), torch.optim.SGD), ("fsdp", (2,), ("dp",), torch.optim.AdamW),
    ("tp", (2,), ("tp",), torch.optim.AdamW), ("zero2", (2,), ("dp",), torch.optim.SGD),
    ("fsdp", (4,), ("dp",), torch.optim.SGD),
    ("fsdp+tp", (2, 2), ("dp", "tp"), torch.optim.AdamW)])
def test_bf16_mixed_trains_within_bf16_tolerance_of_float32(strategy, shape, axes, optimizer):
    x, y = _batch()
    ref = single_device_reference(_model, x, y, gpt_loss, steps=STEPS, lr=LR[optimizer], optimizer=optimizer)
    results = run_threaded(_world(shape), _train, _model(), strategy, shape, axes, optimizer, x, y)
    losses = torch.tensor([r[0] for r in results]).mean(0)   # equal batch shards: their mean is the loss
    want = torch.tensor(ref["losses"])
    assert losses[-1] < 0.9 * losses[0]   # it learns
    # per step within 3% of float32 (bf16 rounds to ~0.4% per op), and no drift over the run
    torch.testing.assert_close(losses, want, rtol=0.03, atol=0)
    assert abs(losses[-5:].mean() - want[-5:].mean()) < 0.02 * want[-5:].mean()
    for _, dtypes, grads in results:
        assert dtypes["logits"] == torch.bfloat16   # computed in bf16 ...
        # ... from float32 master weights, gradients and optimizer state
        assert dtypes["params"] == dtypes["grads"] == {torch.float32}
        assert dtypes["state"] <= {torch.float32}
        # the first step's gradients are float32's to bf16 accuracy (a wrong averaging would be off by
        # a factor of the shard count); later steps are not compared weight by weight: bf16 rounding
        # differs with the order of a sum, and 20 steps amplify it
        assert grads.keys() == ref["grads"].keys()
        for name, want in ref["grads"].items():
            err = (grads[name] - want).abs().max() / want.abs().max()
            assert err < 0.05, (name, float(err))


def _audit(rank, model, strategy, shape, axes, precision, x):
    pm = autopar.parallelize(copy.deepcopy(model), init_device_mesh("cpu", shape, mesh_dim_names=axes), (x,),
                             strategy=strategy, precision=precision, hardware="cpu")
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=1e-3)
    report = autopar.audit(pm, *pm.plan.local_inputs(x), optimizer=opt)
    return report, pm.plan.predicted.comm_bytes_by_kind


@pytest.mark.parametrize("strategy, shape, axes", [("fsdp", (2,), ("dp",)), ("tp", (2,), ("tp",)),
                                                   ("zero1", (2,), ("dp",)), ("fsdp+tp", (2, 2), ("dp", "tp"))])
def test_bf16_mixed_bytes_measured_equal_predicted(strategy, shape, axes):
    x, _ = _batch()
    mixed = run_threaded(_world(shape), _audit, _model(), strategy, shape, axes, "bf16-mixed", x)
    fp32 = run_threaded(_world(shape), _audit, _model(), strategy, shape, axes, None, x)
    for (report, kinds), (report32, kinds32) in zip(mixed, fp32):
        for row in report.rows:   # every collective's bytes, parameters, gradients, state, activations
            assert row.measured == row.predicted, (row, str(report))
        # about half of float32: activations (bf16 but for attention's float32 logsumexp) ...
        ratio = report.row("activations saved for backward").measured / \
            report32.row("activations saved for backward").measured
        assert 0.5 <= ratio < 0.56, ratio
        # ... and FSDP's weight all-gathers (ZeRO gathers the updated float32 master slices, as in float32);
        # gradients reduce in float32 as before
        if strategy.startswith("fsdp"):
            assert kinds["all_gather"] < kinds32["all_gather"]
        assert kinds.get("reduce_scatter") == kinds32.get("reduce_scatter")
        # float32 master weights, gradients and AdamW state: the same bytes as a float32 run
        for quantity in ("parameters", "gradients", "optimizer state"):
            assert report.row(quantity).measured == report32.row(quantity).measured


def test_fsdp_all_gathers_bf16_weights_and_reduce_scatters_float32_gradients():
    x, _ = _batch()
    model = _model()
    sizes = {n: p.numel() for n, p in model.named_parameters()}

    def run(rank):
        pm = autopar.parallelize(copy.deepcopy(model), init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), (x,),
                                 strategy="fsdp", precision="bf16-mixed", hardware="cpu", record_comm=True)
        pm(*pm.plan.local_inputs(x)).float().mean().backward()
        return pm.comm.log.records

    records = run_threaded(2, run)[0]
    gathers = [b for kind, _, b, phase in records if kind == "all_gather" and phase == "forward"]
    scatters = [b for kind, _, b, _ in records if kind == "reduce_scatter"]
    # each weight gathered whole in bf16 (2 B an element), its gradient reduce-scattered in float32 (4 B),
    # a layer at a time (runtime/reduction/layer_groups.py); but the position table's gradient: it is looked up by
    # positions, not by the batch, so its sum over the batch shards is an all-reduce of the (bf16)
    # activation gradient before the lookup
    assert sum(gathers) == sum(2 * n for n in sizes.values())
    assert sum(scatters) == sum(4 * n for name, n in sizes.items() if name != "wpe.weight")
    num_layers = len({n.split(".")[1] for n in sizes if n.startswith("h.")})
    assert len(scatters) == num_layers + 1   # the blocks and the root


def test_a_policy_with_a_float32_input_casts_it_like_fsdp2():
    """A model fed float inputs: they are cast to the compute dtype, as FSDP2's cast_forward_inputs does."""
    from autopar.testing import MLP
    torch.manual_seed(0)
    model, x = MLP([16, 32, 16]), torch.randn(8, 16)
    want = model(x)

    def run(rank):
        pm = autopar.parallelize(copy.deepcopy(model), init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), (x,),
                                 strategy="fsdp", precision="bf16-mixed", hardware="cpu")
        return pm(*pm.plan.local_inputs(x))

    outs = run_threaded(2, run)
    got = torch.cat(outs)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_fp16_trains_with_torch_sharded_grad_scaler():
    """fp16 needs loss scaling. torch's ShardedGradScaler (its inf check all-reduced over the ranks, so
    every rank skips the same steps) drives autopar.ShardedOptimizer as it drives any optimizer."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    x, y = _batch()
    model = _model()
    ref = single_device_reference(_model, x, y, gpt_loss, steps=4, lr=3e-3, optimizer=torch.optim.AdamW)
    fp16 = autopar.Precision(compute="fp16", master="fp32")

    def run(rank):
        pm = autopar.parallelize(copy.deepcopy(model), init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), (x,),
                                 strategy="fsdp", precision=fp16, hardware="cpu")
        opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=3e-3)
        scaler = ShardedGradScaler(device="cpu", init_scale=2.0 ** 16)
        (local_x,), (local_y,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
        losses = []
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            loss = gpt_loss(pm(local_x), local_y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
        return losses, scaler.get_scale(), {p.dtype for p in pm.parameters()}

    results = run_threaded(2, run)
    for _, scale, dtypes in results:
        # 4.3 x 2**16 overflows fp16 (65504): the first step is skipped on every rank and the scale halved
        assert scale == 2.0 ** 15 and dtypes == {torch.float32}
    losses = torch.tensor([r[0] for r in results]).mean(0)
    assert losses[0] == losses[1]   # the skipped step changed nothing
    # then it trains as float32 does, one step behind, to fp16 accuracy
    torch.testing.assert_close(losses[1:], torch.tensor(ref["losses"]), rtol=0.01, atol=0)


def test_bf16_gradient_reductions_move_half_the_bytes_as_predicted():
    x, _ = _batch()
    low = autopar.Precision(compute="bf16", master="fp32", reduce="bf16")
    low_reduce = run_threaded(2, _audit, _model(), "fsdp", (2,), ("dp",), low, x)
    mixed = run_threaded(2, _audit, _model(), "fsdp", (2,), ("dp",), "bf16-mixed", x)
    for (report, kinds), (_, kinds32) in zip(low_reduce, mixed):
        for row in report.rows:
            assert row.measured == row.predicted, (row, str(report))
        assert kinds["reduce_scatter"] * 2 == kinds32["reduce_scatter"]
        assert kinds["all_gather"] == kinds32["all_gather"]


def test_bf16_mixed_hf_llama_with_labels_trains_like_float32():
    """A model written elsewhere, used as its authors use it: HF Llama called with labels=, its loss computed
    inside forward. Traced at bf16, its graph holds the model's own casts (RMSNorm in float32, rotary tables
    cast to the activations' dtype). SGD: a wrong gradient scale would show."""
    from autopar.testing import WithLabels, tiny_llama
    torch.manual_seed(0)
    model = WithLabels(tiny_llama().model)
    x = torch.randint(0, 64, (8, 16))
    labels = x.clone()
    labels[1, :13] = -100   # ignored targets, unevenly spread over the batch shards
    labels[6, 2:] = -100
    steps, lr = 10, 0.5
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    want, want_grads = [], None
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = ref(x, labels).loss
        loss.backward()
        want_grads = want_grads or {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
        want.append(loss.item())

    def run(rank):
        pm = autopar.parallelize(copy.deepcopy(model), init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)),
                                 (x, labels), strategy="fsdp", precision="bf16-mixed", hardware="cpu")
        opt = autopar.ShardedOptimizer(pm, torch.optim.SGD, lr=lr)
        local = pm.plan.local_inputs(x, labels)
        losses, grads = [], None
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            out = pm(*local)
            out.loss.backward()   # the global mean, the same on every rank
            grads = grads or opt.full_grads()
            opt.step()
            losses.append(out.loss.item())
        return losses, grads, out.logits.dtype

    for losses, grads, dtype in run_threaded(2, run):
        assert dtype == torch.bfloat16   # (HF computes the loss from the logits upcast to float32)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=0.03, atol=0)
        for name, g in want_grads.items():
            err = (grads[name] - g).abs().max() / g.abs().max()
            assert err < 0.05, (name, float(err))
