"""reshard_after_forward: FSDP weights kept whole from forward to backward, as a plan choice priced in memory.

With reshard_after_forward=False the module keeps each weight it gathered for an op that saves it for
backward (FSDP2's reshard_after_forward=False), instead of keeping the shard and gathering the layer again
in backward. These tests check that the module trains as one device does (SGD beside AdamW, an odd mesh),
launches no backward all-gather and exactly the collectives its plan lists, that the memory the plan adds
for the kept weights is the memory autograd keeps, and that "auto" picks the choice the memory limit allows.
"""
from __future__ import annotations

import copy
import functools
import math
from collections import Counter

import pytest
import torch

import autopar
from autopar.api import _capture
from autopar.capture.export import AUTO
from autopar.errors import PlanError
from autopar.planning.planner import plan_captured
from autopar.testing import GPT, GPTConfig, gpt_loss, parallel_record, run_threaded, single_device_reference

STEPS = 3
LR = 1e-3
ATOL = 1e-5
AXIS_NAMES = {(2,): ("a",), (3,): ("a",), (2, 2): ("a", "b")}


def gpt(batch: int):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=48, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    return GPT(cfg), torch.randint(0, 48, (batch, 8)), torch.randint(0, 48, (batch, 8))


def _plan_collectives(plan) -> Counter:
    return Counter((c.kind, plan.mesh.axis_names.index(c.axis), c.phase, round(c.bytes)) for c in plan.collectives)


def _measured(comm) -> Counter:
    return Counter((kind, axis, phase, round(b)) for kind, axis, b, phase in comm)


@pytest.mark.parametrize("shape,optimizer", [((2,), torch.optim.SGD), ((3,), torch.optim.AdamW),
                                             ((2, 2), torch.optim.SGD)], ids=["2-sgd", "3-adamw", "2x2-sgd"])
def test_weights_kept_whole_train_as_one_device_and_are_not_gathered_again(shape, optimizer):
    model, x, y = gpt(12)
    ref = single_device_reference(lambda: copy.deepcopy(model), x, y, gpt_loss, STEPS, LR, optimizer=optimizer)
    res = run_threaded(math.prod(shape), parallel_record, model, shape, AXIS_NAMES[shape], x, y, gpt_loss, STEPS,
                       LR, {"strategy": "fsdp", "reshard_after_forward": False}, optimizer)
    plan = res[0]["plan"]
    assert plan.reshard_after_forward is False
    assert all(p.startswith("S(") for pl in plan.param_placements.values() for p in pl), plan.param_placements
    for rank, r in enumerate(res):
        (expected,) = plan.local_targets(ref["outputs"], rank=rank)
        torch.testing.assert_close(r["outputs"], expected, atol=ATOL, rtol=0)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(r["grads"][name], g, atol=ATOL, rtol=0, msg=lambda m: f"grad {name}: {m}")
        for name, p in ref["params"].items():
            torch.testing.assert_close(r["params"][name], p, atol=ATOL, rtol=0, msg=lambda m: f"param {name}: {m}")
        measured = _measured(r["comm"])
        assert not [k for k in measured if k[0] == "all_gather" and k[2] == "backward"], measured
        assert measured == _plan_collectives(plan), (f"rank {rank}: the module launched {dict(measured)}, the plan "
                                                     f"lists {dict(_plan_collectives(plan))}")


def _audit(rank, model, x, reshard, precision=None, whole=False):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("a",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy="fsdp", reshard_after_forward=reshard,
                             precision=precision, hardware="cpu")
    opt = autopar.ShardedOptimizer(pm, torch.optim.AdamW if whole else torch.optim.SGD, lr=LR)
    report = autopar.audit(pm, *pm.plan.local_inputs(x), optimizer=opt)
    if whole:   # (the plan prices AdamW's state)
        return report
    comm = [c for c in pm.plan.collectives if c.kind == "all_gather"]
    return (report.row("activations saved for backward"), report.row("comm bytes on a"),
            sum(c.phase == "backward" for c in comm), sum(c.phase == "forward" for c in comm))


def test_kept_weights_cost_the_memory_autograd_keeps_and_save_the_backward_gathers():
    """The plan adds the gathered weights to the activations it predicts; autograd keeps exactly those bytes
    more, and the step moves one backward gather of each layer fewer."""
    model, x, _ = gpt(4)
    resharded, kept = (run_threaded(2, _audit, model, x, reshard)[0] for reshard in (True, False))
    (acts_t, comm_t, back_t, fwd_t), (acts_f, comm_f, back_f, fwd_f) = resharded, kept
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if n.endswith(".weight") and "wte" not in n and "wpe" not in n) \
        + sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "ln" in n and n.endswith(".bias"))
    assert acts_f.predicted - acts_t.predicted == weights   # every linear and norm weight, layer-norm biases
    assert acts_f.measured - acts_t.measured == acts_f.predicted - acts_t.predicted
    assert back_t > 0 and back_f == 0 and fwd_f == fwd_t
    assert comm_f.measured == pytest.approx(comm_f.predicted, rel=1e-12) and comm_f.measured < comm_t.measured


def test_bf16_weights_kept_whole_are_the_bytes_predicted():
    """Under bf16-mixed the kept weights are the bf16 copies the ops read: every audited row is as predicted."""
    model, x, _ = gpt(4)
    for report in run_threaded(2, _audit, model, x, False, "bf16-mixed", True):
        for row in report.rows:
            assert row.measured == row.predicted, (row, str(report))


def test_auto_keeps_the_weights_whole_unless_the_memory_limit_needs_them_resharded():
    model, x, _ = gpt(4)
    kw = dict(strategy="fsdp", hardware="cpu", checkpointing="none")
    mesh = {"a": 2}
    resharded = autopar.plan(model, (x,), mesh, reshard_after_forward=True, **kw)
    kept = autopar.plan(model, (x,), mesh, reshard_after_forward=False, **kw)
    assert kept.predicted.memory.total > resharded.predicted.memory.total
    assert kept.predicted.step_time < resharded.predicted.step_time   # one gather per layer fewer
    assert autopar.plan(model, (x,), mesh, **kw).reshard_after_forward is True   # a named strategy: True
    assert autopar.plan(model, (x,), mesh, reshard_after_forward="auto", **kw).reshard_after_forward is False
    between = (resharded.predicted.memory.total + kept.predicted.memory.total) / 2
    tight = autopar.plan(model, (x,), mesh, reshard_after_forward="auto", memory_limit=int(between), **kw)
    assert tight.reshard_after_forward is True
    assert tight.predicted.memory.total == resharded.predicted.memory.total
    assert "reshard_after_forward=True" in str(tight) and "reshard_after_forward=False" in str(kept)
    assert autopar.Plan.from_json(kept.to_json()).reshard_after_forward is False


def test_reshard_after_forward_rejects_what_it_cannot_do():
    model, x, _ = gpt(4)
    with pytest.raises(PlanError, match="reshard_after_forward must be"):
        autopar.plan(model, (x,), {"a": 2}, strategy="fsdp", reshard_after_forward="yes")


def test_held_weights_with_recompute_under_a_pipeline_are_gathered_once_per_step():
    """With a pipeline, reshard_after_forward=False holds each stage's weights for the step, and a checkpointed
    block reads them (tests/test_pipeline_fsdp.py runs it): torchtitan's 405B Llama. Priced so: recompute adds
    no gather of a held weight (the dp bytes of the same cut without recompute), and where only recompute fits
    "auto" holds the weights, moving over ~m times fewer dp bytes than the resharded plan under that limit."""
    model, x, _ = gpt(16)
    m = 8
    # captured once, and once per microbatch, for the four plans (capture is most of a plan's time here)
    cap, _, recapture = _capture(model, (x,), {}, None, AUTO, False)
    recapture = functools.cache(recapture)

    def plan(**options):
        return plan_captured(cap, {"pp": 2, "dp": 2}, recapture=recapture, strategy="fsdp", hardware="cpu",
                             pipeline_axis="pp", microbatches=m, **options)
    full = plan(reshard_after_forward=False, checkpointing="full", memory_limit=100_000)
    plain = plan(reshard_after_forward=False, checkpointing="none", memory_limit=100_000)
    assert full.reshard_after_forward is False and full.checkpointed == {"h": "full"}
    assert [s.nodes for s in full.pipeline.stages] == [s.nodes for s in plain.pipeline.stages]
    assert full.predicted.comm_bytes["dp"] == plain.predicted.comm_bytes["dp"]
    assert full.predicted.memory.total < plain.predicted.memory.total
    limit = int((full.predicted.memory.total + plain.predicted.memory.total) / 2)   # held fits only recomputing
    auto = plan(reshard_after_forward="auto", checkpointing="auto", memory_limit=limit)
    assert auto.reshard_after_forward is False and auto.checkpointed, auto
    assert auto.predicted.memory.total <= limit
    resharded = plan(reshard_after_forward=True, checkpointing="auto", memory_limit=limit)
    # resharded: each microbatch gathers its weights (and its recompute gathers them again) and reduce-scatters
    assert resharded.predicted.comm_bytes["dp"] > 0.75 * m * auto.predicted.comm_bytes["dp"]
    assert resharded.predicted.step_time > auto.predicted.step_time


def _train_with_labels(rank, model, x, labels):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("a",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x, labels), strategy="fsdp", reshard_after_forward=False)
    opt = autopar.ShardedOptimizer(pm, torch.optim.SGD, lr=0.5)
    local = pm.plan.local_inputs(x, labels)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = pm(*local).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in pm.state_dict(full=True).items()}, pm.plan.collectives


def test_hf_llama_with_labels_trains_as_one_device_with_its_weights_kept_whole():
    """Hugging Face Llama called as its authors train it, model(input_ids=..., labels=...) with the loss
    inside forward and ignored labels, under SGD (which a wrong gradient scale would show)."""
    from autopar.testing import WithLabels, tiny_llama
    torch.manual_seed(0)
    model = WithLabels(tiny_llama().model)
    x = torch.randint(0, 64, (4, 16))
    labels = x.clone()
    labels[1, :13] = -100
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    want = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = ref(x, labels).loss
        loss.backward()
        opt.step()
        want.append(loss.item())
    for losses, params, collectives in run_threaded(2, _train_with_labels, model, x, labels):
        assert losses == pytest.approx(want, abs=ATOL)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), atol=ATOL, rtol=0, msg=name)
        gathers = [c.phase for c in collectives if c.kind == "all_gather"]
        assert "forward" in gathers and "backward" not in gathers
