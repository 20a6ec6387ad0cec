"""autopar.audit on a pipelined ParallelModule: one train_step on 4 gloo ranks (pp2 x dp2, a 4-layer GPT) beside
the plan's predictions, for 1F1B, GPipe and interleaved 1F1B under ddp and fsdp (resharded after forward), 1F1B
under zero1 and under fsdp held whole through the step (reshard_after_forward=False).

plan.predicted describes one device of the pipeline (the one that needs the most memory); on its ranks the
comm bytes of every axis, the parameters, gradients and optimizer state are checked, and on every rank the peak
activations against its own device's figure (plan.pipeline.stages: activations x in_flight per stage).

Plans are made here, once per case, and travel to the ranks as JSON: planning on 4 ranks at once is most of a
launch on 2 cores, and a wrong prediction patched into the planner here reaches the ranks.
"""
import copy

import pytest
import torch

import autopar
from autopar import Plan
from autopar.testing import gpt_loss, pipeline_batch, pipeline_gpt, run_gloo

MESH = {"pp": 2, "dp": 2}
CASES = {
    "1f1b ddp": dict(strategy="ddp", schedule="1f1b"),
    "gpipe ddp": dict(strategy="ddp", schedule="gpipe"),
    "interleaved ddp": dict(strategy="ddp", schedule="interleaved-1f1b", microbatches=4),
    "1f1b fsdp": dict(strategy="fsdp", schedule="1f1b", reshard_after_forward=True),
    "gpipe fsdp": dict(strategy="fsdp", schedule="gpipe", reshard_after_forward=True),
    "interleaved fsdp": dict(strategy="fsdp", schedule="interleaved-1f1b", microbatches=4, reshard_after_forward=True),
    "1f1b zero1": dict(strategy="zero1", schedule="1f1b"),
    # FSDP weights gathered once per step and held whole (their whole copies and gradients count as weights)
    "1f1b fsdp held": dict(strategy="fsdp", schedule="1f1b", reshard_after_forward=False),
}
TIMED = "1f1b ddp"   # the case audited with timed_steps too


def _audit_cases(rank, plans: dict, x, y):
    """In each gloo rank: {case: the AuditReport of one pipelined train_step under the case's plan}."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", tuple(MESH.values()), mesh_dim_names=tuple(MESH))
    out = {}
    for case, plan_json in plans.items():
        pm = autopar.parallelize(pipeline_gpt(), mesh, (x,), plan=Plan.from_json(plan_json))
        opt = (autopar.ShardedOptimizer(pm, torch.optim.AdamW, lr=1e-4) if pm.plan.param_zero
               else torch.optim.AdamW(pm.parameters(), lr=1e-4))
        (local_y,) = pm.plan.local_targets(y)
        out[case] = autopar.audit(pm, *pm.plan.local_inputs(x), loss_fn=gpt_loss, targets=local_y, optimizer=opt,
                                  timed_steps=2 if case == TIMED else 0)
    return out


@pytest.fixture(scope="module")
def audited():
    """{case: (plan, [rank 0's AuditReport, ..., rank 3's])}, every case in one launch of 4 processes."""
    x, y = pipeline_batch()
    plans = {case: autopar.plan(pipeline_gpt(), x, MESH, hardware="cpu", pipeline_axis="pp", **kw) for case, kw in CASES.items()}
    by_rank = run_gloo(4, _audit_cases, {c: p.to_json() for c, p in plans.items()}, x, y, timeout=600)
    return {case: (plans[case], [r[case] for r in by_rank]) for case in CASES}


def _activation_slack(pipe, stages) -> float:
    """Bytes a device's measured peak may exceed its prediction by: torch's schedule receives each microbatch into
    a buffer of its own and holds the buffers for the step, so a stage's input that autograd saved for a
    microbatch already done is still alive (the audit counts a storage until it is freed) -- at most
    m - in_flight received inputs per stage after the first; the plan prices only the microbatches in flight."""
    m = pipe.microbatches
    return sum((m - pipe.stages[s].in_flight) * pipe.stages[s - 1].send_bytes for s in stages if s > 0)


def _check_described(case, plan, report):
    """The ranks of the device plan.predicted describes: every row but the pipeline's time rows."""
    for axis in plan.mesh.axis_names:
        row = report.row(f"comm bytes on {axis}")
        if axis == plan.pipeline.axis:
            # the prediction counts a gradient coming back for every tensor that crosses a cut; the token ids
            # cross too (a later stage reads their shape) and carry none: 256 of the 4352 bytes per microbatch
            assert 0.94 * row.predicted <= row.measured <= row.predicted, (case, row)
        else:   # (equal today)
            assert row.measured == pytest.approx(row.predicted, rel=0.02), (case, row)
    for quantity in ("parameters", "gradients", "optimizer state"):
        row = report.row(quantity)
        assert row.measured == row.predicted, (case, quantity, row)


@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_audit_agrees_with_the_prediction(case, audited):
    plan, reports = audited[case]
    pipe = plan.pipeline
    assert pipe is not None and pipe.schedule == CASES[case]["schedule"], case
    described = [r for r in reports if r.device.is_described]
    assert len(described) == MESH["dp"], (case, [str(r.device) for r in reports])   # one pipeline device per dp rank
    for report in described:
        assert report.device.activations == plan.predicted.memory.activations, case
        _check_described(case, plan, report)
    for report in reports:
        if not report.device.is_described:   # only what the plan gives per device
            assert {r.quantity for r in report.rows if r.unit == "bytes"} == {"activations saved for backward"}, \
                (case, str(report))
        if pipe.schedule == "interleaved-1f1b":
            continue   # test_interleaved_activations_in_flight
        row = report.row("activations saved for backward")
        assert row.predicted <= row.measured <= row.predicted + _activation_slack(pipe, report.device.stages), \
            (case, str(report.device), row)


# search/pipeline.in_flight follows torch's interleaved order (pp2, m=4: device 0's first stage holds all 4
# microbatches, its second 2; device 1's 3 and 1); it used to split the warm-up evenly (+11% and -27% off)
@pytest.mark.parametrize("case", [c for c, kw in CASES.items() if kw["schedule"] == "interleaved-1f1b"])
def test_interleaved_activations_in_flight(case, audited):
    plan, reports = audited[case]
    for report in reports:
        row = report.row("activations saved for backward")
        # 3% over the received buffers: device 1 (stages 1 and 3) measured 73,088 B against 62,848 + 8,704 (2% left
        # unexplained, 2026-11-28); the even split this replaced was 27% over device 1 and 11% under device 0
        assert row.predicted <= row.measured <= 1.03 * (row.predicted + _activation_slack(plan.pipeline,
                                                                                          report.device.stages)), \
            (case, str(report.device), row)


def test_pipelined_audit_times_the_step_on_every_rank(audited):
    plan, reports = audited[TIMED]
    for report in reports:
        step = report.row("step time")
        assert step.unit == "seconds" and step.predicted == plan.predicted.step_time and step.measured > 0
        exposed = {r.quantity for r in report.rows if r.quantity.startswith("exposed comm time")}
        # the pipeline axis has none (torch waits on its sends, bubble and link together); dp only where predicted
        assert exposed == ({"exposed comm time on dp"} if report.device.is_described else set()), str(report)
        for r in report.rows:
            if r.quantity in exposed:
                assert 0 <= r.measured <= step.measured and r.predicted > 0
        assert str(report.device) in str(report) and " ms" in str(report)


def test_unpipelined_audit_takes_targets_as_train_step_does():
    """audit(..., loss_fn=f, targets=y) calls f(outputs, y) on an unpipelined module as train_step does."""
    from autopar.testing import run_threaded
    x, y = pipeline_batch()
    both = run_threaded(2, _unpipelined, pipeline_gpt(), x, y)
    for with_targets, without in both:
        assert with_targets.device is None and "pipeline" not in str(with_targets)
        for r in with_targets.rows:   # the same step, the same measurement: the loss reads no activation kept
            assert r.measured == without.row(r.quantity).measured, r


def _unpipelined(rank, model, x, y):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy="ddp", hardware="cpu")
    (local_x,), (local_y,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    with_targets = autopar.audit(pm, local_x, loss_fn=gpt_loss, targets=local_y, optimizer=opt)
    without = autopar.audit(pm, local_x, loss_fn=lambda logits: gpt_loss(logits, local_y), optimizer=opt)
    return with_targets, without
