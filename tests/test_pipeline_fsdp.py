"""FSDP under a pipeline, both ways (runtime/pipeline/held_weights.py): with reshard_after_forward False each
stage's FSDP weights are gathered once per step and held whole across the microbatches, their gradients summed
whole and reduce-scattered once after the last microbatch (torchtitan's way); with True each microbatch gathers
(and, in backward, gathers again and reduce-scatters) its own.

On 4 gloo ranks as pp2 x dp2 with FSDP on dp, under 1F1B, GPipe, interleaved 1F1B and zero bubble, held also
with full and per-op recompute (a checkpointed block reads the held weight, forward and rerun): parameters
and gradients equal to one device's, SGD beside AdamW (tolerances as test_pipeline.py's); and the collectives
the runtime logged in one step: held, one all-gather per FSDP weight of the device and the reduce-scatters of
one microbatch, for any number of microbatches; resharded, those per microbatch, as before.
"""
import gc
import weakref
from collections import Counter
from dataclasses import replace

import pytest
import torch

import autopar
import cost_models as cm
from autopar import Plan
from autopar.runtime.lowering.recompute import CheckpointRegion
from autopar.runtime.pipeline import held_weights
from autopar.sharding.placement import is_shard
from autopar.testing import gpt_loss, pipeline_batch, pipeline_gpt, run_gloo

ATOL = 1e-5
STEPS = 3
OPTIMIZERS = {"AdamW": (torch.optim.AdamW, 1e-4), "SGD": (torch.optim.SGD, 0.1)}
MESH = ((2, 2), ("pp", "dp"))
HELD, RESHARDED = dict(reshard_after_forward=False), dict(reshard_after_forward=True)
# case -> plan options (with strategy="fsdp", pipeline_axis="pp"); every case shares one launch of 4 processes
CASES = {
    "1f1b, 2 microbatches, held": dict(schedule="1f1b", microbatches=2, **HELD),
    "1f1b, 4 microbatches, held": dict(schedule="1f1b", microbatches=4, **HELD),
    "gpipe, 2 microbatches, held": dict(schedule="gpipe", microbatches=2, **HELD),
    "interleaved 1f1b, 4 microbatches, held": dict(schedule="interleaved-1f1b", microbatches=4, **HELD),
    "zero bubble, 4 microbatches, held": dict(schedule="zero-bubble", microbatches=4, **HELD),
    # held with recompute (torchtitan's 405B way): a checkpointed block reads the held weight, in its rerun too
    "1f1b, 4 microbatches, held, full recompute": dict(schedule="1f1b", microbatches=4, checkpointing="full", **HELD),
    "interleaved 1f1b, 4 microbatches, held, per-op recompute": dict(
        schedule="interleaved-1f1b", microbatches=4, checkpointing="per-op", **HELD),
    "1f1b, 2 microbatches, resharded": dict(schedule="1f1b", microbatches=2, **RESHARDED),
    "1f1b, 4 microbatches, resharded": dict(schedule="1f1b", microbatches=4, **RESHARDED),
}
# held cases also run resharded on the held plan's stages (the planner may cut the two differently)
TWINS = ("1f1b, 2 microbatches, held", "1f1b, 4 microbatches, held")
# under bf16-mixed, held against its twin: the same bf16 gradients of each microbatch, summed in fp32 by both
BF16 = dict(schedule="1f1b", microbatches=4, precision="bf16-mixed", **HELD)

def _step(model, x, y):
    if isinstance(model, autopar.ParallelModule):
        return model.train_step(x, loss_fn=gpt_loss, targets=y)
    loss = gpt_loss(model(x), y)
    loss.backward()
    return loss


def _fit(model, x, y) -> dict:
    """Per optimizer, from the same start: the first step's gradients and the parameters after STEPS."""
    full = {"full": True} if isinstance(model, autopar.ParallelModule) else {}
    start = {k: v.detach().clone() for k, v in model.state_dict(**full).items()}
    out = {}
    for name, (cls, lr) in OPTIMIZERS.items():
        model.load_state_dict(start)
        opt = cls(model.parameters(), lr=lr)
        rec = {"losses": []}
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            rec["losses"].append(float(_step(model, x, y).detach()))
            if step == 0:
                rec["grads"] = (model.full_grads() if full else
                                {n: p.grad.detach().clone() for n, p in model.named_parameters()})
            opt.step()
        rec["params"] = {k: v.detach().clone() for k, v in model.state_dict(**full).items()}
        out[name] = rec
    return out


def _one_step(pm, x, y) -> tuple:
    """One train_step: ({(kind, phase): launches on dp} from the module's log, the bytes they moved per device,
    the number of whole weights it held, how many of those are still alive once it returned). The GC is off through it, so a whole weight
    kept by a reference cycle counts as alive."""
    refs, gather = [], held_weights._gather

    def recording(module, read):
        held = gather(module, read)
        refs.append(weakref.ref(held.leaf))
        return held
    held_weights._gather = recording
    pm.comm.log.records.clear()
    gc.disable()
    try:
        pm.train_step(x, loss_fn=gpt_loss, targets=y)
    finally:
        gc.enable()
        held_weights._gather = gather
    dp, n = pm.plan.mesh.axis_names.index("dp"), pm.plan.mesh.axis_sizes[pm.plan.mesh.axis_names.index("dp")]
    on_dp = [(kind, nbytes, phase) for kind, axis, nbytes, phase in pm.comm.log.records if axis == dp]
    counts = dict(Counter((kind, phase) for kind, _, phase in on_dp))
    moved = sum(cm.bytes_moved(kind, nbytes, n) for kind, nbytes, _ in on_dp)
    return counts, moved, len(refs), sum(1 for r in refs if r() is not None)


def _fsdp_weights(pm) -> int:
    """This device's weights the plan stores split over dp (the pipelined module holds only its stages')."""
    dp = pm.plan.mesh.axis_names.index("dp")
    return sum(1 for name, _ in pm.named_parameters() if is_shard(pm.plan.param_placements[name][dp]))


def _train(mesh, options: dict, x, y, plan=None) -> dict:
    pm = autopar.parallelize(pipeline_gpt(), mesh, (x,), plan=plan, record_comm=True,
                             **({} if plan else dict(hardware="cpu", strategy="fsdp", pipeline_axis="pp", **options)))
    (lx,), (ly,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    out = _fit(pm, lx, ly)
    out["plan"] = pm.plan.to_json()
    out["collectives"], out["dp_bytes"], out["held"], out["alive"] = _one_step(pm, lx, ly)
    out["fsdp_weights"] = _fsdp_weights(pm)
    out["regions"] = sum(isinstance(m, CheckpointRegion) for m in pm.modules())
    return out


def _all_cases(rank, x, y):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", *MESH[:1], mesh_dim_names=MESH[1])
    out = {case: _train(mesh, options, x, y) for case, options in CASES.items()}
    out["bf16"] = _train(mesh, BF16, x, y)
    for case in TWINS + ("bf16",):   # the held plan resharded: its stages, each microbatch gathering as before
        held = Plan.from_json(out[case]["plan"])
        out["twin", case] = _train(mesh, {}, x, y, replace(held, reshard_after_forward=True))
    return out


@pytest.fixture(scope="module")
def four_ranks():
    """{case: [rank 0's results, ..., rank 3's]}."""
    by_rank = run_gloo(4, _all_cases, *pipeline_batch(), timeout=1200)
    return {case: [r[case] for r in by_rank] for case in by_rank[0]}


@pytest.fixture(scope="module")
def reference():
    return _fit(pipeline_gpt(), *pipeline_batch())


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_under_a_pipeline_trains_as_one_device(case, four_ranks, reference):
    options = CASES[case]
    plan = Plan.from_json(four_ranks[case][0]["plan"])
    assert plan.pipeline.schedule == options["schedule"] and plan.pipeline.microbatches == options["microbatches"]
    assert plan.reshard_after_forward is options["reshard_after_forward"]
    if "checkpointing" in options:   # every block recomputes, and this device's stages run their blocks as regions
        assert plan.checkpointed == {"h": options["checkpointing"]}, case
        assert all(r["regions"] > 0 for r in four_ranks[case]), case
    for opt in OPTIMIZERS:
        for r in four_ranks[case]:
            got, want = r[opt], reference[opt]
            for name, p in got["params"].items():
                torch.testing.assert_close(p, want["params"][name], atol=ATOL, rtol=0,
                                           msg=lambda m: f"{case} {opt}, {name}: {m}")
            for name, g in got["grads"].items():
                torch.testing.assert_close(g, want["grads"][name], atol=ATOL, rtol=0,
                                           msg=lambda m: f"{case} {opt}, grad {name}: {m}")
        for step in range(STEPS):   # each dp rank's loss is its shard's mean: the two average to one device's
            mean = sum(r[opt]["losses"][step] for r in four_ranks[case]) / len(four_ranks[case])
            assert mean == pytest.approx(reference[opt]["losses"][step], abs=ATOL), (case, opt)


def _dp(four_ranks, case, rank):
    return four_ranks[case][rank]["collectives"], four_ranks[case][rank]["fsdp_weights"]


@pytest.mark.parametrize("rank", range(4))
def test_held_weights_are_gathered_and_reduced_once_per_step(four_ranks, rank):
    """Held: one forward all-gather per FSDP weight of the device per step, none in backward, at most one
    reduce-scatter each; on the same stages resharded, all of those per microbatch (and gathers again in
    backward). The whole weights a step held are freed when it returns."""
    for case, options in CASES.items():
        got, fsdp = _dp(four_ranks, case, rank)
        m, reshard = options["microbatches"], options["reshard_after_forward"]
        held, alive = four_ranks[case][rank]["held"], four_ranks[case][rank]["alive"]
        assert fsdp > 0 and alive == 0, (case, held, alive)
        if reshard:
            assert held == 0 and got.get(("all_gather", "forward"), 0) == m * fsdp, (case, got)
            continue
        assert held == fsdp, case
        assert got.get(("all_gather", "forward"), 0) == fsdp, (case, got)
        assert got.get(("all_gather", "backward"), 0) == 0, (case, got)
        assert 0 < got.get(("reduce_scatter", "backward"), 0) <= fsdp, (case, got)
        if case in TWINS:
            twin, _ = _dp(four_ranks, ("twin", case), rank)
            assert twin.get(("all_gather", "forward"), 0) == m * fsdp, (case, twin)
            assert twin.get(("all_gather", "backward"), 0) > 0, (case, twin)   # gathered again for backward
            assert twin.get(("reduce_scatter", "backward"), 0) == m * got[("reduce_scatter", "backward")], (
                case, twin, got)


@pytest.mark.parametrize("case", list(CASES))
def test_the_plan_predicts_the_bytes_each_step_moves_on_dp(case, four_ranks):
    """plan.predicted is one device's (the busiest's): its dp bytes per step, priced per microbatch or once per
    step, are those one pipeline device's ranks measured."""
    plan = Plan.from_json(four_ranks[case][0]["plan"])
    measured = {r["dp_bytes"] for r in four_ranks[case]}
    assert any(plan.predicted.comm_bytes["dp"] == pytest.approx(b, rel=1e-9) for b in measured), (case, measured)


def test_held_weights_under_bf16_mixed_reduce_the_sums_the_resharded_run_reduces(four_ranks):
    """Both runs compute each microbatch's bf16 gradient alike; held sums them in fp32 (the reduce dtype) before
    the one reduce-scatter, resharded reduce-scatters each in fp32 and sums into .grad: equal to fp32 rounding.
    A sum taken in bf16 would be off by bf16's (2**-8 relative)."""
    held, resharded = four_ranks["bf16"], four_ranks["twin", "bf16"]
    assert Plan.from_json(held[0]["plan"]).reshard_after_forward is False
    for opt in OPTIMIZERS:
        for a, b in zip(held, resharded):
            for name, g in a[opt]["grads"].items():
                torch.testing.assert_close(g, b[opt]["grads"][name], atol=1e-7, rtol=1e-6,
                                           msg=lambda m: f"{opt}, grad {name}: {m}")
            for name, p in a[opt]["params"].items():
                torch.testing.assert_close(p, b[opt]["params"][name], atol=1e-6, rtol=0,
                                           msg=lambda m: f"{opt}, {name}: {m}")
