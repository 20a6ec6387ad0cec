"""Parameters frozen before parallelize (requires_grad False, as when fine-tuning a model's top or keeping its
embeddings): they take no gradient, no optimizer state and no gradient reduction, in the plan's prediction and in
the run, and the rest trains as on one device. A weight frozen when parallelized and thawed after is refused: the
module reduces no gradient of it, so its gradient would be silently wrong.

Before, the plan priced every floating weight as trained (a frozen GPT's gradients and optimizer state predicted
at twice what the run allocated, and its gradient reductions that never ran)."""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.testing import gpt_loss, run_threaded
from autopar.testing.harness import audit_rows, check_runs_against_one_device, parallel_records
from autopar.testing.models import seeded_gpt

OPTIMIZERS = {"sgd": (torch.optim.SGD, 0.5), "adamw": (torch.optim.AdamW, 1e-3)}


def _frozen_gpt(n_layer: int = 4):
    """seeded_gpt with its embeddings and its first two blocks frozen."""
    model, x, y = seeded_gpt(n_layer=n_layer)
    for m in (model.wte, model.wpe, model.h[0], model.h[1]):
        m.requires_grad_(False)
    return model, x, y


def _frozen_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


def test_a_frozen_weight_is_priced_without_gradient_or_optimizer_state():
    model, x, _ = _frozen_gpt()
    trained, _, _ = seeded_gpt(n_layer=4)
    frozen = autopar.plan(model, (x,), {"dp": 2}, hardware="cpu", strategy="ddp").predicted.memory
    whole = autopar.plan(trained, (x,), {"dp": 2}, hardware="cpu", strategy="ddp").predicted.memory
    assert frozen.params == whole.params   # still held, whole on each rank under ddp
    assert frozen.grads == whole.grads - _frozen_bytes(model)
    assert frozen.optimizer == whole.optimizer - 2 * _frozen_bytes(model)   # AdamW: two fp32 states


@pytest.mark.parametrize("strategy, checkpointing", [("ddp", "none"), ("fsdp", "none"), ("fsdp", "full"),
                                                     ("tp", "none")])
def test_the_run_allocates_and_moves_what_the_plan_predicts(strategy, checkpointing):
    """autopar.audit on 2 ranks: gradients, optimizer state and the bytes on the axis as predicted. Under fsdp with
    full recompute the frozen blocks' checkpoints never rerun (nothing in them needs a gradient), so backward
    gathers their layers for nothing: none is priced, and none may be launched."""
    model, x, _ = _frozen_gpt()
    axis = "tp" if strategy == "tp" else "dp"
    for rank, (rows, plan) in enumerate(run_threaded(2, audit_rows, model, x, (2,), (axis,),
                                                     {"strategy": strategy, "checkpointing": checkpointing})):
        for quantity in ("gradients", "optimizer state", "parameters", f"comm bytes on {axis}"):
            predicted, measured = rows[quantity]
            assert measured == predicted, f"rank {rank} {quantity}: predicted {predicted}, measured {measured}"


@pytest.mark.parametrize("strategy, mesh_shape", [("ddp", (3,)), ("fsdp", (2,)), ("fsdp+tp", (2, 2))])
def test_a_partly_frozen_model_trains_as_one_device(strategy, mesh_shape):
    """SGD and AdamW, 3 steps: the trained weights' values, every gradient (the frozen ones have none, as on one
    device) and the bytes each axis moved, against one device."""
    model, x, y = _frozen_gpt()
    names = ("a", "b")[:len(mesh_shape)]
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) > 1 else 1)
    x, y = x.repeat(3, 1), y.repeat(3, 1)   # 12 sequences: every mesh here splits them evenly
    records = run_threaded(world, parallel_records, model, mesh_shape, names, x, y, gpt_loss, OPTIMIZERS, 3,
                           {"strategy": strategy, "hardware": "cpu", "checkpointing": "full"}, timeout=300)
    check_runs_against_one_device(model, x, y, gpt_loss, records, OPTIMIZERS)


def _thawed_forward(rank, model, x):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(model, mesh, (x,), hardware="cpu", strategy="ddp")
    pm(*pm.plan.local_inputs(x))   # frozen as captured: runs
    next(p for n, p in pm.named_parameters() if n.startswith("h.0.")).requires_grad_(True)
    with pytest.raises(autopar.PlanError, match="did not require grad when the model was parallelized"):
        pm(*pm.plan.local_inputs(x))
    return True


def test_a_weight_thawed_after_parallelize_is_refused():
    model, x, _ = _frozen_gpt()
    assert all(run_threaded(2, _thawed_forward, model, x))


def _frozen_after(rank, model, x, y, strategy):
    """Parallelize the whole model, freeze the embeddings and first two blocks, then 3 AdamW steps (weight decay
    0.1) with every parameter handed to the optimizer, as users do."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(model, mesh, (x,), hardware="cpu", strategy=strategy)
    for name, p in pm.named_parameters():
        if name.startswith(FROZEN):
            p.requires_grad_(False)
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    (xl,), (yl,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        gpt_loss(pm(xl), yl).backward()
        opt.step()
    given = [n for n, p in pm.named_parameters() if p.grad is not None and not p.requires_grad]
    return pm.state_dict(full=True), given


FROZEN = ("wte.", "wpe.", "h.0.", "h.1.")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2"])
def test_a_weight_frozen_after_parallelize_takes_no_gradient(strategy):
    """Its gradient never arrives, and the buckets and FSDP groups it shares with trained weights reduce zeros in
    its place: those zeros were once handed to it as its .grad, and AdamW's weight decay then moved the frozen
    weight (eager torch leaves a frozen weight's .grad None, so the optimizer skips it)."""
    model, x, y = seeded_gpt(n_layer=4)
    ref = copy.deepcopy(model)
    for name, p in ref.named_parameters():
        if name.startswith(FROZEN):
            p.requires_grad_(False)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        gpt_loss(ref(x), y).backward()
        opt.step()
    for params, given in run_threaded(2, _frozen_after, model, x, y, strategy):
        assert given == []
        for name, p in ref.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


def test_a_frozen_bottom_leaves_the_top_blocks_rerun_priced():
    """Backward never enters a frozen block, but it reruns the checkpointed blocks above it: the working set is
    one of those blocks' activations beside its FSDP layer gathered again. It was priced from the stack's first
    block alone, which, frozen, reruns nothing (a fine-tuning plan under-counted by half)."""
    from autopar.testing.models import GPT, GPTConfig

    def gpt(frozen=()):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=64, block_size=64))
        for name in frozen:
            model.get_submodule(name).requires_grad_(False)
        return model

    x = torch.randint(0, 64, (64, 64))

    def transient(model, strategy):
        return autopar.plan(model, (x,), {"dp": 2}, hardware="h100", strategy=strategy, checkpointing="full",
                            time_limit=None).predicted.memory.transient

    layer = sum(p.numel() * p.element_size() for p in gpt().h[2].parameters())
    # the trained model under ddp: a block's rerun activations are its working set (no layer is gathered)
    block = transient(gpt(), "ddp")
    assert transient(gpt(("wte", "wpe", "h.0", "h.1")), "ddp") == block
    assert transient(gpt(("wte", "wpe", "h.0", "h.1")), "fsdp") >= block + layer


def _parallelize_with(rank, model, x, plan):
    """parallelize(plan=...) and one backward: the frozen weights given a gradient, or the PlanError's text."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    try:
        pm = autopar.parallelize(model, mesh, (x,), plan=plan)
    except autopar.PlanError as e:
        return str(e)
    pm(*pm.plan.local_inputs(x)).sum().backward()
    return [n for n, p in pm.named_parameters() if p.grad is not None and not p.requires_grad]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_plan_made_with_other_weights_frozen(strategy):
    """Planned with every weight trained, run with some frozen: it runs, and the frozen ones take no gradient.
    Planned with some frozen, run with them trained: refused (the plan reduces no gradient of theirs), saying so."""
    trained, x, _ = seeded_gpt(n_layer=4)
    frozen, _, _ = _frozen_gpt()
    plan = autopar.plan(trained, (x,), {"dp": 2}, hardware="cpu", strategy=strategy)
    assert run_threaded(2, _parallelize_with, frozen, x, plan) == [[], []]
    plan = autopar.plan(frozen, (x,), {"dp": 2}, hardware="cpu", strategy=strategy)
    for said in run_threaded(2, _parallelize_with, trained, x, plan):
        assert isinstance(said, str) and "requires_grad False" in said, said


def test_a_pipelined_plan_holds_no_gradient_for_a_frozen_held_weight():
    """FSDP under a pipeline that keeps weights whole for the step (reshard_after_forward=False) holds each trained
    weight's whole gradient beside it, summed over the microbatches; a frozen weight takes none."""
    from autopar.testing import pipeline_batch, pipeline_gpt
    x, _ = pipeline_batch()

    def grads(frozen: bool):
        model = pipeline_gpt()
        if frozen:
            model.requires_grad_(False)
            model.lm_head.requires_grad_(True)   # something to train
        return autopar.plan(model, (x,), {"pp": 2, "dp": 2}, hardware="cpu", strategy="fsdp", pipeline_axis="pp",
                            schedule="1f1b", microbatches=2, reshard_after_forward=False).predicted.memory.grads

    head = pipeline_gpt().lm_head.weight
    # at most the head's gradient, whole and in its shard, on the device that holds it
    assert grads(True) <= 2 * head.numel() * head.element_size() < grads(False)
