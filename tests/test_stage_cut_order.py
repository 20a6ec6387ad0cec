"""The planner tries the ways to run a pipeline's stages (recompute sets x held weights or not x stages per device)
lowest step floor first and stops at the first floor above the best plan so far (planner._cut_stages); the answer
is the plain loop's, which tries them in their listed order and skips a way whose floor the best so far beats:
the same pipeline, prediction, held weights and stacks, or the same first failure. Planned on a small GPT over
pp 2 x dp 2 (FSDP on dp, interleaved 1F1B, checkpointing auto) under limits from loose to none fitting."""
import pytest
import torch

import autopar
from autopar.planning import planner
from autopar.cost.predict import group_redistributions, transient_bytes
from autopar.errors import PipelineError
from autopar.search.stage_costs import device_prediction, op_basis, op_costs
from autopar.search.stage_partition import partition, step_floor
from autopar.testing.models import GPT, GPTConfig


def _plain(prob, sol, reshard_after_forward, recomputable, axis, m, schedule, limit, stages_per_device=(1,)):
    """planner._cut_stages as it was: every way in its listed order, skipped where the best so far beats its floor."""
    ways = {True: [False], False: [True], None: [False, True]}[reshard_after_forward]
    p = prob.mesh.axis_sizes[prob.mesh.axis_index(axis)]
    groups = group_redistributions(prob, sol.choice)
    basis = op_basis(prob, sol.choice, groups)
    best, failure = None, None
    for stacks in recomputable:
        transient = float(transient_bytes(prob, sol.choice, groups, stacks, False))
        for held in ways:
            costs = op_costs(prob, basis, held=held, stacks=stacks)
            for v in stages_per_device:
                if best is not None and step_floor(costs, p, v, m, schedule) >= best[1].step_time:
                    continue
                try:
                    pipe = partition(prob, costs, axis=axis, microbatches=m, schedule=schedule, stages_per_device=v,
                                     memory_limit=limit, transient=transient)
                except PipelineError as e:
                    failure = failure or e
                    continue
                pred = device_prediction(prob, costs, pipe, transient)
                if best is None or pred.step_time < best[1].step_time:
                    best = (pipe, pred, held, stacks)
    if best is None:
        raise failure
    return best


def _outcome(cut, *args, **kwargs):
    try:
        pipe, pred, held, stacks = cut(*args, **kwargs)
    except PipelineError as e:
        return str(e)
    return pipe, pred, held, [st.key for st in stacks]


# bytes: the plans of these limits differ (held or not, no recompute, per-op or full, 2 or 4 stages per device)
@pytest.mark.parametrize("limit", [None, 2_000_000_000, 1_600_000, 1_300_000, 1_100_000, 1_000_000, 900_000, 700_000,
                                   600_000])
def test_cut_floor_first_matches_the_plain_loop(monkeypatch, limit):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8))
    tokens = torch.randint(0, 64, (8, 16))
    calls = []
    cut = planner._cut_stages

    def recorded(*args, **kwargs):
        calls.append((args, kwargs))
        return cut(*args, **kwargs)

    monkeypatch.setattr(planner, "_cut_stages", recorded)
    autopar.plan(model, (tokens,), {"pp": 2, "dp": 2}, hardware="h100", strategy="fsdp", pipeline_axis="pp",
                 schedule="interleaved-1f1b", microbatches=4, checkpointing="auto", memory_limit=limit)
    assert calls
    for args, kwargs in calls:
        assert _outcome(cut, *args, **kwargs) == _outcome(_plain, *args, **kwargs)
    if limit is not None:   # a limit no cut meets (the search stops before it on this model): the same first failure
        args = args[:7] + (100_000,) + args[8:]
        failed = _outcome(cut, *args, **kwargs)
        assert isinstance(failed, str) and failed == _outcome(_plain, *args, **kwargs)
