"""Plan: the immutable result of a search, with its predictions.

It names placements by graph node and parameter, so the rewriter on any rank
applies the same plan to its own capture of the same model. This module holds the
data and makes it (make_plan); the Plan's other jobs each have a module:
text.py (the table `print(plan)` shows), json_io.py (to_json / from_json),
inputs.py (a rank's share of a batch, with torch).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

from cost_models import describe_links

from ..capture.export import PARAM
from ..cost.buckets import DEFAULT_BUCKET_BYTES, partial_gradients
from ..cost.float8 import FLOAT8_DIM_MULTIPLE, pieces_fit
from ..cost.precision import OptimizerSpec, Precision, precision_of
from ..cost.predict import Predicted
from ..cost.problem import Problem
from ..mesh import MeshSpec
from ..search.classics import Roles
from ..search.pipeline import PipelinePlan
from ..search.solution import Solution
from . import inputs as plan_inputs, json_io as plan_json, text as plan_text
from .schedule import Schedule, schedule_of



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
    # the runtime's groupings of collectives (buckets, FSDP layer groups, re-gathered activations), decided with
    # the plan (schedule.py); None for a plan read from JSON of format 1, which parallelize completes
    schedule: Schedule | None = None
    # the global ranks of the DeviceMesh a ParallelModule runs the plan on, laid out like the mesh (nested
    # tuples), so local_inputs cuts by the coordinates the runtime uses; None (a plan not bound to a mesh,
    # or read from JSON): ranks lie row-major over the axes. Where the plan runs, not what it is: not compared,
    # not saved
    rank_grid: tuple | None = field(default=None, compare=False, repr=False)
    # per mesh axis, where its ranks lie and the link it is priced at (cost_models.describe_links):
    # {axis: {"reach": "inside" | "across" | "spans", "bandwidth", "latency", "given"}}; {} for a plan saved
    # before it was recorded
    links: dict = field(default_factory=dict)
    # the linear nodes whose matmuls run in float8 (cost/float8.py), in graph order; () without float8
    float8_linears: tuple = ()

    @property
    def precision_policy(self) -> Precision:
        """The precision policy `precision` names, resolved (cost/precision.Precision): what the runtime reads."""
        return precision_of(self.precision)

    # ------------------------------------------------------------ inputs (inputs.py)
    def local_inputs(self, *global_inputs, rank: int | None = None) -> tuple:
        """This rank's shard of each global positional input, as a tuple (of one for a one-input model).

        Always a tuple, so one call works for any number of inputs:
        `pm(*pm.plan.local_inputs(*global_inputs))`.
        """
        return plan_inputs.local_inputs(self, global_inputs, rank)

    def local_kwargs(self, rank: int | None = None, **global_kwargs) -> dict:
        """This rank's shard of each global keyword input, as a dict: `pm(**pm.plan.local_kwargs(**batch))`.

        Tensors the model was not planned with (a keyword it was captured without) and non-tensors pass
        as they are: the module says what it cannot take."""
        return plan_inputs.local_kwargs(self, global_kwargs, rank)

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
        return plan_inputs.data_shard(self, rank)

    def local_targets(self, *global_targets, rank: int | None = None) -> tuple:
        """This rank's shard of each whole-batch target, split like the outputs along the batch dim.

        A tuple, like local_inputs: `loss_fn(out, *plan.local_targets(y))`, or `(t,) = plan.local_targets(y)`.
        """
        return plan_inputs.local_targets(self, global_targets, rank)

    def on_ranks(self, rank_grid) -> "Plan":
        """This plan, bound to the ranks of a mesh laid out as `rank_grid` (DeviceMesh.mesh.tolist())."""
        return replace(self, rank_grid=plan_inputs.nested_tuple(rank_grid))

    # ------------------------------------------------------------ text (text.py), JSON (json_io.py)
    def __str__(self) -> str:
        return plan_text.render(self)

    def to_json(self) -> str:
        return plan_json.to_json(self)

    @staticmethod
    def from_json(text: str) -> "Plan":
        fields = plan_json.plan_fields(text)
        return Plan(**{**fields, "collectives": tuple(CollectiveRecord(**c) for c in fields["collectives"])})


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
    if sol.context:   # auto under a memory limit: whether a context axis was tried, and why taken or not
        stats["context"] = sol.context
    if sol.named:   # auto: the named strategies its answer was held against by prediction, and which won
        stats["named"] = sol.named
    plan = Plan(mesh=spec, strategy=strategy, hardware=hw.name,
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
                input_keys=tuple(cap.input_keys),
                links=describe_links(list(zip(spec.axis_names, spec.axis_sizes)), hw, prob.links),
                float8_linears=float8_linears(prob, node_strategies))
    return replace(plan, schedule=schedule_of(cap, plan, prob.grad_nodes, saved=prob.saved))


def float8_linears(prob: Problem, node_strategies: dict) -> tuple:
    """The linears the plan runs in float8: the problem's (cost/float8.py), less those that cannot under the
    chosen layouts, which stay in the compute dtype, with a warning: a weight split into pieces that are not
    multiples of 16 (the float8 matmul's shapes), or an output gradient the layouts leave partial for the
    gradient buckets (cost/buckets.partial_gradients: the amax of a partial sum is not the whole gradient's)."""
    if not prob.float8:
        return ()
    deferred = partial_gradients(prob.cap, node_strategies, prob.grad_nodes)
    why = {}
    for name, (k, n) in prob.float8.items():
        if not pieces_fit(node_strategies[name], k, n, prob.mesh.axis_sizes):
            why[name] = f"its weight's pieces are not multiples of {FLOAT8_DIM_MULTIPLE}"
        elif name in deferred:
            why[name] = "its output's gradient is left a partial sum for the gradient buckets"
    if why:
        lines = "; ".join(f"{prob.cap.info[n].module_path or n} ({reason})" for n, reason in why.items())
        warnings.warn(f"float8: {len(why)} linear(s) run in the compute dtype under this plan, not float8: {lines}",
                      stacklevel=4)
    return tuple(n for n in prob.float8 if n not in why)
