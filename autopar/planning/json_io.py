"""A Plan as JSON: what `plan.to_json()` writes and `Plan.from_json` reads (FORMAT_VERSION).

Reads only a Plan's fields, and gives fields back, so it imports nothing of result.py.
"""
from __future__ import annotations

import json
from dataclasses import asdict

import sympy
from sympy.printing.str import StrPrinter

from ..cost.buckets import DEFAULT_BUCKET_BYTES
from ..cost.predict import Memory, Predicted
from ..errors import PlanError
from ..mesh import MeshSpec
from ..search.pipeline import PipelinePlan
from ..sharding.strategies import Strategy
from .schedule import Schedule

# 2: the schedule (schedule.py); 1 still reads, without it. 3: the pipeline's stages_per_device (v, searched
# under interleaving); 2 still reads, its interleaved plans at v = 2. 4: the schedule's lowering (lowering.Lowering:
# partial gradients, gradient scales, casts, grouped weight uses, recomputed blocks); 3 still reads, without it
# (the module makes it when built: api._with_schedule)
FORMAT_VERSION = 4
READS = (1, 2, 3, 4)


def to_json(plan) -> str:
    """The plan as JSON text (FORMAT_VERSION)."""
    def pred(p: Predicted, sym: bool):
        f = _sympy_text if sym else float
        return {"memory": {k: f(v) for k, v in asdict(p.memory).items()},
                "comm_bytes": {k: f(v) for k, v in p.comm_bytes.items()},
                "comm_time": {k: f(v) for k, v in p.comm_time.items()},
                "compute_time": f(p.compute_time), "step_time": f(p.step_time),
                "comm_bytes_by_kind": {k: f(v) for k, v in p.comm_bytes_by_kind.items()},
                "exposed_comm_time": {k: f(v) for k, v in p.exposed_comm_time.items()},
                "optimizer_time": f(p.optimizer_time), "compiled_step_time": f(p.compiled_step_time),
                "fused_time": {k: f(v) for k, v in p.fused_time.items()}}
    d = {
        "format_version": FORMAT_VERSION,
        "mesh": {"axis_names": list(plan.mesh.axis_names), "axis_sizes": list(plan.mesh.axis_sizes)},
        "strategy": plan.strategy, "hardware": plan.hardware, "batch_axes": list(plan.batch_axes),
        "node_strategies": {n: {"inputs": [list(p) for p in s.inputs], "output": list(s.output),
                                **({"zero": s.zero, "zero_axes": list(s.zero_axes)} if s.zero else {})}
                            for n, s in plan.node_strategies.items()},
        "param_zero": {k: [lvl, list(axes)] for k, (lvl, axes) in plan.param_zero.items()},
        "precision": plan.precision, "optimizer": plan.optimizer, "checkpointed": dict(plan.checkpointed),
        "param_placements": {k: list(v) for k, v in plan.param_placements.items()},
        "input_placements": [list(p) for p in plan.input_placements],
        "output_placements": [list(p) for p in plan.output_placements],
        "module_paths": plan.module_paths,
        "collectives": [asdict(c) for c in plan.collectives],
        "predicted": pred(plan.predicted, False), "symbolic": pred(plan.symbolic, True),
        "pipeline": plan.pipeline.to_dict() if plan.pipeline is not None else None,
        "bucket_bytes": plan.bucket_bytes, "regather_activations": plan.regather_activations,
        "reshard_after_forward": plan.reshard_after_forward, "input_keys": list(plan.input_keys),
        "schedule": plan.schedule.to_dict() if plan.schedule is not None else None,
        "links": plan.links,
        **({"float8_linears": list(plan.float8_linears)} if plan.float8_linears else {}),
        "symbols": plan.symbols, "stats": {k: v for k, v in plan.stats.items() if isinstance(v, (int, float, str))},
    }
    return json.dumps(d, indent=1)


def _fused_time(p: dict, f) -> dict:
    """Predicted.fused_time as written, or for JSON written before it (2026-12), the whole saving as "other": a
    reader of the regions still finds them summing to step_time - compiled_step_time."""
    if "fused_time" in p:
        return {k: f(v) for k, v in p["fused_time"].items()}
    step, compiled = f(p["step_time"]), f(p.get("compiled_step_time", p["step_time"]))
    return {"blocks": 0.0, "head": 0.0, "other": step - compiled}


def plan_fields(text: str) -> dict:
    """The fields of the Plan `text` holds, for Plan(**fields); collectives as dicts of CollectiveRecord's
    fields (result.py makes the records: this module imports nothing of it)."""
    d = json.loads(text)
    if d.get("format_version") not in READS:
        raise PlanError(f"plan JSON has format_version {d.get('format_version')}, this autopar reads "
                        f"{', '.join(map(str, READS))}")
    syms = {name: sympy.Symbol(name, integer=True, positive=True) for name in d.get("symbols", {})}

    def pred(p, sym):
        f = (lambda v: _read_sympy(v, syms)) if sym else float
        return Predicted(Memory(**{k: f(v) for k, v in p["memory"].items()}),
                         {k: f(v) for k, v in p["comm_bytes"].items()},
                         {k: f(v) for k, v in p["comm_time"].items()},
                         f(p["compute_time"]), f(p["step_time"]),
                         {k: f(v) for k, v in p["comm_bytes_by_kind"].items()},
                         {k: f(v) for k, v in p.get("exposed_comm_time", p["comm_time"]).items()},
                         f(p.get("optimizer_time", 0)), f(p.get("compiled_step_time", p["step_time"])),
                         _fused_time(p, f))
    return dict(
        mesh=MeshSpec(tuple(d["mesh"]["axis_names"]), tuple(d["mesh"]["axis_sizes"])),
        strategy=d["strategy"], hardware=d["hardware"], batch_axes=tuple(d["batch_axes"]),
        node_strategies={n: Strategy(tuple(tuple(p) for p in s["inputs"]), tuple(s["output"]),
                                     s.get("zero", 0), tuple(s.get("zero_axes", ())))
                         for n, s in d["node_strategies"].items()},
        param_zero={k: (lvl, tuple(axes)) for k, (lvl, axes) in d.get("param_zero", {}).items()},
        precision=d.get("precision", {}), optimizer=d.get("optimizer", {}),
        checkpointed=_checkpointed(d.get("checkpointed", {})),
        param_placements={k: tuple(v) for k, v in d["param_placements"].items()},
        input_placements=tuple(tuple(p) for p in d["input_placements"]),
        output_placements=tuple(tuple(p) for p in d["output_placements"]),
        module_paths=d["module_paths"],
        collectives=tuple(d["collectives"]),
        predicted=pred(d["predicted"], False), symbolic=pred(d["symbolic"], True),
        symbols=d.get("symbols", {}), stats=d.get("stats", {}),
        pipeline=PipelinePlan.from_dict(d["pipeline"]) if d.get("pipeline") else None,
        bucket_bytes=d.get("bucket_bytes", DEFAULT_BUCKET_BYTES),
        regather_activations=d.get("regather_activations", False),
        reshard_after_forward=d.get("reshard_after_forward", True), input_keys=tuple(d.get("input_keys", ())),
        schedule=Schedule.from_dict(d["schedule"]) if d.get("schedule") else None,
        links={axis: dict(v) for axis, v in d.get("links", {}).items()},
        float8_linears=tuple(d.get("float8_linears", ())))


class _DoublePrinter(StrPrinter):
    """sympy's str, except a Float prints as repr(float): str() keeps 15 digits, too few to read back
    the same double, so a plan's times would change in their last bits through JSON."""

    def _print_Float(self, expr):
        return repr(float(expr))


def _sympy_text(value) -> str:
    return _DoublePrinter().doprint(sympy.sympify(value))


def _checkpointed(saved) -> dict:
    """{path: kind}; a list of paths is a plan saved before selective recompute (all of them full)."""
    return {path: "full" for path in saved} if isinstance(saved, list) else dict(saved)


def _read_sympy(text: str, symbols: dict):
    # sympify reads a 17-digit literal at 17-digit precision, not as a double; the parser writes each
    # literal as a Float(...) call, so naming Float here rounds it once, to the double it was written from
    return sympy.sympify(text, locals={**symbols, "Float": lambda digits: sympy.Float(digits, precision=53)})
