"""When HiGHS stops at its time limit without a plan, the greedy's plan (greedy.py) is used, and
its distance from a lower bound on the ILP's optimum is reported; planning is deterministic."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from scipy.optimize import OptimizeResult

import autopar
from autopar.planning import planner
from autopar.search import ilp as search
from autopar.planning.planner import plan_captured
from autopar.capture.export import INPUT, OUTPUT, capture
from autopar.cost.terms import first_meta
from autopar.search.solution import GREEDY, GREEDY_NO_BOUND
from autopar.search.greedy import allowed_strategies, bound_gap, greedy, objective
from autopar.testing import GPT, MLP, GPTConfig, run_threaded

MESH = {"a": 2, "b": 2}


@pytest.fixture(autouse=True)
def _highs_runs_every_time(monkeypatch):
    """These tests watch (or stand in for) HiGHS's calls: none may be answered from the solve cache."""
    monkeypatch.setenv("AUTOPAR_SOLVE_CACHE", "0")


def _gpt():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8)
    return GPT(cfg), torch.randint(0, 32, (8, 8))


def _mlp():
    torch.manual_seed(0)
    return MLP([16, 64, 64, 16]), torch.randn(8, 16)


def _planned(cap, mesh, **kwargs):
    """The plan of planner.plan_captured, and the (Problem, Roles) it searched (from its calls to solve): auto's
    own search alone, not held against named strategies (planner._against_named), which would search again."""
    searched = []
    real = search.solve

    def record(prob, roles, *args, **kw):
        searched.append((prob, roles))
        return real(prob, roles, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(planner, "solve", record)
        mp.setattr(planner, "HELD_AGAINST", ())
        plan = plan_captured(cap, mesh, hardware="cpu", **kwargs)
    return plan, searched


def _without_timings(plan) -> dict:
    d = json.loads(plan.to_json())
    d["stats"] = {k: v for k, v in d["stats"].items() if not k.endswith("_seconds") or k == "objective_seconds"}
    return d


def _assert_valid(plan, prob, roles, memory_limit):
    """Every node takes a strategy its roles allow, inputs and output split the batch alike, and the
    predicted memory fits."""
    allowed = allowed_strategies(prob, roles)
    for name, ns in prob.strategies.items():
        index = ns.strategies.index(plan.node_strategies[name])
        first = prob.canonical.get(name, name)
        assert index in allowed[first], (name, plan.node_strategies[name])
        if first != name:
            assert plan.node_strategies[name] == plan.node_strategies[first]
    batch = {prob.mesh.axis_names.index(a) for a in plan.batch_axes}
    for name in prob.strategies:
        info = prob.cap.info[name]
        if info.kind == OUTPUT or (info.kind == INPUT and first_meta(info.meta).ndim > 0):
            layout = plan.node_strategies[name].output
            assert {a for a, p in enumerate(layout) if p == "S(0)"} == batch, (name, layout, plan.batch_axes)
    if memory_limit is not None:
        assert plan.predicted.memory.total <= memory_limit


def test_a_tiny_time_limit_gets_the_greedy_plan_valid_and_no_better_than_the_ilp():
    model, x = _gpt()
    cap = capture(model, (x,))
    free = plan_captured(cap, MESH, hardware="cpu")
    limit = 0.7 * free.predicted.memory.total   # binding: the fastest plan does not fit
    # 1 us: HiGHS stops before its presolve is done, and so does the LP relaxation for the bound
    plan, searched = _planned(cap, MESH, memory_limit=limit, time_limit=1e-6)
    assert plan.stats["status"] in (GREEDY, GREEDY_NO_BOUND), plan.stats["status"]
    assert 0.0 <= plan.stats["mip_gap"] <= 1.0
    assert "search: greedy fallback" in str(plan)
    (prob, roles), = searched
    _assert_valid(plan, prob, roles, limit)
    # what the ILP finds with time, without recomputation (which the greedy never uses; with it, the
    # ILP can only do better)
    best = search.solve(prob, roles, limit)
    assert best.status == "optimal"
    # the greedy's plan is priced as the search prices its own (ilp._cheapest prunes other searches by it):
    # left at 0 it would prune every search after it
    again = search.solve(prob, roles, limit, time_limit=1e-6)
    assert again.status in (GREEDY, GREEDY_NO_BOUND) and again.priced >= again.objective > 0
    assert plan.stats["objective_seconds"] >= best.objective * (1 - best.mip_gap) - 1e-15


@pytest.mark.parametrize("highs_reports_bound", [True, False])
def test_the_gap_is_measured_against_a_lower_bound_on_the_ilp(monkeypatch, highs_reports_bound):
    """HiGHS stops without a plan (simulated: its result is replaced by a time-limit one). With a
    dual bound from HiGHS, the gap is measured against it; without one (what scipy reports when
    HiGHS has no plan yet), against the LP relaxation's optimum, which the search solves first."""
    model, x = _mlp()
    cap = capture(model, (x,))
    real_milp, real_linprog = search.milp, search.linprog
    bounds, relaxations = [], []

    def relaxed(*args, **kwargs):
        res = real_linprog(*args, **kwargs)
        relaxations.append(res.fun)
        return res

    def stopped(*args, **kwargs):
        res = real_milp(*args, **kwargs)
        bounds.append(res.mip_dual_bound)
        return OptimizeResult(x=None, fun=None, status=1, success=False, message="Time limit reached.",
                              mip_dual_bound=res.mip_dual_bound if highs_reports_bound else None, mip_gap=None)

    monkeypatch.setattr(search, "linprog", relaxed)
    monkeypatch.setattr(search, "milp", stopped)
    # the relaxation is not taken as the answer where integral: HiGHS must branch, and stop
    monkeypatch.setattr(search, "integral", lambda res, integer: False)
    plan, searched = _planned(cap, MESH)
    monkeypatch.undo()
    (prob, roles), = searched
    assert plan.stats["status"] == GREEDY
    # the last branch and bound is over the whole program (the one over the variables reduced costs left
    # stopped first): its dual bound, or the relaxation's optimum
    bound = (bounds[-1] if highs_reports_bound else relaxations[0]) / search.TIME_SCALE
    assert len(relaxations) == 1 and len(bounds) == 2
    assert plan.stats["mip_gap"] == bound_gap(plan.stats["objective_seconds"], bound)
    assert 0.0 <= plan.stats["mip_gap"] <= 1.0
    _assert_valid(plan, prob, roles, None)
    optimum = search.solve(prob, roles, None)
    # bound <= the optimum <= the greedy's plan (HiGHS's plan is within its gap of the optimum)
    assert bound <= optimum.objective * (1 + 1e-9)
    assert optimum.objective * (1 - optimum.mip_gap) <= plan.stats["objective_seconds"] * (1 + 1e-9)
    gap = f"{100 * plan.stats['mip_gap']:.2g}%"
    assert f"search: greedy fallback, within {gap} of the ILP bound" in str(plan)
    back = autopar.Plan.from_json(plan.to_json())
    assert back.stats == plan.stats and str(back) == str(plan)


def test_without_a_plan_that_fits_the_fallback_keeps_the_infeasible_answer():
    model, x = _mlp()
    with pytest.raises(autopar.InfeasiblePlanError):
        autopar.plan(model, (x,), MESH, hardware="cpu", memory_limit=1, time_limit=1e-6)


@pytest.mark.parametrize("make", [_mlp, _gpt])
@pytest.mark.parametrize("mesh", [{"dp": 4}, MESH])
def test_the_greedy_is_deterministic_prices_as_the_ilp_and_finds_its_optimum_on_small_models(make, mesh):
    model, x = make()
    _, searched = _planned(capture(model, (x,)), mesh)
    (prob, roles), = searched
    ilp = search.solve(prob, roles, None)
    assert objective(prob, ilp.choice) == pytest.approx(ilp.objective, rel=1e-9)
    found = greedy(prob, roles, None)
    assert found.status == GREEDY and found.objective == objective(prob, found.choice)
    again = greedy(prob, roles, None)
    assert (again.choice, again.batch_axes, again.objective) == (found.choice, found.batch_axes, found.objective)
    # measured equal to the ILP's optimum on these (the beam holds every frontier layout of a chain)
    assert ilp.objective * (1 - ilp.mip_gap - 1e-9) <= found.objective <= ilp.objective * (1 + 1e-3)


def _plan_json_on_rank(rank, model, x):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    return autopar.parallelize(copy.deepcopy(model), mesh, (x,), hardware="cpu").plan.to_json()


def test_planning_is_deterministic_and_every_rank_gets_rank_0s_plan():
    model, x = _gpt()
    first = autopar.plan(model, (x,), MESH, hardware="cpu")
    second = autopar.plan(model, (x,), MESH, hardware="cpu")
    assert _without_timings(first) == _without_timings(second)   # stage timings differ run to run
    texts = run_threaded(4, _plan_json_on_rank, model, x)
    assert all(t == texts[0] for t in texts[1:])
    assert _without_timings(autopar.Plan.from_json(texts[0])) == _without_timings(first)


def test_no_time_limit_is_accepted_and_a_bad_one_is_a_plan_error(monkeypatch):
    model, x = _mlp()
    seen = []
    real_milp, real_linprog = search.milp, search.linprog
    monkeypatch.setattr(search, "milp", lambda *a, **k: seen.append(k["options"]) or real_milp(*a, **k))
    monkeypatch.setattr(search, "linprog", lambda *a, **k: seen.append(k["options"]) or real_linprog(*a, **k))
    unlimited = autopar.plan(model, (x,), MESH, hardware="cpu", time_limit=None)
    assert seen and all("time_limit" not in o for o in seen)   # HiGHS gets no clock to ration by
    assert _without_timings(unlimited) == _without_timings(autopar.plan(model, (x,), MESH, hardware="cpu"))
    for bad in (0, -1.0, "60", True, float("nan")):
        with pytest.raises(autopar.PlanError, match="time_limit must be a positive number of seconds"):
            autopar.plan(model, (x,), MESH, hardware="cpu", time_limit=bad)
