"""Plan: the immutable result of a search, with its predictions.

It names placements by graph node and parameter, so the rewriter on any rank
applies the same plan to its own capture of the same model; it prints as a
table a person can check, and round-trips through JSON.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

import sympy
import torch
from sympy.printing.str import StrPrinter

from cost_models import format_bytes

from .capture.export import PARAM
from .cost.buckets import DEFAULT_BUCKET_BYTES
from .cost.precision import OptimizerSpec, Precision
from .cost.predict import Memory, Predicted
from .cost.problem import Problem
from .errors import PlanError
from .mesh import MeshSpec
from .search.classics import Roles
from .search.pipeline import PipelinePlan
from .search.solution import GREEDY, GREEDY_NO_BOUND, OPTIMAL, TIME_LIMIT, Solution
from .sharding.placement import chunk_index, dim_factor, format_placements, shard_full_tensor
from .sharding.strategies import Strategy

FORMAT_VERSION = 1


@dataclass(frozen=True)
class CollectiveRecord:
    kind: str
    axis: str
    phase: str
    bytes: float      # bytes of the whole tensor along the axis
    where: str        # node it feeds
    module_path: str  # module of that node
    tensor: str = ""  # node(s) whose output it moves (p_* placeholders are parameters); a gradient bucket's
                      # or an FSDP layer's names every weight it carries, comma-separated


@dataclass(frozen=True)
class Plan:
    mesh: MeshSpec
    strategy: str
    hardware: str
    batch_axes: tuple                 # axis names that split the batch
    node_strategies: dict             # node name -> Strategy
    param_placements: dict            # parameter FQN -> storage placements
    input_placements: tuple           # per user input
    output_placements: tuple          # per output
    module_paths: dict                # node name -> module path
    collectives: tuple                # CollectiveRecord, numeric
    predicted: Predicted
    symbolic: Predicted
    symbols: dict = field(default_factory=dict)  # Dim name -> example value
    stats: dict = field(default_factory=dict)
    param_zero: dict = field(default_factory=dict)  # parameter FQN -> (ZeRO level, axis names)
    precision: dict = field(default_factory=dict)   # Precision.to_dict(): None = the parameter's dtype
    optimizer: dict = field(default_factory=dict)   # {"name", "states_per_param"}
    # {stack path: kind}: "full" recomputes each block of the stack in backward, "selective" only each
    # block's attention core (cost/checkpointing.py); stacks not named keep their activations
    checkpointed: dict = field(default_factory=dict)
    pipeline: PipelinePlan | None = None  # stages over a pipeline axis (search/pipeline.py); None: not pipelined
    bucket_bytes: int = DEFAULT_BUCKET_BYTES  # the most bytes one gradient bucket's all-reduce carries (cost/buckets.py)
    # an activation gathered whole for an op that keeps it (sequence parallelism's norm output) is kept as
    # its shard and gathered again in backward (runtime/lowering/regather.py), as Megatron does
    regather_activations: bool = False
    # an FSDP weight an op keeps for backward: kept as its shard and gathered again in backward (True, FSDP2's
    # default), or kept whole from forward to backward (False; runtime/lowering/rewrite.py)
    reshard_after_forward: bool = True
    # per entry of input_placements, how the model is called with it: a position (int) or a keyword (str);
    # () for a plan of a format before keyword inputs, whose inputs are all positional
    input_keys: tuple = ()
    # the global ranks of the DeviceMesh a ParallelModule runs the plan on, laid out like the mesh (nested
    # tuples), so local_inputs cuts by the coordinates the runtime uses; None (a plan not bound to a mesh,
    # or read from JSON): ranks lie row-major over the axes. Where the plan runs, not what it is: not compared,
    # not saved
    rank_grid: tuple | None = field(default=None, compare=False, repr=False)

    # ------------------------------------------------------------ inputs
    def local_inputs(self, *global_inputs, rank: int | None = None) -> tuple:
        """This rank's shard of each global positional input, as a tuple (of one for a one-input model).

        Always a tuple, so one call works for any number of inputs:
        `pm(*pm.plan.local_inputs(*global_inputs))`.
        """
        placements = self._placements_by_key()
        num_positional = sum(1 for k in placements if isinstance(k, int))
        if len(global_inputs) != num_positional:
            raise PlanError(f"the plan was made for {num_positional} inputs, got {len(global_inputs)}"
                            + ("; its other inputs are keywords: pass them through plan.local_kwargs"
                               if len(placements) > num_positional else ""))
        coords = self._coords(rank)
        return tuple(self._local(t, placements[i], coords, f"input {i}") for i, t in enumerate(global_inputs))

    def local_kwargs(self, rank: int | None = None, **global_kwargs) -> dict:
        """This rank's shard of each global keyword input, as a dict: `pm(**pm.plan.local_kwargs(**batch))`.

        Tensors the model was not planned with (a keyword it was captured without) and non-tensors pass
        as they are: the module says what it cannot take."""
        placements = self._placements_by_key()
        coords = self._coords(rank)
        return {k: self._local(t, placements[k], coords, f"keyword input {k!r}") if k in placements else t
                for k, t in global_kwargs.items()}

    def _placements_by_key(self) -> dict:
        keys = self.input_keys or range(len(self.input_placements))
        return dict(zip(keys, self.input_placements))

    def _local(self, t, placements: tuple, coords: tuple, what: str):
        """This rank's shard of the whole tensor `t` (anything else as it is)."""
        if not (isinstance(t, torch.Tensor) and t.dim() > 0):
            return t
        for d, n in _split_sizes(placements, t, self.mesh):
            if t.shape[d] % n:
                raise PlanError(f"{what} of shape {tuple(t.shape)}: dim {d} ({t.shape[d]}) does not divide "
                                f"into {n} shards for placements {placements}; use a batch divisible by {n}")
        return shard_full_tensor(t, placements, coords, self.mesh.axis_sizes).contiguous()

    def data_shard(self, rank: int | None = None) -> tuple[int, int]:
        """(index, count): this rank reads share `index` of `count` equal shares of the batch (dim 0 of the
        inputs, in order); ranks that split something else between them (tensor parallelism) share an index.
        `rank`: this process's rank in the default group when None.

        A data loader reads the rank's share itself, and the module takes that local batch:

            index, count = pm.plan.data_shard()
            sampler = DistributedSampler(dataset, num_replicas=count, rank=index)
            loader = DataLoader(dataset, batch_size=global_batch // count, sampler=sampler)
            for x, y in loader:
                loss = loss_fn(pm(x), y)

        The same cut as local_inputs: `local_inputs(x)[0]` is `x.chunk(count)[index]`.
        """
        placements = self.input_placements[0] if self.input_placements else tuple(
            "S(0)" if a in self.batch_axes else "R" for a in self.mesh.axis_names)
        coords = self._coords(rank)
        return (chunk_index(placements, 0, coords, self.mesh.axis_sizes),
                dim_factor(placements, 0, self.mesh.axis_sizes))

    def local_targets(self, *global_targets, rank: int | None = None) -> tuple:
        """This rank's shard of each whole-batch target, split like the outputs along the batch dim.

        A tuple, like local_inputs: `loss_fn(out, *plan.local_targets(y))`, or `(t,) = plan.local_targets(y)`.
        """
        coords = self._coords(rank)
        out = []
        names = self.mesh.axis_names
        for t in global_targets:
            pl = tuple("S(0)" if a in self.batch_axes else "R" for a in names)
            out.append(shard_full_tensor(t, pl, coords, self.mesh.axis_sizes).contiguous()
                       if isinstance(t, torch.Tensor) and t.dim() > 0 else t)
        return tuple(out)

    def on_ranks(self, rank_grid) -> "Plan":
        """This plan, bound to the ranks of a mesh laid out as `rank_grid` (DeviceMesh.mesh.tolist())."""
        return replace(self, rank_grid=_nested_tuple(rank_grid))

    def _coords(self, rank):
        """`rank`'s coordinates on the mesh: where rank_grid puts it, else row-major.
        `rank`: this process's rank in the default group when None."""
        import torch.distributed as dist
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if self.rank_grid is not None:
            return _position(self.rank_grid, rank, self.mesh)
        coords, r = [], rank
        for n in reversed(self.mesh.axis_sizes):
            coords.append(r % n)
            r //= n
        return tuple(reversed(coords))

    # ------------------------------------------------------------ text
    def _backward_lines(self) -> list:
        """What backward makes again instead of keeping (gathered activations, FSDP weights, recomputed blocks),
        or keeps instead of making again."""
        lines = []
        fsdp = any(c.kind == "all_gather" and c.phase == "forward" and c.tensor.startswith("p_") for c in self.collectives)
        if fsdp:
            lines.append("FSDP weights an op keeps for backward are kept as shards and gathered again in backward "
                         "(reshard_after_forward=True)" if self.reshard_after_forward else
                         "FSDP weights an op keeps for backward stay whole from forward to backward, not gathered "
                         "again (reshard_after_forward=False)")
        if self.regather_activations:
            lines.append("activations gathered for an op that keeps them are kept as shards and gathered again "
                         "in backward (sequence parallelism as Megatron does it)")
        for path, kind in self.checkpointed.items():
            what = "every block" if kind == "full" else "the attention core of every block"
            lines.append(f"activation checkpointing ({kind}): {what} of {path} is recomputed in backward")
        return lines

    def __str__(self) -> str:
        names = self.mesh.axis_names
        lines = [f"autopar plan  strategy={self.strategy}  mesh: {self.mesh}  hardware={self.hardware}  "
                 f"batch split over: {', '.join(self.batch_axes) or 'none'}"]
        rows = []
        by_module: dict[str, dict] = {}
        for fqn, pl in self.param_placements.items():
            mod = fqn.rsplit(".", 1)[0] if "." in fqn else ""
            by_module.setdefault(mod, {"params": [], "acts": [], "colls": {}})["params"].append(
                f"{fqn.rsplit('.', 1)[-1]} {format_placements(pl, names)}")
        for node, s in self.node_strategies.items():
            mod = self.module_paths.get(node)
            if mod is None or node.startswith("p_") or node == "output":
                continue
            by_module.setdefault(mod, {"params": [], "acts": [], "colls": {}})["acts"].append(
                format_placements(s.output, names))
        for c in self.collectives:
            d = by_module.setdefault(c.module_path, {"params": [], "acts": [], "colls": {}})["colls"]
            key = f"{c.kind}@{c.axis}"
            d[key] = d.get(key, 0) + 1
        header = ("module", "parameters (storage)", "activations out", "collectives per step")
        first_op: dict = {}   # module -> its first op's place in the graph: rows in forward order
        for i, node in enumerate(n for n in self.node_strategies if not n.startswith("p_")):
            first_op.setdefault(self.module_paths.get(node), i)
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
        m = self.predicted.memory
        lines.append("")
        parts = ("params", "master", "grads", "optimizer", "activations", "transient", "total")
        lines.append("predicted per device: " + ", ".join(
            f"{k} {format_bytes(getattr(m, k))}" for k in parts if k != "master" or getattr(m, k)))
        if self.param_zero:
            by_kind: dict = {}
            for lvl, axes in self.param_zero.values():
                key = f"ZeRO-{lvl} over {'x'.join(axes)}"
                by_kind[key] = by_kind.get(key, 0) + 1
            lines.append("optimizer state split: " + ", ".join(f"{k} ({n} parameters)" for k, n in by_kind.items()))
        if self.pipeline is not None:
            lines += pipeline_lines(self.pipeline)
        lines += self._backward_lines()
        p = self.predicted
        lines.append("communication per step: " + ", ".join(
            f"{a} {format_bytes(p.comm_bytes[a])} ({p.comm_time[a] * 1e3:.3f} ms, "
            f"{p.hidden_comm_time[a] * 1e3:.3f} ms of it hidden behind compute)" for a in names))
        lines.append(f"compute {p.compute_time * 1e3:.3f} ms, optimizer step {p.optimizer_time * 1e3:.3f} ms, "
                     f"step {p.step_time * 1e3:.3f} ms (compute + optimizer + the communication not hidden)")
        if "status" in self.stats:
            lines.append(search_line(self.stats))
        return "\n".join(lines)

    # ------------------------------------------------------------ json
    def to_json(self) -> str:
        def pred(p: Predicted, sym: bool):
            f = _sympy_text if sym else float
            return {"memory": {k: f(v) for k, v in asdict(p.memory).items()},
                    "comm_bytes": {k: f(v) for k, v in p.comm_bytes.items()},
                    "comm_time": {k: f(v) for k, v in p.comm_time.items()},
                    "compute_time": f(p.compute_time), "step_time": f(p.step_time),
                    "comm_bytes_by_kind": {k: f(v) for k, v in p.comm_bytes_by_kind.items()},
                    "exposed_comm_time": {k: f(v) for k, v in p.exposed_comm_time.items()},
                    "optimizer_time": f(p.optimizer_time)}
        d = {
            "format_version": FORMAT_VERSION,
            "mesh": {"axis_names": list(self.mesh.axis_names), "axis_sizes": list(self.mesh.axis_sizes)},
            "strategy": self.strategy, "hardware": self.hardware, "batch_axes": list(self.batch_axes),
            "node_strategies": {n: {"inputs": [list(p) for p in s.inputs], "output": list(s.output),
                                    **({"zero": s.zero, "zero_axes": list(s.zero_axes)} if s.zero else {})}
                                for n, s in self.node_strategies.items()},
            "param_zero": {k: [lvl, list(axes)] for k, (lvl, axes) in self.param_zero.items()},
            "precision": self.precision, "optimizer": self.optimizer, "checkpointed": dict(self.checkpointed),
            "param_placements": {k: list(v) for k, v in self.param_placements.items()},
            "input_placements": [list(p) for p in self.input_placements],
            "output_placements": [list(p) for p in self.output_placements],
            "module_paths": self.module_paths,
            "collectives": [asdict(c) for c in self.collectives],
            "predicted": pred(self.predicted, False), "symbolic": pred(self.symbolic, True),
            "pipeline": self.pipeline.to_dict() if self.pipeline is not None else None,
            "bucket_bytes": self.bucket_bytes, "regather_activations": self.regather_activations,
            "reshard_after_forward": self.reshard_after_forward, "input_keys": list(self.input_keys),
            "symbols": self.symbols, "stats": {k: v for k, v in self.stats.items() if isinstance(v, (int, float, str))},
        }
        return json.dumps(d, indent=1)

    @staticmethod
    def from_json(text: str) -> "Plan":
        d = json.loads(text)
        if d.get("format_version") != FORMAT_VERSION:
            raise PlanError(f"plan JSON has format_version {d.get('format_version')}, this autopar reads {FORMAT_VERSION}")
        syms = {name: sympy.Symbol(name, integer=True, positive=True) for name in d.get("symbols", {})}

        def pred(p, sym):
            f = (lambda v: _read_sympy(v, syms)) if sym else float
            return Predicted(Memory(**{k: f(v) for k, v in p["memory"].items()}),
                             {k: f(v) for k, v in p["comm_bytes"].items()},
                             {k: f(v) for k, v in p["comm_time"].items()},
                             f(p["compute_time"]), f(p["step_time"]),
                             {k: f(v) for k, v in p["comm_bytes_by_kind"].items()},
                             {k: f(v) for k, v in p.get("exposed_comm_time", p["comm_time"]).items()},
                             f(p.get("optimizer_time", 0)))
        return Plan(
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
            collectives=tuple(CollectiveRecord(**c) for c in d["collectives"]),
            predicted=pred(d["predicted"], False), symbolic=pred(d["symbolic"], True),
            symbols=d.get("symbols", {}), stats=d.get("stats", {}),
            pipeline=PipelinePlan.from_dict(d["pipeline"]) if d.get("pipeline") else None,
            bucket_bytes=d.get("bucket_bytes", DEFAULT_BUCKET_BYTES),
            regather_activations=d.get("regather_activations", False),
            reshard_after_forward=d.get("reshard_after_forward", True), input_keys=tuple(d.get("input_keys", ())))


@dataclass
class Searched:
    """What planning found for one layout: the problem it searched, the winning solution and roles,
    and its prices -- all make_plan needs to write the Plan."""
    prob: Problem
    sol: Solution
    roles: Roles
    num_searches: int         # role assignments tried
    predicted: Predicted      # numbers at the example's sizes
    symbolic: Predicted       # the same in the shape symbols
    collectives: list         # cost.terms Collective, per step
    policy: Precision
    optimizer: OptimizerSpec
    hardware: object          # cost_models Hardware
    seconds: dict             # planning time by step (rules_seconds, predict_seconds)
    pipeline: PipelinePlan | None = None


def make_plan(searched: Searched, strategy: str, capture_seconds: float) -> Plan:
    """The Plan of a search: per-node strategies, placements by parameter name, predictions, stats."""
    prob, sol, roles, hw = searched.prob, searched.sol, searched.roles, searched.hardware
    cap, spec, strategies = prob.cap, prob.mesh, prob.strategies
    node_strategies = {n: ns.strategies[sol.choice[n]] for n, ns in strategies.items()}
    param_placements = {cap.info[n].target_name: s.output for n, s in node_strategies.items()
                        if cap.info[n].kind == PARAM}
    param_zero = {cap.info[n].target_name: (s.zero, tuple(spec.axis_names[a] for a in s.zero_axes))
                  for n, s in node_strategies.items() if cap.info[n].kind == PARAM and s.zero}
    input_placements = tuple(node_strategies[n].output if n in node_strategies else (("R",) * spec.num_axes)
                             for n in cap.input_names)
    output_placements = tuple(node_strategies["output"].inputs)
    records = tuple(CollectiveRecord(c.kind, spec.axis_names[c.axis], c.phase, float(c.full_bytes), c.where,
                                     cap.info[c.where].module_path if c.where in cap.info else "", c.tensor)
                    for c in searched.collectives)
    stats = {"capture_seconds": capture_seconds, **searched.seconds, "build_seconds": sol.build_seconds,
             "solve_seconds": sol.solve_seconds,
             "axis_roles": ",".join(f"{a}={r or 'any'}" for a, r in zip(spec.axis_names, roles.roles)),
             "searches": searched.num_searches,
             "status": sol.status, "objective_seconds": sol.objective,
             "num_nodes": len(strategies), "num_edges": len(prob.edges),
             "num_variables": sol.num_variables, "num_constraints": sol.num_constraints,
             "mip_gap": sol.mip_gap}
    return Plan(mesh=spec, strategy=strategy, hardware=hw.name,
                batch_axes=tuple(spec.axis_names[a] for a in sol.batch_axes),
                node_strategies=node_strategies, param_placements=param_placements,
                input_placements=input_placements, output_placements=output_placements,
                module_paths={n: cap.info[n].module_path for n in strategies},
                collectives=records, predicted=searched.predicted, symbolic=searched.symbolic,
                symbols={str(s): v for s, v in cap.hints.items()}, stats=stats, param_zero=param_zero,
                precision=searched.policy.to_dict(),
                optimizer={"name": searched.optimizer.name, "states_per_param": searched.optimizer.states_per_param},
                checkpointed=sol.checkpointed, pipeline=searched.pipeline, bucket_bytes=prob.bucket_bytes,
                regather_activations=sol.regather_activations, reshard_after_forward=sol.reshard_after_forward,
                input_keys=tuple(cap.input_keys))



_BUBBLE = {"interleaved-1f1b": "(p-1)/(vm)", "zero-bubble": "(p-1)/(3m)"}   # search/pipeline.py


def pipeline_lines(pipe: PipelinePlan) -> list:
    """The stages as a table: what runs where, and what the schedule predicts for each."""
    p = pipe.num_stages // pipe.stages_per_device
    lines = ["", f"pipeline over {pipe.axis} ({p} devices, {pipe.num_stages} stages): {pipe.schedule}, "
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
    return f"search: {what}" + (f", solved in {seconds:.2f} s" if seconds is not None else "")


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


def _split_sizes(pl, t, mesh: MeshSpec):
    from .sharding.placement import dim_factor
    for d in range(t.dim()):
        f = dim_factor(pl, d, mesh.axis_sizes)
        if f > 1:
            yield d, f


def _nested_tuple(grid):
    return tuple(_nested_tuple(g) for g in grid) if isinstance(grid, (list, tuple)) else int(grid)


def _position(rank_grid: tuple, rank: int, mesh: MeshSpec) -> tuple:
    """Where `rank` sits in `rank_grid`: its coordinate on each mesh axis."""
    flat = torch.tensor(rank_grid).reshape(mesh.axis_sizes)
    found = (flat == rank).nonzero()
    if not len(found):
        raise PlanError(f"rank {rank} is not on the mesh this plan runs on (its ranks: {flat.flatten().tolist()}); "
                        "give the rank of a process of that mesh")
    return tuple(int(c) for c in found[0])
