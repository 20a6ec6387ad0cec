"""The plan's schedule (planning/schedule.py): the runtime's buckets, FSDP layer groups and re-gathered activations,
decided with the plan, saved in its JSON (format 2), and read by the runtime.

The schedule must be the grouping the plan prices (its collectives name each bucket's and group's weights);
the module must run the schedule it is given, not one it derives again (an edited schedule changes what it
launches, and still trains equal to one device); a plan of format 1 must run as that autopar ran it; a schedule
that does not fit the model is refused by name.
"""
import copy
import json
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.capture.export import capture
from autopar.errors import PlanError
from autopar.planning.schedule import Bucket, Schedule
from autopar.testing import GPT, GPTConfig, gpt_loss, run_threaded, single_device_reference

STEPS, LR = 2, 1e-2


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)


def _fqn_of(model, x) -> dict:
    cap = capture(model, (x,))
    return {n: info.target_name for n, info in cap.info.items()}


def _records(plan, prefix: str) -> dict:
    """where -> the weights (as graph nodes) its collectives carry, for the records whose `where` starts with prefix."""
    out = {}
    for c in plan.collectives:
        if c.where.startswith(prefix):
            out.setdefault(c.where, set()).update(c.tensor.split(","))
    return out


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp", "tp+sp"])
def test_the_schedule_is_the_grouping_the_plan_prices(strategy):
    model, (x, _) = _model(), _batch()
    plan = autopar.plan(model, x, {"dp": 2} if strategy != "tp+sp" else {"tp": 2}, strategy=strategy,
                        bucket_bytes=4096)
    fqn, sched = _fqn_of(model, x), plan.schedule
    named = {k: {fqn[n] for n in nodes} for k, nodes in _records(plan, "gradient bucket ").items()
             if "ZeRO" not in k}
    assert [set(b.weights) for b in sched.grad_buckets.get(0, ())] == \
        [named[f"gradient bucket {k}"] for k in range(len(named))]
    for level, prefix in ((2, "gradient bucket ZeRO-2 "), (1, "ZeRO-1 gradient bucket ")):
        named = {k: {fqn[n] for n in nodes} for k, nodes in _records(plan, prefix).items()}
        assert [set(b.weights) for b in sched.zero_buckets.get(level, ())] == \
            [named[f"{prefix}{k}"] for k in range(len(named))]
    layers = {k: {fqn[n] for n in nodes} for k, nodes in _records(plan, "layer ").items()}
    assert sorted(map(sorted, (set(g.weights) for g in sched.layer_groups))) == sorted(map(sorted, layers.values()))
    # each strategy exercises its part of the schedule
    assert {"ddp": len(sched.grad_buckets[0]) > 2, "zero1": len(sched.zero_buckets[1]) > 2,
            "zero2": len(sched.zero_buckets[2]) > 2, "fsdp": len(sched.layer_groups) == 3,
            "tp+sp": bool(sched.regathered) and plan.regather_activations}[strategy]
    assert autopar.Plan.from_json(plan.to_json()) == plan
    shown = {"ddp": f"{len(sched.grad_buckets[0])} gradient buckets", "zero1": "ZeRO-1 buckets",
             "zero2": "ZeRO-2 buckets", "fsdp": "3 FSDP layer groups", "tp+sp": "gathered again in backward"}
    assert shown[strategy] in next(line for line in str(plan).splitlines() if line.startswith("runtime schedule:"))


def _train(rank, model, x, y, plan_json, optimizer):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), plan=autopar.Plan.from_json(plan_json),
                             record_comm=True)
    opt = autopar.ShardedOptimizer(pm, optimizer, lr=LR)
    (xi,), (yi,) = pm.plan.local_inputs(x), pm.plan.local_targets(y)
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        gpt_loss(pm(xi), yi).backward()
        opt.step()
    buckets = [[pm.grad_buckets.slots[i].name for i in b.slots] for b in pm.grad_buckets.buckets]
    groups = [[m.param_name for m in g.members] for g in pm.gathered.groups]
    reduces = sum(1 for kind, _, _, phase in pm.comm.log.records if kind == "all_reduce" and phase == "backward")
    return {"params": {k: v.clone() for k, v in pm.state_dict(full=True).items()}, "buckets": buckets,
            "groups": groups, "backward_all_reduces": reduces, "lowering": pm.plan.schedule.lowering}


def _check_equal_to_one_device(results, model, x, y, optimizer):
    ref = single_device_reference(lambda: copy.deepcopy(model), x, y, gpt_loss, steps=STEPS, lr=LR,
                                  optimizer=optimizer)
    for r in results:
        for name, p in r["params"].items():
            torch.testing.assert_close(p, ref["params"][name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW], ids=["sgd", "adamw"])
def test_the_module_runs_the_buckets_the_schedule_lists(optimizer):
    """An edited schedule (every weight in one bucket) is what the module launches: one all-reduce per backward,
    not the planned buckets' count; and it still trains equal to one device."""
    model, (x, y) = _model(), _batch()
    plan = autopar.plan(model, x, {"dp": 2}, strategy="ddp", bucket_bytes=4096)
    planned = plan.schedule.grad_buckets[0]
    assert len(planned) > 2
    one = Bucket(planned[0].axes, tuple(w for b in planned for w in b.weights))
    edited = replace(plan, schedule=replace(plan.schedule, grad_buckets={0: (one,)}))
    for p, num_buckets in ((plan, len(planned)), (edited, 1)):
        results = run_threaded(2, _train, model, x, y, p.to_json(), optimizer)
        for r in results:
            assert r["buckets"] == [list(b.weights) for b in p.schedule.grad_buckets[0]]
            assert r["backward_all_reduces"] == num_buckets * STEPS
        _check_equal_to_one_device(results, model, x, y, optimizer)


def _format_1(plan) -> str:
    d = json.loads(plan.to_json())
    d["format_version"] = 1
    del d["schedule"]
    return json.dumps(d)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_format_1_plan_runs_as_that_autopar_ran_it(strategy):
    """A plan saved before the schedule reads (schedule None) and runs with the buckets and layer groups the
    runtime used to derive, which are the ones the plan priced."""
    model, (x, y) = _model(), _batch()
    plan = autopar.plan(model, x, {"dp": 2}, strategy=strategy, bucket_bytes=4096)
    old = autopar.Plan.from_json(_format_1(plan))
    assert old == replace(plan, schedule=None)
    results = run_threaded(2, _train, model, x, y, _format_1(plan), torch.optim.AdamW)
    for r in results:
        assert r["buckets"] == [list(b.weights) for b in plan.schedule.grad_buckets[0]]
        assert r["groups"] == [list(g.weights) for g in plan.schedule.layer_groups]
    _check_equal_to_one_device(results, model, x, y, torch.optim.AdamW)


def _parallelize(rank, model, x, plan_json):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    autopar.parallelize(copy.deepcopy(model), mesh, (x,), plan=autopar.Plan.from_json(plan_json))


def test_a_schedule_that_does_not_fit_the_model_is_refused_by_name():
    model, (x, _) = _model(), _batch()
    ddp = autopar.plan(model, x, {"dp": 2}, strategy="ddp")
    first, *rest = ddp.schedule.grad_buckets[0]
    dropped = first.weights[0]
    lost = replace(ddp, schedule=replace(ddp.schedule, grad_buckets={0: (Bucket(first.axes, first.weights[1:]),
                                                                       *rest)}))
    with pytest.raises(Exception, match=dropped.replace(".", r"\.")) as e:
        run_threaded(2, _parallelize, model, x, lost.to_json())
    assert "gradient buckets do not fit" in str(e.value)
    fsdp = autopar.plan(model, x, {"dp": 2}, strategy="fsdp")
    ungrouped = replace(fsdp, schedule=replace(fsdp.schedule, layer_groups=fsdp.schedule.layer_groups[1:]))
    with pytest.raises(Exception, match="layer groups list no group"):
        run_threaded(2, _parallelize, model, x, ungrouped.to_json())


def test_schedule_json_round_trip():
    s = Schedule({0: (Bucket(("dp",), ("a.weight", "b.weight")),)}, {2: (Bucket(("dp",), ("c",)),)}, (),
                 frozenset({("mm", 1)}), (("x", 3),))
    assert Schedule.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert issubclass(PlanError, autopar.AutoparError)


def _format_3(plan) -> str:
    d = json.loads(plan.to_json())
    assert d["format_version"] == 4 and "lowering" in d["schedule"]
    d["format_version"] = 3
    del d["schedule"]["lowering"]
    return json.dumps(d)


@pytest.mark.parametrize("strategy,options", [
    ("ddp", {}), ("fsdp", {"precision": "bf16-mixed", "checkpointing": "per-op"})], ids=["ddp", "fsdp-bf16-per-op"])
def test_a_format_3_plan_runs_as_the_plan_that_records_its_lowering(strategy, options):
    """A plan saved before the schedule recorded its Lowering (partial gradients, gradient scales, casts, grouped
    weight uses, recomputed blocks) reads, its lowering made by planning when the module is built: the same one
    the plan records, and the same training, bit for bit."""
    model, (x, y) = _model(), _batch()
    plan = autopar.plan(model, x, {"dp": 2}, strategy=strategy, bucket_bytes=4096, **options)
    low = plan.schedule.lowering
    assert low is not None and low.partial_gradients if strategy == "ddp" else low.grouped and low.casts
    if options:
        assert plan.checkpointed and low.recomputed and any(r.policy is not None for r in low.recomputed)
    old = autopar.Plan.from_json(_format_3(plan))
    assert old.schedule.lowering is None
    assert old == replace(plan, schedule=replace(plan.schedule, lowering=None))
    new_runs = run_threaded(2, _train, model, x, y, plan.to_json(), torch.optim.AdamW)
    old_runs = run_threaded(2, _train, model, x, y, _format_3(plan), torch.optim.AdamW)
    for new, old_run in zip(new_runs, old_runs):
        assert new["lowering"] == old_run["lowering"] == low
        assert new["buckets"] == old_run["buckets"] and new["groups"] == old_run["groups"]
        for name, p in new["params"].items():
            assert torch.equal(p, old_run["params"][name]), name
