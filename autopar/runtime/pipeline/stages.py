"""Pipeline parallelism, runtime side: this device's stages of the local graph, run by torch's schedules.

The rewritten local graph (rewrite.py: collectives of the other axes
already in it) is cut by the plan's stages (pipeline.py). Each node goes to
the stage of the captured op it was made for; a node that depends on no
activation -- a weight, its FSDP all-gather, a shape read, an arange -- is
instead copied into every stage that reads it, so weights never travel
between stages and no stage waits on another for a shape. What a stage
needs from earlier stages comes in as its inputs; what later stages need
(its own results, or earlier ones passing through) goes out as its outputs.
Under a plan that keeps FSDP weights whole (reshard_after_forward False) a
weight's gather is not copied in: the stage takes the whole weight the step
holds (held_weights.py) as an input of its own.

torch.distributed.pipelining does the rest: PipelineStage sends and
receives those tensors and their gradients, and a schedule (GPipe, 1F1B,
interleaved 1F1B) orders the microbatches.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.fx as fx

from ..._compat import unflatten_outputs, view_base
from ...capture.export import INPUT, PARAM, Captured
from ...errors import PlanError
from .held_weights import HELD, HeldWeights

# the schedules' names as a plan's PipelinePlan.schedule spells them (search/pipeline.py; tests/test_layering.py
# holds the two equal)
GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE = "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"

FIRST = -1   # owner of the model's inputs: they enter before stage 0


def _owners(gm: fx.GraphModule, cap: Captured, stage_of: dict, last: int) -> dict:
    """Local node -> the stage that computes it, or None for nodes every reader computes itself."""
    origin = gm.meta["origin"]
    owner = {}
    for node in gm.graph.nodes:
        src = origin.get(node.name)
        if node.op == "placeholder":
            owner[node.name] = FIRST if cap.info[src].kind == INPUT else None
        elif node.op == "get_attr":
            owner[node.name] = None
        elif node.op == "output":
            owner[node.name] = last
        elif _not_tensor(cap, src) or all(owner[a.name] is None for a in node.all_input_nodes):
            owner[node.name] = None
        elif src == "output":
            owner[node.name] = last
        else:
            owner[node.name] = stage_of[src]
    return owner


def _not_tensor(cap: Captured, src: str) -> bool:
    if src not in cap.info or src == "output":
        return False
    return cap.info[src].meta is None and cap.node(src).op == "call_function" and not isinstance(
        cap.node(src).meta.get("val"), (torch.Tensor, list, tuple))


def _reads(node: fx.Node, owner: dict) -> set:
    """The owned values `node` reads, directly or through the unowned nodes it recomputes."""
    out = set()
    for a in node.all_input_nodes:
        if owner[a.name] is None:
            out |= _reads(a, owner)
        else:
            out.add(a.name)
    return out


def cut(gm: fx.GraphModule, cap: Captured, stage_of: dict, num_stages: int) -> list[dict]:
    """Per stage: {"inputs": [local values it receives], "outputs": [values it sends on, or "output"]}."""
    last = num_stages - 1
    owner = _owners(gm, cap, stage_of, last)
    nodes = list(gm.graph.nodes)
    reads_by_stage = [set() for _ in range(num_stages)]
    for node in nodes:
        s = owner[node.name]
        if s is not None and s >= 0:
            reads_by_stage[s] |= _reads(node, owner)
    for s, reads in enumerate(reads_by_stage):
        later = [v for v in reads if owner[v] > s]
        if later:
            raise PlanError(f"stage {s} reads {later[:3]}, which a later stage computes: the plan's stages are not "
                            "in graph order (was it made for another model?)")
    last_reader = {}
    for s, reads in enumerate(reads_by_stage):
        for v in reads:
            last_reader[v] = max(last_reader.get(v, FIRST), s)
    order = {n.name: i for i, n in enumerate(nodes)}
    inputs = [n.name for n in nodes if owner[n.name] == FIRST]
    crossing = [inputs]   # crossing[s]: what stage s receives
    for s in range(1, num_stages):
        crossing.append(sorted((v for v, r in last_reader.items() if owner[v] < s <= r), key=order.get))
    out = []
    for s in range(num_stages):
        outputs = crossing[s + 1] if s < last else ["output"]
        out.append({"inputs": crossing[s], "outputs": outputs})
    return out


def stage_graph(gm: fx.GraphModule, spec: dict, placeholders_of: dict,
                held: frozenset = frozenset()) -> tuple[fx.GraphModule, list]:
    """The local graph of one stage: its inputs, then the weights it reads, as placeholders.

    `placeholders_of`: local placeholder name -> (kind, name) for weights, buffers and constants. `held`: the
    nodes gathering a weight that the step gathers once and holds (held_weights.py): the stage takes their
    value as a placeholder, (HELD, node name), instead of gathering the weight itself.
    Returns the graph module and the (kind, name) of each weight placeholder, in order.
    """
    by_name = {n.name: n for n in gm.graph.nodes}
    is_last = spec["outputs"] == ["output"]
    roots = list(by_name["output"].all_input_nodes) if is_last else [by_name[v] for v in spec["outputs"]]
    needed, todo = set(), [n for n in roots if n.name not in spec["inputs"]]
    while todo:
        node = todo.pop()
        if node.name in needed:
            continue
        needed.add(node.name)
        if node.name not in held:   # a held weight comes whole: its shard and gather are not the stage's
            todo += [a for a in node.all_input_nodes if a.name not in spec["inputs"]]
    g = fx.Graph()
    env = {name: g.placeholder(name) for name in spec["inputs"]}
    weights = []
    for node in gm.graph.nodes:
        if node.name in needed and (node.op == "placeholder" or node.name in held):
            env[node.name] = g.placeholder(node.name)
            weights.append((HELD, node.name) if node.name in held else placeholders_of[node.name])
    for node in gm.graph.nodes:
        if node.name in needed and node.op != "placeholder" and node.name not in held:
            env[node.name] = g.node_copy(node, lambda a: env[a.name])
    if is_last:
        g.node_copy(by_name["output"], lambda a: env[a.name])
    else:
        g.output(tuple(env[v] for v in spec["outputs"]))
    g.lint()
    return fx.GraphModule(gm, g, class_name="StageGraph"), weights


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: it is sent back to the previous stage.

    At run time torch reads the gradient from the input's .grad, which takes the input's (contiguous)
    strides; but its shape inference takes it from autograd.grad, which keeps the layout backward made
    (an input read through a transpose gets a transposed gradient), and the previous stage makes its
    gradient receive buffer with those strides, which gloo and NCCL refuse."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class StageModule(torch.nn.Module):
    """One pipeline stage: the crossing tensors in, the next stage's (or the model's) outputs out."""

    def __init__(self, graph_module: fx.GraphModule, weights: list, owner, is_last: bool, held: HeldWeights):
        super().__init__()
        self.graph_module = graph_module
        self._weights = weights   # (kind, name) per weight placeholder
        self._owner = owner       # the ParallelModule: it holds the weights and the FSDP hooks
        self._is_last = is_last
        self._held = held         # the device's weights held whole through a step (held_weights.py)
        self.microbatches_left = None   # forwards with gradients this step still runs (PipelineRunner.step)

    def parameters(self, recurse: bool = True):
        """The weights this stage reads, though the ParallelModule holds them (a held weight: the whole tensor
        the step holds): a zero-bubble schedule computes their gradients in a pass of its own, from the stage
        module's parameters."""
        table = self._owner().weight_table()
        return iter([self._held.tensor(w[1]) if w[0] == HELD else table[w] for w in self._weights
                     if w[0] in (PARAM, HELD)])

    def forward(self, *inputs):
        pm = self._owner()
        table = pm.weight_table()
        inputs = [_ContiguousGrad.apply(t) if isinstance(t, torch.Tensor) and t.requires_grad else t for t in inputs]
        # a weight read through the gradient buckets (grad_buckets.py) when its data-axis reduction is theirs (a
        # held one went through them when the step gathered it)
        read = [w for w in self._weights if w[0] != HELD]
        routed = iter(pm.grad_buckets.use([w[1] for w in read], [table[w] for w in read]))
        if self.microbatches_left is not None and torch.is_grad_enabled():
            self.microbatches_left -= 1
            if self.microbatches_left == 0:   # their summed gradients reduce once this microbatch's backward is done
                pm.grad_buckets.last_read([w[1] for w in read])
        args = inputs + [self._held.tensor(w[1]) if w[0] == HELD else next(routed) for w in self._weights]
        try:
            with pm.gathered.hooks():
                flat = self.graph_module(*args)
        finally:
            pm.gathered.clear()
        if self._is_last:
            return unflatten_outputs(pm.output_spec, flat)
        # torch makes the next stage's receive buffers with these tensors' strides, and gloo and NCCL send and
        # receive only contiguous tensors: a view the graph made (attention's transposed output) is copied; so is
        # a contiguous view (a reshape's output), which torch's zero-bubble schedules detach in place once its
        # input gradients are made, and detach_ refuses views
        return tuple(_own_storage(t) if isinstance(t, torch.Tensor) else t for t in flat)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format) if view_base(t) is not None or not t.is_contiguous() else t


SCHEDULE_CLASSES = {GPIPE: "ScheduleGPipe", ONE_F_ONE_B: "Schedule1F1B", INTERLEAVED: "ScheduleInterleaved1F1B",
                    ZERO_BUBBLE: "ScheduleInterleavedZeroBubble"}


def make_schedule(stages: list, schedule: str, microbatches: int, loss_fn):
    """torch's schedule over this device's PipelineStages. `loss_fn` must already divide by the number of
    microbatches: torch would otherwise scale the gradients of the stage modules' own parameters, and
    ours hold none (the ParallelModule does)."""
    import torch.distributed.pipelining as pipelining
    cls = getattr(pipelining, SCHEDULE_CLASSES[schedule])
    first = stages if schedule in (INTERLEAVED, ZERO_BUBBLE) else stages[0]
    return cls(first, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


class StepLoss:
    """The loss a schedule is made with, once: each microbatch's share of the mean of the loss_fn that the
    running train_step passes (`calling`). A schedule per loss function would be rebuilt, and kept, each
    step for a loss made each step (a lambda); this one holds a loss function only while its step runs."""

    def __init__(self, has_targets: bool, num_microbatches: int):
        self.has_targets = has_targets
        self.num_microbatches = num_microbatches
        self.loss_fn = None

    @contextmanager
    def calling(self, loss_fn):
        self.loss_fn = loss_fn
        try:
            yield
        finally:
            self.loss_fn = None

    def __call__(self, out, target):
        loss = self.loss_fn(out, target) if self.has_targets else self.loss_fn(out)
        return loss / self.num_microbatches
