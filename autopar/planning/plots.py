"""Pictures of a plan: memory per device by part, and a pipeline's schedule with its bubbles.

matplotlib is an optional extra (`pip install autopar[plot]`): nothing else imports this module.
Figures are made with matplotlib.figure.Figure, not pyplot, so no global state changes and no
display is needed: `memory_figure(...).savefig("memory.png")`.
"""
from __future__ import annotations

import cost_models as cm

from ..errors import AutoparError
from ..search.pipeline import GPIPE, ONE_F_ONE_B
from .result import Plan

PARTS = ("params", "master", "grads", "optimizer", "activations", "transient")   # Memory's fields, stacked
# forward, backward: a stage's time per microbatch splits as the cost model prices it (backward = 2 forwards)
FORWARD_SHARE = 1 / 3


def _figure(**kwargs):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise AutoparError("autopar's plots need matplotlib: pip install 'autopar[plot]' (or matplotlib)") from None
    return Figure(**kwargs)


def memory_figure(plans, memory_limit=None, title: str = "predicted memory per device"):
    """Stacked bars of predicted memory per device, one bar per plan: weights, master copies, gradients,
    optimizer state, activations and the largest working set, against `memory_limit` (bytes or "80GB").
    `plans`: a Plan, or {label: Plan} (autopar.compare's result; its errors are left out)."""
    if isinstance(plans, Plan):
        plans = {plans.strategy: plans}
    plans = {k: p for k, p in plans.items() if isinstance(p, Plan)}
    if not plans:
        raise AutoparError("memory_figure: no plan to draw")
    fig = _figure(figsize=(1.6 + 1.1 * len(plans), 4.5), layout="constrained")
    ax = fig.add_subplot()
    most = max(float(p.predicted.memory.total) for p in plans.values())
    unit, scale = ("GiB", 2.0 ** 30) if most >= 2 ** 30 else ("MiB", 2.0 ** 20)
    bottoms = [0.0] * len(plans)
    for part in PARTS:
        heights = [float(getattr(p.predicted.memory, part)) / scale for p in plans.values()]
        if any(heights):
            ax.bar(list(plans), heights, bottom=bottoms, label=part)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    if memory_limit is not None:
        limit = cm.parse_bytes(memory_limit) / scale
        ax.axhline(limit, color="black", linestyle="--", linewidth=1)
        ax.text(len(plans) - 0.5, limit, f" limit {cm.format_bytes(limit * scale)}", va="bottom", ha="right")
    ax.set_ylabel(f"{unit} per device")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize="small")
    return fig


def schedule_timeline(plan: Plan) -> list[list[tuple]]:
    """Per pipeline device: (kind "F" or "B", microbatch, start, end) in seconds, as the plan's schedule
    runs one step with each stage's predicted time (forward a third of it, backward the rest).
    GPipe and 1F1B; interleaving and zero bubble order work across virtual stages and are not drawn."""
    pipe = plan.pipeline
    if pipe is None:
        raise AutoparError("schedule_timeline: the plan has no pipeline (plan with pipeline_axis=...)")
    if pipe.schedule not in (GPIPE, ONE_F_ONE_B):
        raise AutoparError(f"schedule_timeline draws gpipe and 1f1b, not {pipe.schedule!r} yet")
    p, m = pipe.num_stages, pipe.microbatches
    fwd = [s.time * FORWARD_SHARE for s in pipe.stages]
    bwd = [s.time - f for s, f in zip(pipe.stages, fwd)]
    orders = [_order(pipe.schedule, s, p, m) for s in range(p)]
    done: dict = {}          # (kind, stage, microbatch) -> end time
    free = [0.0] * p
    out = [[] for _ in range(p)]
    cursor = [0] * p
    while any(cursor[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if cursor[s] == len(orders[s]):
                continue
            kind, i = orders[s][cursor[s]]
            need = (("F", s - 1, i) if s > 0 else None) if kind == "F" else \
                (("B", s + 1, i) if s < p - 1 else ("F", s, i))
            if need is not None and need not in done:
                continue
            start = max(free[s], done.get(need, 0.0))
            end = start + (fwd[s] if kind == "F" else bwd[s])
            done[(kind, s, i)] = free[s] = end
            out[s].append((kind, i, start, end))
            cursor[s] += 1
            progressed = True
        if not progressed:
            raise AutoparError(f"schedule_timeline: the {pipe.schedule} order deadlocked; report this")
    return out


def _order(schedule: str, stage: int, p: int, m: int) -> list[tuple]:
    """The work of `stage` in the order the schedule issues it."""
    if schedule == GPIPE:
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(m, p - stage - 1)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def schedule_figure(plan: Plan):
    """The pipeline's step as devices x time: forwards and backwards of each microbatch, idle gaps (the bubble)."""
    timeline = schedule_timeline(plan)
    pipe = plan.pipeline
    fig = _figure(figsize=(9, 0.6 + 0.5 * len(timeline)), layout="constrained")
    ax = fig.add_subplot()
    colors = {"F": "tab:blue", "B": "tab:orange"}
    for s, work in enumerate(timeline):
        for kind, i, start, end in work:
            ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (s - 0.4, 0.8), facecolors=colors[kind],
                           edgecolor="white")
            ax.text((start + end) / 2 * 1e3, s, f"{kind}{i}", ha="center", va="center", fontsize="x-small")
    ax.set_yticks(range(len(timeline)), [f"stage {s}" for s in range(len(timeline))])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"{pipe.schedule}, {pipe.microbatches} microbatches over {pipe.axis}: bubble {pipe.bubble:.2f}")
    return fig
