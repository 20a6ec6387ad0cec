"""Pipeline parallelism: what each op of the chosen layout costs a stage, and what one device of a
cut pipeline is predicted to cost per step.

op_costs charges each op its compute, its collectives and the activations it keeps, per
microbatch, and finds the bytes crossing every point of the graph (what a send between stages
there would carry), from an op_basis priced once for every set of stacks recomputed and held or
not; stage_partition.py cuts the graph with these numbers; device_prediction prices the busiest
device of the cut for the plan.

Some collectives run once per step, not once per microbatch, and are charged apart (`OpCosts.step_parts`):
the data-parallel gradient all-reduces (the runtime sums every microbatch's gradient and reduces the sum once:
grad_buckets.accumulating), ZeRO's reduce-scatters and weight all-gathers (at the optimizer step), and, when
FSDP weights are held across the microbatches (`held=True`: FSDP's reshard_after_forward=False under a
pipeline, runtime/pipeline/), their all-gathers and gradient reduce-scatters. A held weight costs its stage
the weight whole and its gradient whole for the step, instead of a gather per microbatch.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from types import MappingProxyType

import numpy as np
import torch

import cost_models as cm

from ..capture.export import BUFFER, INPUT, OP, PARAM, Captured
from ..cost.buckets import partial_gradients
from ..cost.predict import COMPILE_REGIONS, Memory, Predicted, redistribution_collectives
from ..cost.checkpointing import recomputed_ops, rerun_ops
from ..cost.problem import checkpoint_model
from ..cost.terms import (activation_bytes, collectives_bytes, collectives_time, copied_kept_bytes, first_meta,
                          node_compute_time, op_collectives, output_bytes, param_memory, reduce_itemsize,
                          regather_saving, zero_collectives)
from ..sharding.placement import local_shape, numel
from ..sharding.redistribute import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Collective
from .pipeline import IDLE_SHARE, INTERLEAVED, PipelinePlan, alive_counts, device_activations


@dataclass
class OpCosts:
    order: list               # op nodes in graph order: stage k runs order[cut_k:cut_k+1]
    time: list                # per op: compute + collectives charged there, per microbatch
    acts: list                # per op: bytes kept for backward
    users: dict               # param/buffer -> sorted positions of the ops that read it
    crossing: list            # per cut position k (before op k): bytes crossing, inf where no cut may fall
    parts: list               # per op: (compute s, {axis: comm bytes}, {axis: comm s}) per microbatch
    state_parts: dict         # param/buffer -> bytes of (weight, master copy, gradient, optimizer state,
                              # what the optimizer step moves); a held weight's whole copies included
    step_parts: list          # per op: ({axis: comm bytes}, {axis: comm s}) once per step (module docstring)

    @functools.cached_property
    def memo(self) -> dict:
        """What the stage cut derives from these costs once for every stage count it tries
        (stage_partition._cut_table)."""
        return {}

    @functools.cached_property
    def position(self) -> dict:
        """Op name -> its position in `order` (asked for every device of every cut tried)."""
        return {n: i for i, n in enumerate(self.order)}

    @functools.cached_property
    def read_index(self) -> tuple:
        """(the weights with state_parts that some op reads, in the order of `users`; every (reader position,
        index of its weight) pair as two arrays; each weight's state_parts), for _device_state."""
        names = [name for name, readers in self.users.items() if readers and name in self.state_parts]
        readers = [r for name in names for r in self.users[name]]
        weight = [k for k, name in enumerate(names) for _ in self.users[name]]
        return (names, np.asarray(readers, dtype=np.int64), np.asarray(weight, dtype=np.int64),
                [self.state_parts[name] for name in names])

    @functools.cached_property
    def weights_read(self) -> dict:
        """Op position -> the weights with state_parts it reads (device_state, for every device of every cut)."""
        out = {}
        for name, readers in self.users.items():
            if name in self.state_parts:
                for r in readers:
                    out.setdefault(r, []).append(name)
        return out


@dataclass
class OpBasis:
    """What op_costs prices alike for every set of stacks recomputed and for held weights or not (op_basis):
    on a 126-layer model pricing it takes seconds, and the planner asks for up to 8 sets of op costs."""
    order: list          # op nodes in graph order
    pos: dict            # op name -> position in order
    strategy: dict       # node -> its chosen strategy
    users: dict          # param/buffer -> sorted positions of the ops that read it
    compute: list        # per op: its compute, run once
    own: list            # per op: the collectives it runs itself (terms.op_collectives)
    state_parts: dict    # param/buffer -> OpCosts.state_parts, no weight held
    step_parts: list     # per op: ({axis: bytes}, {axis: s}) of the weights' once-per-step collectives
    groups: list         # predict.group_redistributions of the choice
    first: list          # per group: the position of its first consumer (the last op if none)
    colls: list          # per group: its collectives but the all-reduces the buckets do, as priced ...
    colls_inside: list   # ... and inside one recomputed region (no backward re-gather)
    crossing: list       # per cut position: bytes crossing (_crossing_bytes), before blocks forbid cuts

    @functools.cached_property
    def memo(self) -> dict:
        """What op_costs finds once for both ways of holding weights (_recomputed), and each collective's price."""
        return {}


def op_basis(prob, choice, groups) -> OpBasis:
    """The part of op_costs that holds whatever the stacks recomputed and the weights held. `groups`:
    group_redistributions(prob, choice)."""
    cap, mesh = prob.cap, prob.mesh
    order = [n.name for n in cap.graph.nodes if n.op == "call_function"]
    pos = {n: i for i, n in enumerate(order)}
    strategy = {n: ns.strategies[choice[n]] for n, ns in prob.strategies.items()}
    users = _readers(cap, pos)
    # gradients left partial for the buckets: reduced once per step, as one all-reduce of each weight
    deferred = partial_gradients(cap, strategy, prob.grad_nodes)
    compute, own = [0.0] * len(order), [[] for _ in order]
    state_parts = {}
    step_parts = [(dict.fromkeys(mesh.axis_names, 0.0), dict.fromkeys(mesh.axis_names, 0.0)) for _ in order]
    for name in prob.strategies:
        info, s = cap.info[name], strategy[name]
        if info.kind == PARAM:
            meta = first_meta(info.meta)
            m = param_memory(meta, s, mesh, prob.param_bytes[name])
            state_parts[name] = (float(m.params), float(m.master), float(m.grads), float(m.optimizer),
                                 float(m.update))
            if name in prob.grad_nodes and users.get(name):
                i = users[name][0]
                _charge(prob, step_parts[i], zero_collectives(name, meta, s, mesh, prob.param_bytes[name]))
                _charge(prob, step_parts[i], _bucket_all_reduces(prob, name, meta, s, deferred.get(name, ())))
        elif info.kind == BUFFER and info.meta is not None:
            meta = first_meta(info.meta)
            state_parts[name] = (float(numel(meta.hint) * meta.itemsize), 0.0, 0.0, 0.0, 0.0)
        elif info.kind == OP and name in pos:
            i = pos[name]
            compute[i] = float(node_compute_time(cap.node(name), cap, s, mesh, prob.hardware,
                                                 float8=prob.float8_of(name)))
            own[i] = op_collectives(cap.node(name), cap, s, mesh, float8=prob.float8_of(name))
    first, colls, colls_inside = [], [], []
    for r in groups:
        first.append(min((pos[c] for c, _ in r.consumers if c in pos), default=len(order) - 1))
        colls.append(_redistribution(prob, r, deferred))
        colls_inside.append(_redistribution(prob, replace(r, regather_count=0), deferred) if r.regather_count
                            else colls[-1])
    return OpBasis(order, pos, strategy, users, compute, own, state_parts, step_parts, groups, first,
                   colls, colls_inside, _crossing_bytes(cap, order, pos, strategy, mesh))


def _redistribution(prob, r, deferred: dict) -> list:
    """A group's collectives, less the gradient all-reduces the buckets do once per step."""
    return [c for c in redistribution_collectives(prob, r)
            if not (c.kind == ALL_REDUCE and c.phase == "backward" and c.axis in deferred.get(c.tensor, ()))]


def _charge(prob, parts: tuple, colls, priced: dict | None = None) -> None:
    """Adds each collective's bytes and seconds to `parts` ({axis: bytes}, {axis: s}), one at a time. `priced`:
    a memo of each collective's (axis name, bytes, seconds), by id (the collective kept alive in it)."""
    by, secs = parts
    for c in colls:
        got = priced.get(id(c)) if priced is not None else None
        if got is None:
            a = prob.mesh.axis_names[c.axis]
            got = (c, a, float(collectives_bytes([c], prob.mesh)[a]), float(collectives_time([c], prob.mesh,
                                                                                               prob.links)))
            if priced is not None:
                priced[id(c)] = got
        _, a, b, t = got
        by[a] += b
        secs[a] += t


def op_costs(prob, basis: OpBasis, held: bool = False, stacks=()) -> OpCosts:
    """Each op's share of a microbatch's time and memory under the chosen strategies (`basis`: op_basis of
    them), what crosses a cut at each point of the graph, and the collectives each op's weights pay once per
    step. `held`: FSDP weights are gathered once per step and held whole across the microbatches (prob prices
    them resharded). `stacks`: the CheckpointStacks whose blocks recompute: their ops keep what the checkpoint
    keeps, and the ops backward reruns pay their forward (compute and collectives) again.

    What does not depend on `held` is found once per set of stacks (_recomputed); an op that runs no collective
    shares one pair of empty {axis: 0} maps (read, never written)."""
    cap, mesh = prob.cap, prob.mesh
    order = basis.order
    rec = _recomputed(prob, basis, stacks)
    per_microbatch = {i: (dict(b), dict(t)) for i, (b, t) in rec.own.items()}   # op position -> its charges
    once = list(basis.step_parts)   # copied where charged
    state_parts = dict(basis.state_parts)
    priced = basis.memo.setdefault("priced", {})
    for r, first, plain, inside_colls, inside in zip(basis.groups, basis.first, basis.colls, basis.colls_inside,
                                                     rec.inside):
        # the recompute gathers a weight again rather than a backward re-gather (predict._redistributions)
        colls = inside_colls if inside else plain
        # a held weight is gathered once per step, before the schedule; a checkpointed block reads it whole, in
        # forward and in its rerun alike (runtime/pipeline/held_weights.py)
        held_weight = held and cap.info[r.producer].kind == PARAM and any(
            c.kind == ALL_GATHER and c.phase == "forward" for c in colls)
        if inside and order[first] in rec.passed and not held_weight:   # a rerun block runs its forward
            colls = colls + [c for c in colls if c.phase == "forward"]   # redistributions again
        if held_weight:
            colls = _held(colls, state_parts, r.producer, r.producer in prob.grad_nodes)
            gathers = [c for c in colls if c.kind in (ALL_GATHER, REDUCE_SCATTER)]
            if gathers:
                b, t = once[first]
                once[first] = (dict(b), dict(t)) if once[first] is basis.step_parts[first] else once[first]
                _charge(prob, once[first], gathers, priced)
            colls = [c for c in colls if c.kind not in (ALL_GATHER, REDUCE_SCATTER)]
        if colls:
            if first not in per_microbatch:
                per_microbatch[first] = (dict.fromkeys(mesh.axis_names, 0.0), dict.fromkeys(mesh.axis_names, 0.0))
            _charge(prob, per_microbatch[first], colls, priced)
    zero = _zero_parts(mesh)
    pairs = [per_microbatch.get(i, zero) for i in range(len(order))]
    compute = rec.compute
    time = [compute[i] + sum(pairs[i][1].values()) for i in range(len(order))]
    parts = [(compute[i], *pairs[i]) for i in range(len(order))]
    return OpCosts(order, time, list(rec.acts), basis.users, list(rec.crossing), parts, state_parts, once)


@dataclass
class _Recomputed:
    """What op_costs finds alike for held weights or not, per set of stacks recomputed."""
    compute: list     # per op: its compute, again for a third where backward reruns it
    acts: list        # per op: bytes kept for backward
    own: dict         # op position -> ({axis: bytes}, {axis: s}) of the collectives it runs itself, where it runs any
    inside: list      # per group of basis.groups: its consumers are inside one recomputed region
    passed: set       # the ops backward's rerun passes
    crossing: list    # per cut position: bytes crossing, inf inside a checkpointed block


def _recomputed(prob, basis: OpBasis, stacks) -> _Recomputed:
    key = ("recomputed", tuple(st.key for st in stacks))
    got = basis.memo.get(key)
    if got is not None:
        return got
    cap, mesh = prob.cap, prob.mesh
    order, pos, strategy = basis.order, basis.pos, basis.strategy
    saved = checkpoint_model(prob, tuple(st.key for st in stacks)) if stacks else prob.saved
    rerun = set().union(*(recomputed_ops(st, prob.saved) for st in stacks))
    passed = set().union(*(rerun_ops(st, prob.saved) for st in stacks))
    region_of = {n: (st.path, i) for st in stacks for i, block in enumerate(st.blocks) for n in block}
    compute = list(basis.compute)
    acts = [0.0] * len(order)
    own_parts = {}
    priced = basis.memo.setdefault("priced", {})
    for name, s in strategy.items():
        info = cap.info[name]
        if info.kind == OP and name in pos:
            i = pos[name]
            acts[i] = float(activation_bytes(name, cap, s.output, mesh, saved, strategy=s))
            own = basis.own[i]
            if name in rerun:   # backward runs its forward again: a third more compute, its forward collectives
                compute[i] += compute[i] / cm.TRAIN_FLOPS_FACTOR
                own = own + [c for c in own if c.phase == "forward"]
            if own:
                own_parts[i] = (dict.fromkeys(mesh.axis_names, 0.0), dict.fromkeys(mesh.axis_names, 0.0))
                _charge(prob, own_parts[i], own, priced)
        elif info.kind == INPUT:
            acts[0] += float(activation_bytes(name, cap, s.output, mesh, saved)) if order else 0.0
    inside_of = []
    for r, first in zip(basis.groups, basis.first):
        regions = {region_of.get(c) for c, _ in r.consumers}
        inside_of.append(len(regions) == 1 and None not in regions)
        for c, i in r.consumers:   # an activation kept as its shard where it is gathered (sequence parallel)
            if c in pos:
                acts[pos[c]] += float(regather_saving(cap, saved if prob.regather_activations else None, r.producer, c,
                                                      i, r.src, r.dst, r.grad_partial, mesh, prob.grad_nodes))
        # a reader kept as the all-to-all's new tensor (Ulysses; terms.copied_kept_bytes)
        acts[first] += float(copied_kept_bytes(cap, saved, r.producer, r.consumers, r.src, r.dst, r.grad_partial,
                                               mesh))
    crossing = list(basis.crossing)
    for st in stacks:   # a checkpointed block runs as one region (runtime/lowering/recompute.py): no cut inside
        for block in st.blocks:
            where = [pos[n] for n in block if n in pos]
            for k in range(min(where, default=0) + 1, max(where, default=0) + 1):
                crossing[k] = math.inf
    got = basis.memo[key] = _Recomputed(compute, acts, own_parts, inside_of, passed, crossing)
    return got


@functools.lru_cache(maxsize=64)
def _zero_parts(mesh) -> tuple:
    """({axis: 0.0}, {axis: 0.0}), read-only: the per-microbatch charges of an op that runs no collective."""
    return (MappingProxyType(dict.fromkeys(mesh.axis_names, 0.0)), MappingProxyType(dict.fromkeys(mesh.axis_names, 0.0)))


def _bucket_all_reduces(prob, name: str, meta, s, axes) -> list:
    """The all-reduce of a weight's summed gradient on each deferred axis, once per step (predict.bucketed
    prices the same bytes in buckets; latency per weight here instead of per bucket)."""
    itemsize = reduce_itemsize(prob.param_bytes, name) or meta.itemsize
    nbytes = numel(local_shape(meta.hint, s.output, prob.mesh.axis_sizes)) * itemsize
    return [Collective(ALL_REDUCE, a, nbytes, "backward", f"gradient of {name}", name) for a in axes]


def _held(colls: list, state_parts: dict, param: str, trained: bool = True) -> list:
    """A weight held whole for the step: one forward all-gather and one gradient reduce-scatter per step (no
    gather again in backward), and its stage holds the weight whole and its gradient whole (summed over the
    microbatches; none where the weight is frozen, not `trained`) besides the shard: `state_parts` grows by both.
    Returns the collectives it still runs."""
    gathers = [c for c in colls if c.kind == ALL_GATHER and c.phase == "forward"]
    # the last gather's output: the weight whole, in the dtype it is gathered in (the compute dtype); its
    # gradient accumulates in that dtype too, as FSDP2's unsharded gradients do
    whole = max(float(c.full_bytes) for c in gathers)
    grad_whole = whole if trained else 0.0
    weight, master, grad, opt, update = state_parts[param]
    state_parts[param] = (weight + whole, master, grad + grad_whole, opt, update)
    return [c for c in colls if not (c.kind == ALL_GATHER and c.phase == "backward")]


def _readers(cap: Captured, pos: dict) -> dict:
    """Parameter/buffer -> positions of the ops that read it (through views and shape reads alike)."""
    out = {}
    for node in cap.graph.nodes:
        if node.op == "placeholder" and cap.info[node.name].kind in (PARAM, BUFFER):
            out[node.name] = sorted({pos[u.name] for u in node.users if u.name in pos})
    return out


def _crossing_bytes(cap: Captured, order, pos, strategy, mesh) -> list:
    """Bytes alive across each cut point, in the layouts they are made in (what a send carries).

    A value that is not a tensor (a shape read, a tuple before its getitems) cannot be sent: the
    runtime recomputes shape reads where they are needed (so their tensor lives on to there), and a
    cut inside a tuple's getitems is not allowed.
    """
    n = len(order)
    delta = [0.0] * (n + 2)
    blocked = [False] * (n + 1)
    for node in cap.graph.nodes:
        info = cap.info[node.name]
        if info.kind not in (OP, INPUT):
            continue
        start = pos.get(node.name, -1) + 1   # a cut at k separates ops < k from ops >= k
        last = _last_reader(node, pos, n)
        if last < start:
            continue
        if isinstance(info.meta, list):
            for k in range(start, last + 1):
                blocked[k] = True
            continue
        if info.meta is None or node.name not in strategy:
            continue
        b = float(output_bytes(node.name, cap, strategy[node.name].output, mesh))
        delta[start] += b
        delta[last + 1] -= b
    out, running = [], 0.0
    for k in range(n + 1):
        running += delta[k]
        out.append(math.inf if blocked[k] else running)
    return out


def _last_reader(node, pos, n) -> int:
    """Position of the last op that needs `node`'s value (through non-tensor readers; n: the output)."""
    last = -1
    for u in node.users:
        if u.op == "output":
            last = n    # the model's outputs leave from the last stage
        elif u.name in pos:
            last = max(last, pos[u.name], _last_reader(u, pos, n) if _is_shape(u) else -1)
    return last


def _is_shape(node) -> bool:
    return not isinstance(node.meta.get("val"), (torch.Tensor, list, tuple))


def device_state(costs: OpCosts, idx) -> list:
    """Bytes of (weights, master copies, gradients, optimizer state, what the optimizer step moves) of every
    weight the ops at positions `idx` read, each once."""
    read = set().union(*(costs.weights_read.get(i, ()) for i in idx))
    read = [name for name in costs.users if name in read]   # in the order of `users`, as the sums always added
    return [sum(costs.state_parts[x][k] for x in read) for k in range(5)]


def _device_positions(costs: OpCosts, pipe: PipelinePlan, coord: int):
    """The op positions of the stages the device at `coord` runs: as [start, end) runs where each stage is a run of
    `order` (as partition cuts them), else as a list."""
    pos = costs.position
    runs = []
    for s in pipe.stages_on(coord):
        nodes = pipe.stages[s].nodes
        if not nodes:
            continue
        i = pos[nodes[0]]
        if i + len(nodes) > len(costs.order) or costs.order[i + len(nodes) - 1] != nodes[-1] or \
                tuple(costs.order[i:i + len(nodes)]) != nodes:
            return [pos[x] for s in pipe.stages_on(coord) for x in pipe.stages[s].nodes]
        runs.append((i, i + len(nodes)))
    return runs


def _device_state(costs: OpCosts, pipe: PipelinePlan, coord: int) -> list:
    """device_state of the ops of the device at `coord`: the weights any of its runs of ops reads, found with
    numpy, summed one by one in the order of `users` as device_state sums them."""
    where = _device_positions(costs, pipe, coord)
    if where and not isinstance(where[0], tuple):
        return device_state(costs, where)
    names, readers, weight, parts = costs.read_index
    inside = np.zeros(len(costs.order) + 1, dtype=np.int64)
    for i, j in where:
        inside[i] += 1
        inside[j] -= 1
    covered = np.cumsum(inside) > 0
    chosen = np.zeros(len(names), dtype=bool)
    chosen[weight[covered[readers]]] = True
    read = [parts[k] for k in np.flatnonzero(chosen)]
    return [sum(x[k] for x in read) for k in range(5)]


def device_memory(costs: OpCosts, pipe: PipelinePlan, coord: int, transient: float) -> float:
    """Peak bytes on the device at `coord` of the pipeline axis: the state of every weight its stages read,
    the activations each of its stages keeps in flight at the schedule's peak, and the working set once."""
    return sum(_device_state(costs, pipe, coord)[:4]) + _device_activations(pipe, coord) + transient


def _device_activations(pipe: PipelinePlan, coord: int) -> float:
    """pipeline.device_activations, over the schedule's distinct counts of microbatches in flight only, and of
    those, where no stage keeps less than nothing, only the counts no other count exceeds on every stage (their
    sums are the largest: rounding keeps the order of what it rounds)."""
    if pipe.schedule != INTERLEAVED:
        return device_activations(pipe, coord)
    stages = [pipe.stages[s] for s in pipe.stages_on(coord)]
    every, most = alive_counts(pipe.num_stages // pipe.stages_per_device, pipe.stages_per_device,
                                pipe.microbatches, coord)
    counts = most if all(st.activations >= 0 for st in stages) else every
    return max(sum(n * st.activations for n, st in zip(alive, stages)) for alive in counts)


def device_prediction(prob, costs: OpCosts, pipe: PipelinePlan, transient: float):
    """Predicted per step for the device of the pipeline that needs the most memory: its stages' weights, the
    activations in flight, every microbatch's collectives and sends, the collectives paid once per step, and
    the step time of the schedule."""
    pos = costs.position
    mesh, m = prob.mesh, pipe.microbatches
    p = pipe.num_stages // pipe.stages_per_device
    link = prob.links[pipe.axis]
    coord = max(range(p), key=lambda c: device_memory(costs, pipe, c, transient))
    total = device_memory(costs, pipe, coord, transient)
    idx = [pos[x] for s in pipe.stages_on(coord) for x in pipe.stages[s].nodes]
    params, master, grads, opt, update = _device_state(costs, pipe, coord)
    acts = _device_activations(pipe, coord)
    optimizer_time = float(cm.optimizer_time(update, prob.hardware))   # after the schedule, on the busiest device
    comm_bytes = {a: m * sum(costs.parts[i][1][a] for i in idx) + sum(costs.step_parts[i][0][a] for i in idx)
                  for a in mesh.axis_names}
    comm_time = {a: m * sum(costs.parts[i][2][a] for i in idx) + sum(costs.step_parts[i][1][a] for i in idx)
                 for a in mesh.axis_names}
    sends = [pipe.stages[s].send_bytes for s in pipe.stages_on(coord)]
    recvs = [pipe.stages[s - 1].send_bytes for s in pipe.stages_on(coord) if s > 0]
    comm_bytes[pipe.axis] += m * (sum(sends) + sum(recvs))   # activations out, gradients of the inputs back
    comm_time[pipe.axis] += m * sum(float(cm.collective_time(cm.SEND_RECV, b, 2, link)) for b in sends + recvs)
    compute = m * sum(costs.parts[i][0] for i in idx)
    mem = Memory(params, grads, opt, acts, transient, total, master)
    # what the device pays once per step hides in the pipeline's idle time around its own microbatches
    # (hidden_once); every per-microbatch collective and send is priced as waited for, and the stages' compute
    # as run eagerly (compiled_step_time: the same, no fusion claimed)
    once = {a: sum(costs.step_parts[i][1][a] for i in idx) for a in mesh.axis_names}
    hidden = hidden_once(once, idle_window(prob, pipe.stages, coord, pipe.schedule))
    return Predicted(mem, comm_bytes, comm_time, compute, pipe.step_time + optimizer_time,
                     {cm.SEND_RECV: m * (sum(sends) + sum(recvs))},
                     {a: comm_time[a] - hidden[a] for a in mesh.axis_names}, optimizer_time,
                     pipe.step_time + optimizer_time, dict.fromkeys(COMPILE_REGIONS, 0.0))


def idle_window(prob, stages, coord: int, schedule: str) -> float:
    """Seconds a step leaves the device at `coord` of the pipeline axis idle after its own microbatches, where
    the collectives it pays once per step (hidden_once) run without lengthening the step.

    Under 1F1B and GPipe (torch's schedules: a stage runs a microbatch once the one before has sent it), device
    c ends its last backward as soon as it has sent microbatch m-1's gradient back, while stages c-1..0 still
    run theirs: it idles the backwards (B, 1 - 1/TRAIN_FLOPS_FACTOR of a stage's time) of the stages before it.
    There the runtime reduces its summed gradients anyway (runtime/pipeline/runner.py: as the schedule ends,
    before the loss's broadcast, which may wait for device 0's: a send may wait for its receiver), so they
    cost the step only what exceeds it; device 0 idles nothing there and waits for all of them. The forwards of the stages before it,
    which device c idles at the step's start (where held weights are gathered), are not counted: the window is
    one for all the device's once-per-step collectives, whose kinds op_costs does not keep apart, so the smaller
    one. Interleaved 1F1B: the same, over the stages before c (the first of each device's stages). Zero bubble
    fills the drain with weight-gradient passes: only its priced idle share (IDLE_SHARE) is counted. The window
    is less than the bubble the step already counts ((p-1) x IDLE_SHARE x the slowest stage), so no idle time
    counts twice. 0 where the hardware's collectives take the compute's cores (Hardware.comm_overlaps_compute:
    they would slow the devices that compute meanwhile, as in cost/overlap.py). `stages`: every Stage of the
    pipeline, in order."""
    if not prob.hardware.comm_overlaps_compute:
        return 0.0
    backward = 1 - 1 / cm.TRAIN_FLOPS_FACTOR
    return IDLE_SHARE[schedule] * backward * sum(st.time for st in stages[:coord])


def hidden_once(once: dict, window: float) -> dict:
    """Axis name -> seconds of the once-per-step collectives `once` (axis name -> seconds) that hide in an idle
    `window` of that many seconds: all of them if they fit, else each axis's share of the window (they run one
    after another, each axis as much of it as its share of their time)."""
    total = sum(once.values())
    share = min(1.0, window / total) if total > 0 else 0.0
    return {a: t * share for a, t in once.items()}
