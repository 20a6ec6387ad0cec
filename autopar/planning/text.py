"""A Plan as text: the table `print(plan)` shows (Plan.__str__ calls render).

Reads only a Plan's fields, so it imports nothing of result.py.
"""
from __future__ import annotations

from cost_models import format_bytes

from ..search.pipeline import PipelinePlan
from ..search.solution import GREEDY, GREEDY_NO_BOUND, OPTIMAL, TIME_LIMIT
from ..sharding.placement import format_placements


def render(plan) -> str:
    """The plan as a person checks it: one row per module (parameter layouts, activations, collectives),
    then memory per device, the pipeline, what backward makes again, communication and the step time."""
    names = plan.mesh.axis_names
    lines = [f"autopar plan  strategy={plan.strategy}  mesh: {plan.mesh}  hardware={plan.hardware}  "
             f"batch split over: {', '.join(plan.batch_axes) or 'none'}"]
    rows = []
    by_module: dict[str, dict] = {}
    for fqn, pl in plan.param_placements.items():
        mod = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        by_module.setdefault(mod, {"params": [], "acts": [], "colls": {}})["params"].append(
            f"{fqn.rsplit('.', 1)[-1]} {format_placements(pl, names)}")
    for node, s in plan.node_strategies.items():
        mod = plan.module_paths.get(node)
        if mod is None or node.startswith("p_") or node == "output":
            continue
        by_module.setdefault(mod, {"params": [], "acts": [], "colls": {}})["acts"].append(
            format_placements(s.output, names))
    for c in plan.collectives:
        d = by_module.setdefault(c.module_path, {"params": [], "acts": [], "colls": {}})["colls"]
        key = f"{c.kind}@{c.axis}"
        d[key] = d.get(key, 0) + 1
    header = ("module", "parameters (storage)", "activations out", "collectives per step")
    first_op: dict = {}   # module -> its first op's place in the graph: rows in forward order
    for i, node in enumerate(n for n in plan.node_strategies if not n.startswith("p_")):
        first_op.setdefault(plan.module_paths.get(node), i)
    order = sorted(by_module, key=lambda mod: first_op.get(mod, len(first_op)))
    for mod, d in ((m, by_module[m]) for m in order):
        acts = d["acts"][-1] if d["acts"] else "-"
        colls = ", ".join(f"{k} x{n}" for k, n in d["colls"].items()) or "-"
        params = "; ".join(d["params"]) or "-"
        rows.append((mod or "<root>", params, acts, colls))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
    widths = [min(w, 60) for w in widths]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines.append(fmt.format(*header))
    lines.append(fmt.format(*("-" * w for w in widths)))
    for r in rows:
        lines.append(fmt.format(*r))
    m = plan.predicted.memory
    lines.append("")
    parts = ("params", "master", "grads", "optimizer", "activations", "transient", "total")
    lines.append("predicted per device: " + ", ".join(
        f"{k} {format_bytes(getattr(m, k))}" for k in parts if k != "master" or getattr(m, k)))
    if plan.param_zero:
        by_kind: dict = {}
        for lvl, axes in plan.param_zero.values():
            key = f"ZeRO-{lvl} over {'x'.join(axes)}"
            by_kind[key] = by_kind.get(key, 0) + 1
        lines.append("optimizer state split: " + ", ".join(f"{k} ({n} parameters)" for k, n in by_kind.items()))
    if plan.pipeline is not None:
        lines += pipeline_lines(plan.pipeline)
    if plan.float8_linears:
        lines.append(float8_line(plan))
    lines += backward_lines(plan)
    if plan.schedule is not None and schedule_line(plan.schedule):
        lines.append(schedule_line(plan.schedule))
    return "\n".join(lines + step_lines(plan))


def step_lines(plan) -> list:
    """The links each axis talks over, what it sends and how long it takes, the step time, the search, and
    how long planning took."""
    lines = [links_line(plan.links, plan.mesh)] if plan.links else []
    p = plan.predicted
    lines.append("communication per step: " + ", ".join(
        f"{a} {format_bytes(p.comm_bytes[a])} ({p.comm_time[a] * 1e3:.3f} ms, "
        f"{p.hidden_comm_time[a] * 1e3:.3f} ms of it hidden behind compute)" for a in plan.mesh.axis_names))
    lines.append(f"compute {p.compute_time * 1e3:.3f} ms, optimizer step {p.optimizer_time * 1e3:.3f} ms, "
                 f"step {p.step_time * 1e3:.3f} ms (compute + optimizer + the communication not hidden)"
                 + (f", {p.compiled_step_time * 1e3:.3f} ms under torch.compile (memory-bound ops fused)"
                    if p.compiled_step_time != p.step_time else ""))
    if "status" in plan.stats:
        lines.append(search_line(plan.stats))
    timed = time_line(plan.stats, plan.pipeline is not None)
    return lines + ([timed] if timed else [])


_REACH = {"inside": "inside a node", "across": "across nodes",
          "spans": "partly across nodes, priced at the slower link"}


def links_line(links: dict, mesh) -> str:
    """Which mesh axes talk inside a node and which across nodes, and at what bandwidth, innermost axis first:
    "links: tp inside a node (371 GB/s), pp and dp across nodes (50 GB/s)". A calibrated or user-given link
    says so."""
    groups: dict = {}   # (where, bandwidth) -> axis names, in first-seen order
    for axis in reversed(mesh.axis_names):
        d = links[axis]
        where = "at the link given for it" if d["given"] else _REACH[d["reach"]]
        groups.setdefault((where, d["bandwidth"]), []).append(axis)
    parts = [f"{_and(axes)} {where} ({bandwidth / 1e9:.3g} GB/s)" for (where, bandwidth), axes in groups.items()]
    return "links: " + ", ".join(parts)


def _and(names: list) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def backward_lines(plan) -> list:
    """What backward makes again instead of keeping (gathered activations, FSDP weights, recomputed blocks),
    or keeps instead of making again."""
    lines = []
    fsdp = any(c.kind == "all_gather" and c.phase == "forward" and c.tensor.startswith("p_") for c in plan.collectives)
    if fsdp and plan.pipeline is not None:
        lines.append("FSDP weights are gathered for every microbatch and their gradients reduce-scattered every "
                     "microbatch (reshard_after_forward=True)" if plan.reshard_after_forward else
                     "FSDP weights are gathered once per step and held whole across the microbatches, their "
                     "gradients summed whole and reduce-scattered once (reshard_after_forward=False)")
    elif fsdp:
        lines.append("FSDP weights an op keeps for backward are kept as shards and gathered again in backward "
                     "(reshard_after_forward=True)" if plan.reshard_after_forward else
                     "FSDP weights an op keeps for backward stay whole from forward to backward, not gathered "
                     "again (reshard_after_forward=False)")
    if plan.regather_activations:
        lines.append("activations gathered for an op that keeps them are kept as shards and gathered again "
                     "in backward (sequence parallelism as Megatron does it)")
    for path, kind in plan.checkpointed.items():
        what = {"full": "every block", "selective": "the attention core of every block",
                "per-op": "every block", "per-layer": "every second block (the 2nd, 4th, ...)"}.get(kind, kind)
        but = (", but for its fused attention and every second matmul, whose results forward keeps"
               if kind == "per-op" else "")
        lines.append(f"activation checkpointing ({kind}): {what} of {path} is recomputed in backward{but}")
    return lines


def float8_line(plan) -> str:
    """Which linears run in float8 (cost/float8.py), by which recipe, and the ones the policy's rule kept out
    that the plan has in its graph (by module path)."""
    config = (plan.precision.get("float8") or {})
    paths = sorted({plan.module_paths.get(n, n) for n in plan.float8_linears})
    shown = ", ".join(paths[:3]) + (f", ... ({len(paths)} in all)" if len(paths) > 3 else "")
    lowering = plan.schedule.lowering if plan.schedule is not None else None
    gathers = len(lowering.float8_gathers) if lowering is not None else 0
    gathered = f"; {_count(gathers, 'weight')} all-gathered in float8" if gathers else ""
    return (f"float8 ({config.get('recipe_name', 'tensorwise')}): {_count(len(plan.float8_linears), 'linear')}, "
            f"{shown}; the others in {plan.precision.get('compute') or 'their own dtype'}{gathered}")


def schedule_line(schedule) -> str:
    """How the runtime groups the reductions and gathers (schedule.py), counted; "" when it groups none."""
    parts = []
    per_device = [len(bs) for bs in schedule.grad_buckets.values()]
    if any(per_device):
        where = "" if len(per_device) == 1 else f" (pipeline devices: {', '.join(map(str, per_device))})"
        parts.append(_count(sum(per_device), "gradient bucket") + where)
    for level, buckets in sorted(schedule.zero_buckets.items()):
        if buckets:
            parts.append(_count(len(buckets), f"ZeRO-{level} bucket"))
    if schedule.layer_groups:
        parts.append(_count(len(schedule.layer_groups), "FSDP layer group"))
    if schedule.regathered:
        parts.append(_count(len(schedule.regathered), "activation read") + " gathered again in backward")
    return "runtime schedule: " + ", ".join(parts) if parts else ""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


_BUBBLE = {"interleaved-1f1b": "(p-1)/(vm)", "zero-bubble": "(p-1)/(3m)"}   # search/pipeline.py


def pipeline_lines(pipe: PipelinePlan) -> list:
    """The stages as a table: what runs where, and what the schedule predicts for each."""
    p = pipe.num_stages // pipe.stages_per_device
    per_device = f", {pipe.stages_per_device} per device" if pipe.stages_per_device > 1 else ""
    lines = ["", f"pipeline over {pipe.axis} ({p} devices, {pipe.num_stages} stages{per_device}): {pipe.schedule}, "
                 f"{pipe.microbatches} microbatches, bubble {_BUBBLE.get(pipe.schedule, '(p-1)/m')} = "
                 f"{pipe.bubble:.3f}, step {pipe.step_time * 1e3:.3f} ms"]
    header = ("stage", "device", "modules", "time/microbatch", "memory", "in flight", "sends/microbatch")
    rows = [(str(s.index), f"{pipe.axis}={s.index % p}", s.modules, f"{s.time * 1e3:.3f} ms",
             format_bytes(s.memory), str(s.in_flight), format_bytes(s.send_bytes)) for s in pipe.stages]
    widths = [min(max(len(r[i]) for r in rows + [header]), 60) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines += [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]
    return lines


def search_line(stats: dict) -> str:
    """How the plan was found and how far from the best plan it may be: the gap HiGHS proved, or for
    the greedy fallback (search/greedy.py) its distance from a lower bound on the ILP's optimum."""
    status, gap = stats["status"], f"{100 * stats.get('mip_gap', 0.0):.2g}%"
    what = {OPTIMAL: f"ILP optimal (gap {gap})",
            TIME_LIMIT: f"ILP stopped at time limit (gap {gap})",
            GREEDY: f"greedy fallback, within {gap} of the ILP bound",
            GREEDY_NO_BOUND: "greedy fallback (the ILP stopped at its time limit, no bound to compare with)",
            }.get(status, status)
    seconds = stats.get("solve_seconds")
    line = f"search: {what}" + (f", solved in {seconds:.2f} s" if seconds is not None else "")
    line += f"; context parallelism {stats['context']}" if stats.get("context") else ""
    return line + (f"; {stats['named']}" if stats.get("named") else "")


# planner.py's stage timings, in the order they run: (stats key, what the stage does)
_STAGES = (("capture_seconds", "capture"), ("rules_seconds", "sharding rules"), ("build_seconds", "costs (ILP build)"),
           ("solve_seconds", "solve"), ("predict_seconds", "predict"))


def time_line(stats: dict, pipelined: bool) -> str:
    """How long planning took and where: "planning took 12.28 s: capture 1.17 s, sharding rules 0.02 s, costs
    (ILP build) 1.30 s, solve 10.04 s, predict 0.05 s". The stages are those of the plan returned; what
    the total spent besides them (the searches of plans not taken: other pipelines, a context axis tried)
    is "other". "" for a plan without timings (one made before autopar kept them)."""
    parts = [(("stage cut and predict" if pipelined and what == "predict" else what), stats[key])
             for key, what in _STAGES if isinstance(stats.get(key), (int, float))]
    if not parts:
        return ""
    text = ", ".join(f"{what} {seconds:.2f} s" for what, seconds in parts)
    total = stats.get("planning_seconds")
    if not isinstance(total, (int, float)):
        return f"planning stages: {text}"
    other = total - sum(seconds for _, seconds in parts)
    return f"planning took {total:.2f} s: {text}" + (f", other {other:.2f} s" if other >= 0.005 else "")
