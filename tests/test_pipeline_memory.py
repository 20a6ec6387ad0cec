"""A pipelined plan is held to its memory limit with everything its devices hold (issue 52, item 1).

A device of a pipeline holds the weights, gradients and optimizer state of every stage it runs (two or more
under an interleaved schedule), the activations of the microbatches each of them keeps in flight, and the
working set once. The summary line, each stage's row and the limit check must say the same number, and no plan
over the limit may come back: an interleaved plan used to pass a check stage by stage and come back at twice the
limit.
"""
import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
import cost_models as cm
from autopar.errors import InfeasiblePlanError, PipelineError
from autopar.search.pipeline import device_activations, interleaved_in_flight
from autopar.testing.models import GPT, GPTConfig

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
BATCH = 48


def _plan(model, mesh, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        x = torch.randint(0, model.config.vocab_size, (BATCH, model.config.block_size))
        return autopar.plan(model, (x,), mesh, hardware="h100", time_limit=None, **options)


def _model(n_layer: int, n_embd: int):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=n_layer, n_head=4, n_embd=n_embd))


def _check_consistent(plan, limit=None):
    """The summary, the stage table and the limit agree: the total is the busiest device's, every stage's row is
    its device's total, and none is over the limit."""
    pipe, total = plan.pipeline, plan.predicted.memory.total
    p = pipe.num_stages // pipe.stages_per_device
    per_device = {s.index % p: s.memory for s in pipe.stages}
    for s in pipe.stages:   # the stages a device holds show one figure: that device's peak
        assert s.memory == per_device[s.index % p]
    assert max(per_device.values()) == pytest.approx(total, rel=1e-9)
    m = plan.predicted.memory
    assert m.params + m.master + m.grads + m.optimizer + m.activations + m.transient == pytest.approx(total, rel=1e-9)
    if limit is not None:
        assert total <= limit and all(v <= limit for v in per_device.values())
    assert f"total {cm.format_bytes(total)}" in str(plan)   # the summary line says it


@settings(max_examples=60 if THOROUGH else 5)
@given(n_layer=st.integers(4, 8), n_embd=st.sampled_from([32, 48]), p=st.sampled_from([2, 3, 4]),
       dp=st.sampled_from([1, 2]), schedule=st.sampled_from(["1f1b", "gpipe", "interleaved-1f1b", "zero-bubble"]),
       strategy=st.sampled_from(["ddp", "fsdp", "zero1"]), reshard=st.sampled_from([True, False, "auto"]),
       rounds=st.sampled_from([1, 2]), share=st.floats(0.3, 1.2))
def test_every_pipelined_plan_returned_fits_its_limit(n_layer, n_embd, p, dp, schedule, strategy, reshard, rounds,
                                                      share):
    stages = p * (2 if schedule == "interleaved-1f1b" else 1)
    if stages > n_layer:
        n_layer = stages
    model = _model(n_layer, n_embd)
    mesh = {"pp": p, "dp": dp} if dp > 1 else {"pp": p}
    options = dict(pipeline_axis="pp", schedule=schedule, microbatches=rounds * p,
                   strategy=strategy if dp > 1 else "ddp", reshard_after_forward=reshard if strategy == "fsdp" else None)
    free = _plan(model, mesh, **options)
    _check_consistent(free)
    limit = int(share * free.predicted.memory.total)
    try:
        plan = _plan(model, mesh, memory_limit=limit, **options)
    except (PipelineError, InfeasiblePlanError) as e:
        assert "memory_limit" in str(e)   # says which limit it could not meet
        return
    _check_consistent(plan, limit)


def test_an_interleaved_device_counts_both_of_its_stages():
    """Two stages per device under interleaved 1F1B: the device's peak is both stages' weights and activations in
    flight together, and a limit between one stage's figure and the device's must move the cut or refuse."""
    model = _model(8, 48)
    options = dict(pipeline_axis="pp", schedule="interleaved-1f1b", microbatches=4, strategy="ddp")
    plan = _plan(model, {"pp": 2}, **options)
    _check_consistent(plan)
    pipe = plan.pipeline
    on_0 = [s for s in pipe.stages if s.index % 2 == 0]
    assert len(on_0) == 2
    # the device's figure holds both stages' activations in flight at the schedule's peak (and their weights and
    # the working set): more than either stage's own peak, no more than the two peaks together (they peak apart)
    acts = device_activations(pipe, 0)
    own = [s.activations * s.in_flight for s in on_0]
    assert max(own) < acts <= sum(own) and on_0[0].memory > acts
    limit = int(0.9 * plan.predicted.memory.total)
    try:
        tight = _plan(model, {"pp": 2}, memory_limit=limit, **options)
    except PipelineError as e:
        assert "memory_limit" in str(e)
        return
    _check_consistent(tight, limit)


def test_recompute_under_a_pipeline_is_priced_and_auto_takes_it_only_to_fit():
    """checkpointing='full' under a pipeline keeps each block's inputs only and pays its forward again; 'auto'
    recomputes nothing without a limit, and recomputes where that is what fits (it used to refuse every
    checkpointing request with a pipeline)."""
    model = _model(4, 48)
    options = dict(pipeline_axis="pp", microbatches=4, strategy="ddp")
    plain = _plan(model, {"pp": 2, "dp": 2}, **options)
    full = _plan(model, {"pp": 2, "dp": 2}, checkpointing="full", **options)
    assert plain.checkpointed == {} and full.checkpointed == {"h": "full"}
    assert full.predicted.memory.activations < 0.5 * plain.predicted.memory.activations
    assert full.predicted.compute_time > plain.predicted.compute_time   # the forward again
    _check_consistent(full)
    limit = int((full.predicted.memory.total + plain.predicted.memory.total) / 2)
    with pytest.raises(PipelineError, match="memory_limit"):
        _plan(model, {"pp": 2, "dp": 2}, checkpointing="none", memory_limit=limit, **options)
    auto = _plan(model, {"pp": 2, "dp": 2}, checkpointing="auto", memory_limit=limit, **options)
    assert auto.checkpointed and auto.predicted.memory.total <= limit
    assert _plan(model, {"pp": 2, "dp": 2}, checkpointing="auto", **options).checkpointed == {}


def test_interleaved_in_flight_follows_torch_s_order():
    """torch's ScheduleInterleaved1F1B runs a round of microbatches through each local stage in turn before the
    first backward: on pp2 with 4 microbatches device 0's first stage holds all 4 (the audit measured it,
    tests/test_audit_pipeline.py), its second 2; device 1's hold 3 and 1. On 16 devices and 32 microbatches (the
    405B runs') device 0's first stage holds all 32."""
    assert interleaved_in_flight(2, 2, 4, 0) == (4, 2) and interleaved_in_flight(2, 2, 4, 1) == (3, 1)
    assert interleaved_in_flight(16, 2, 32, 0) == (32, 16) and interleaved_in_flight(16, 2, 32, 15) == (17, 1)
