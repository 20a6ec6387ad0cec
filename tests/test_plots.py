"""Pictures of a plan (autopar/planning/plots.py): memory bars per strategy, and a pipeline's schedule."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.testing import GPT, GPTConfig

pytest.importorskip("matplotlib")
from autopar.planning.plots import PARTS, memory_figure, schedule_figure, schedule_timeline  # noqa: E402


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4)), torch.randint(0, 64, (8, 16))


def test_memory_bars_stack_each_plans_parts(tmp_path):
    model, x = _gpt()
    plans = autopar.compare(model, (x,), {"dp": 2}, strategies=["ddp", "fsdp"], hardware="cpu")
    fig = memory_figure(plans, memory_limit="1MB")
    ax = fig.axes[0]
    for i, plan in enumerate(plans.values()):   # each bar's pieces add up to the plan's total
        tops = [b.get_height() for b in ax.patches[i::len(plans)]]
        drawn = sum(float(getattr(plan.predicted.memory, p)) for p in PARTS) / 2 ** 20   # MiB: a small model
        assert sum(tops) == pytest.approx(drawn) == pytest.approx(plan.predicted.memory.total / 2 ** 20)
    assert ax.get_ylabel() == "MiB per device"
    fig.savefig(tmp_path / "memory.png")
    assert (tmp_path / "memory.png").stat().st_size > 1000


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_schedule_timeline_keeps_the_dependencies_and_the_predicted_step(schedule, tmp_path):
    model, x = _gpt()
    plan = autopar.plan(model, (x,), {"pp": 4}, hardware="cpu", pipeline_axis="pp", microbatches=4,
                        schedule=schedule)
    pipe = plan.pipeline
    timeline = schedule_timeline(plan)
    end = {(kind, s, i): e for s, work in enumerate(timeline) for kind, i, _, e in work}
    start = {(kind, s, i): b for s, work in enumerate(timeline) for kind, i, b, _ in work}
    for s in range(pipe.num_stages):
        assert sorted((k, i) for k, i, _, _ in timeline[s]) == sorted([("B", i) for i in range(4)] + [("F", i) for i in range(4)])
        spans = sorted((b, e) for _, _, b, e in timeline[s])
        assert all(e0 <= b1 + 1e-12 for (_, e0), (b1, _) in zip(spans, spans[1:]))   # one thing at a time
        for i in range(4):
            if s > 0:
                assert start["F", s, i] >= end["F", s - 1, i] - 1e-12
            if s < pipe.num_stages - 1:
                assert start["B", s, i] >= end["B", s + 1, i] - 1e-12
    makespan = max(e for e in end.values())
    slowest = max(st.time for st in pipe.stages)
    assert 4 * slowest <= makespan <= pipe.step_time * (1 + 1e-9)   # the prediction bounds the picture's step
    schedule_figure(plan).savefig(tmp_path / "schedule.png")


def test_schedules_not_drawn_say_so():
    model, x = _gpt()
    plan = autopar.plan(model, (x,), {"pp": 2}, hardware="cpu", pipeline_axis="pp", microbatches=4,
                        schedule="zero-bubble")
    with pytest.raises(autopar.AutoparError, match="not 'zero-bubble' yet"):
        schedule_timeline(plan)
    with pytest.raises(autopar.AutoparError, match="no pipeline"):
        schedule_timeline(autopar.plan(model, (x,), {"dp": 2}, hardware="cpu"))
