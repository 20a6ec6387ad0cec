"""Pipeline parallelism, planning side: cut the graph into stages and price the schedule.

One mesh axis (the pipeline axis) holds consecutive stages of the model
instead of copies of it; the batch goes through in microbatches. Within a
stage the other axes still split it as the ILP chose (the pipeline axis
plays role classics.PIPE there: every tensor whole on it).

The cut is a dynamic program over the captured graph in its order: each
stage is a contiguous run of ops, so what crosses a cut is exactly the
tensors made before it and read after it (sent forward, their gradients
sent back). The program minimises the slowest stage (the pipeline runs at
its pace), counting every op where it runs -- the embedding and the output
head included, so a big vocabulary makes the first and last stages shorter
by itself -- and rejects a cut whose stage does not fit memory_limit with
the activations the schedule keeps in flight on it.

Schedules (torch.distributed.pipelining): GPipe runs every microbatch's
forward, then every backward (all m in flight); 1F1B alternates once the
pipe is full, so stage s holds at most p - s; both idle (p-1)/m of the
step (the bubble). Interleaved 1F1B puts v stages on each device, cutting
the bubble to (p-1)/(v m) for more sends.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass

import cost_models as cm

from ..capture.export import BUFFER, INPUT, OP, PARAM, Captured
from ..cost.terms import (activation_bytes, collectives_bytes, collectives_time, node_compute_time,
                          output_bytes, param_memory, zero_collectives, first_meta)
from ..errors import PipelineError
from ..sharding.placement import numel

GPIPE, ONE_F_ONE_B, INTERLEAVED = "gpipe", "1f1b", "interleaved-1f1b"
SCHEDULES = (ONE_F_ONE_B, GPIPE, INTERLEAVED)
STAGES_PER_DEVICE = {GPIPE: 1, ONE_F_ONE_B: 1, INTERLEAVED: 2}
# a cut may fall where at most this many times the fewest bytes of the model's body cross: "few bytes"
# (a transformer's residual stream between blocks, or between attention and MLP), not mid-attention
CUT_SLACK = 2.0


@dataclass(frozen=True)
class Stage:
    index: int
    nodes: tuple              # the captured graph's ops this stage runs, in graph order
    modules: str              # the module paths they come from, compressed ("wte, h.0-3")
    time: float               # seconds per microbatch: forward + backward, its collectives, its sends
    memory: float             # peak bytes on a device that holds this stage
    activations: float        # bytes autograd keeps per microbatch (memory holds `in_flight` of them)
    in_flight: int            # microbatches whose activations the schedule keeps on it at once
    send_bytes: float         # per microbatch, to the next stage (the same again comes back as gradients)


@dataclass(frozen=True)
class PipelinePlan:
    axis: str
    num_stages: int           # pipeline axis size x stages per device
    microbatches: int
    schedule: str
    stages: tuple             # Stage, in order
    bubble: float             # idle fraction of the step relative to useful work: (p-1)/m, or (p-1)/(v m)
    step_time: float

    @property
    def stages_per_device(self) -> int:
        return STAGES_PER_DEVICE[self.schedule]

    def stage_of(self) -> dict:
        return {n: s.index for s in self.stages for n in s.nodes}

    def stages_on(self, coord: int) -> list[int]:
        """Stage indices the device at `coord` on the pipeline axis runs (Interleaved: coord, coord + p, ...)."""
        p = self.num_stages // self.stages_per_device
        return list(range(coord, self.num_stages, p))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stages"] = [dict(asdict(s), nodes=list(s.nodes)) for s in self.stages]
        return d

    @staticmethod
    def from_dict(d: dict) -> "PipelinePlan":
        stages = tuple(Stage(**dict(s, nodes=tuple(s["nodes"]))) for s in d["stages"])
        return PipelinePlan(**dict(d, stages=stages))


# ---------------------------------------------------------------- requests

def check_request(spec, pipeline_axis, microbatches, schedule, batch: int | None) -> None:
    """Bad pipeline options fail before any capture or search, with what to do."""
    if schedule is not None and schedule not in SCHEDULES:
        raise PipelineError(f"schedule={schedule!r}: use one of {', '.join(SCHEDULES)}")
    if pipeline_axis not in (None, "auto") and pipeline_axis not in spec.axis_names:
        raise PipelineError(f"pipeline_axis={pipeline_axis!r} is not an axis of mesh {spec} (axes "
                            f"{list(spec.axis_names)}); name one of them, 'auto' to let the search choose, "
                            f"or None for no pipeline")
    if pipeline_axis is None and (microbatches is not None or schedule is not None):
        raise PipelineError("microbatches= and schedule= set up a pipeline, but pipeline_axis=None turns "
                            "pipelining off; name the pipeline axis (or 'auto')")
    if microbatches is not None:
        if not isinstance(microbatches, int) or microbatches < 1:
            raise PipelineError(f"microbatches={microbatches!r}: give a positive integer")
        if batch is not None and batch % microbatches:
            raise PipelineError(f"microbatches={microbatches} does not divide the batch of {batch} (dim 0 of "
                                f"the first input); use a divisor of {batch}")


def num_layers(cap: Captured) -> dict:
    """Stack path -> its number of layers (blocks of an nn.ModuleList)."""
    from ..capture.blocks import block_nodes
    return {path: len(blocks) for path, blocks in block_nodes(cap).items()}


def check_depth(cap: Captured, num_stages: int, axis: str) -> None:
    """More stages than layers leaves a stage with nothing worth a device: say so, naming the layers."""
    stacks = num_layers(cap)
    layers = max(stacks.values(), default=1)
    if num_stages > layers:
        where = ", ".join(f"{p} ({n})" for p, n in stacks.items()) or "no stack of repeated layers"
        raise PipelineError(f"pipeline axis {axis!r} asks for {num_stages} stages but the model has {layers} "
                            f"layer(s) to spread over them ({where}); use a smaller pipeline axis, "
                            "schedule='1f1b' instead of interleaving, or another axis for pipelining")


def microbatch_candidates(p: int, batch: int, pinned: int | None) -> list[int]:
    """What the search tries when the user pins no count: p, 2p and 4p microbatches (fewer than p
    leaves a stage idle most of the step; past 4p the bubble is already under a quarter of p-1 parts
    in p, while every microbatch pays its collectives' latency again)."""
    if pinned is not None:
        return [pinned]
    return [m for m in (p, 2 * p, 4 * p) if batch % m == 0] or [batch]


# ---------------------------------------------------------------- costs per op

@dataclass
class _Costs:
    order: list               # op nodes in graph order: stage k runs order[cut_k:cut_k+1]
    time: list                # per op: compute + collectives charged there, per microbatch
    acts: list                # per op: bytes kept for backward
    users: dict               # param/buffer -> sorted positions of the ops that read it
    crossing: list            # per cut position k (before op k): bytes crossing, inf where no cut may fall
    parts: list               # per op: (compute s, {axis: comm bytes}, {axis: comm s})
    state_parts: dict         # param/buffer -> bytes of (weight, master copy, gradient, optimizer state)


def op_costs(prob, choice) -> _Costs:
    """Each op's share of a microbatch's time and memory under the chosen strategies, and what crosses
    a cut at each point of the graph."""
    from ..cost.predict import group_redistributions, redistribution_collectives
    cap, mesh = prob.cap, prob.mesh
    order = [n.name for n in cap.graph.nodes if n.op == "call_function"]
    pos = {n: i for i, n in enumerate(order)}
    strategy = {n: ns.strategies[choice[n]] for n, ns in prob.strategies.items()}
    compute = [0.0] * len(order)
    acts = [0.0] * len(order)
    comm_bytes = [dict.fromkeys(mesh.axis_names, 0.0) for _ in order]
    comm_time = [dict.fromkeys(mesh.axis_names, 0.0) for _ in order]

    def charge(i, colls):
        for c in colls:
            a = mesh.axis_names[c.axis]
            comm_bytes[i][a] += float(collectives_bytes([c], mesh)[a])
            comm_time[i][a] += float(collectives_time([c], mesh, prob.links))

    users = _readers(cap, pos)
    state_parts = {}
    for name, ns in prob.strategies.items():
        info, s = cap.info[name], strategy[name]
        if info.kind == PARAM:
            m = param_memory(first_meta(info.meta), s, mesh, prob.param_bytes[name])
            state_parts[name] = (float(m.params), float(m.master), float(m.grads), float(m.optimizer))
            if name in prob.grad_nodes and users.get(name):
                charge(users[name][0], zero_collectives(name, first_meta(info.meta), s, mesh, prob.param_bytes[name]))
        elif info.kind == BUFFER and info.meta is not None:
            meta = first_meta(info.meta)
            state_parts[name] = (float(numel(meta.hint) * meta.itemsize), 0.0, 0.0, 0.0)
        elif info.kind == OP and name in pos:
            i = pos[name]
            acts[i] = float(activation_bytes(name, cap, s.output, mesh, prob.saved))
            compute[i] = float(node_compute_time(cap.node(name), cap, s, mesh, prob.hardware))
        elif info.kind == INPUT:
            acts[0] += float(activation_bytes(name, cap, s.output, mesh, prob.saved)) if order else 0.0
    for r in group_redistributions(prob, choice):
        first = min((pos[c] for c, _ in r.consumers if c in pos), default=len(order) - 1)
        charge(first, redistribution_collectives(prob, r))
    time = [compute[i] + sum(comm_time[i].values()) for i in range(len(order))]
    parts = [(compute[i], comm_bytes[i], comm_time[i]) for i in range(len(order))]
    crossing = _crossing_bytes(cap, order, pos, strategy, mesh)
    return _Costs(order, time, acts, users, crossing, parts, state_parts)


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
    import torch
    return not isinstance(node.meta.get("val"), (torch.Tensor, list, tuple))


# ---------------------------------------------------------------- the cut

def in_flight(schedule: str, stage: int, num_stages: int, microbatches: int) -> int:
    """Microbatches whose activations a stage holds at the schedule's peak."""
    v = STAGES_PER_DEVICE[schedule]
    p = num_stages // v
    if schedule == GPIPE:
        return microbatches
    if schedule == ONE_F_ONE_B:
        return min(microbatches, num_stages - stage)
    # torch's interleaved 1F1B warms device r up with (v-1)p + 2(p-1-r) chunks before its first backward
    r = stage % p
    return min(microbatches, math.ceil(((v - 1) * p + 2 * (p - 1 - r) + 1) / v))


def partition(prob, costs: _Costs, *, axis: str, microbatches: int, schedule: str, memory_limit=None,
              transient: float = 0.0) -> PipelinePlan:
    """The cut into stages that makes the slowest stage fastest, each stage fitting `memory_limit`.
    `costs`: op_costs of the chosen strategies."""
    mesh = prob.mesh
    p = mesh.axis_sizes[mesh.axis_index(axis)]
    num_stages = p * STAGES_PER_DEVICE[schedule]
    link = prob.links[axis]
    n = len(costs.order)
    t_sum, a_sum, s_sum = _prefix(costs.time), _prefix(costs.acts), [0.0] * n
    shared = []   # weights read in more than one place: a stage holds its own copy if it reads it
    for name, parts in costs.state_parts.items():
        st = sum(parts)
        readers = costs.users.get(name) or []
        if readers:
            s_sum[readers[0]] += st
            if readers[-1] != readers[0]:
                shared.append((readers, st))
    s_sum = _prefix(s_sum)

    def send(k):   # activations forward and their gradients back, per microbatch
        return 0.0 if k in (0, n) else 2 * float(cm.collective_time(cm.SEND_RECV, costs.crossing[k], 2, link))

    def state(i, j):
        extra = sum(st for readers, st in shared if readers[0] < i and any(i <= r < j for r in readers))
        return s_sum[j] - s_sum[i] + extra

    reads = sorted({r for rs in costs.users.values() for r in rs})

    def holds_weights(i, j):   # a device with no weights to train wastes its share (and an optimizer refuses it)
        k = bisect.bisect_left(reads, i)
        return k < len(reads) and reads[k] < j

    def memory(i, j, s):
        return state(i, j) + in_flight(schedule, s, num_stages, microbatches) * (a_sum[j] - a_sum[i]) + transient

    cuts = _cut_points(costs)
    if len(cuts) - 1 < num_stages:
        raise PipelineError(f"the model has {len(cuts) - 1} place(s) where a cut passes few bytes, too few for "
                            f"{num_stages} stages on pipeline axis {axis!r}; use fewer stages")
    best = {(0, 0): (0.0, 0.0, None)}   # (stages, cut) -> (slowest stage, total, previous cut)
    for s in range(1, num_stages + 1):
        for j in cuts:
            if j == 0 or (s == num_stages) != (j == n):
                continue
            for i in cuts:
                if i >= j or (s - 1, i) not in best or not holds_weights(i, j):
                    continue
                if memory_limit is not None and memory(i, j, s - 1) > memory_limit:
                    continue
                t = t_sum[j] - t_sum[i] + send(i) + send(j)
                prev = best[(s - 1, i)]
                cand = (max(prev[0], t), prev[1] + t, i)
                if (s, j) not in best or cand[:2] < best[(s, j)][:2]:
                    best[(s, j)] = cand
    if (num_stages, n) not in best:
        share = memory(0, n, 0) / num_stages   # the whole model, stage 0's microbatches in flight, split evenly
        raise PipelineError(f"no cut of the model into {num_stages} stages on pipeline axis {axis!r} fits "
                            f"memory_limit={cm.format_bytes(memory_limit)} per device with {microbatches} "
                            f"microbatches under {schedule} (an even share of the model would be about "
                            f"{cm.format_bytes(share)}, and layers cannot be split finer than the cut points); "
                            "raise the limit, use 1f1b (fewer microbatches in flight than gpipe), or more devices")
    bounds, k = [n], n
    for s in range(num_stages, 0, -1):
        k = best[(s, k)][2]
        bounds.append(k)
    bounds.reverse()
    stages = []
    for s in range(num_stages):
        i, j = bounds[s], bounds[s + 1]
        nodes = tuple(costs.order[i:j])
        stages.append(Stage(s, nodes, compress_paths(prob.cap.info[x].module_path for x in nodes),
                            t_sum[j] - t_sum[i] + send(i) + send(j), memory(i, j, s), a_sum[j] - a_sum[i],
                            in_flight(schedule, s, num_stages, microbatches),
                            costs.crossing[j] if j < n else 0.0))
    v = STAGES_PER_DEVICE[schedule]
    slowest = max(st.time for st in stages)
    per_device = max(sum(stages[s].time for s in range(c, num_stages, p)) for c in range(p))
    return PipelinePlan(axis, num_stages, microbatches, schedule, tuple(stages), (p - 1) / (v * microbatches),
                        microbatches * per_device + (p - 1) * slowest)


def _prefix(values) -> list:
    out = [0.0]
    for x in values:
        out.append(out[-1] + x)
    return out


def _cut_points(costs: _Costs) -> list:
    """Where a stage may end: the ends, and the points where at most CUT_SLACK times the fewest bytes
    crossing anywhere in the model's body (between its first and last weight) cross."""
    n = len(costs.order)
    readers = [r for rs in costs.users.values() for r in rs]
    lo, hi = (min(readers) + 1, max(readers)) if readers else (1, n - 1)
    body = [c for c in costs.crossing[lo:hi + 1] if c < math.inf] or [c for c in costs.crossing if c < math.inf]
    fewest = min(body) if body else 0.0
    return [0] + [k for k in range(1, n) if costs.crossing[k] <= CUT_SLACK * fewest] + [n]


def compress_paths(paths) -> str:
    """Module paths to a short list: each up to its layer number, consecutive layers as a range."""
    heads = []
    for path in paths:
        parts = path.split(".") if path else ["<root>"]
        k = next((i for i, x in enumerate(parts) if x.isdigit()), 0)
        head = ".".join(parts[:k + 1])
        if not heads or heads[-1] != head:
            if head not in heads:
                heads.append(head)
    out = []   # (prefix, first, last) runs of numbered heads, or (head, None, None)
    for h in heads:
        prefix, _, num = h.rpartition(".")
        if num.isdigit() and out and out[-1][0] == prefix and out[-1][2] == int(num) - 1:
            out[-1] = (prefix, out[-1][1], int(num))
        elif num.isdigit():
            out.append((prefix, int(num), int(num)))
        else:
            out.append((h, None, None))
    return ", ".join(p if a is None else f"{p}.{a}" if a == b else f"{p}.{a}-{b}" for p, a, b in out)


def device_prediction(prob, costs: _Costs, pipe: PipelinePlan, transient: float):
    """Predicted per step for the busiest device of the pipeline: its stages' weights, the activations in
    flight, every microbatch's collectives and sends, and the step time of the schedule."""
    from ..cost.predict import Memory, Predicted
    pos = {n: i for i, n in enumerate(costs.order)}
    mesh, m = prob.mesh, pipe.microbatches
    p = pipe.num_stages // pipe.stages_per_device
    link = prob.links[pipe.axis]
    best = None
    for coord in range(p):
        idx = [pos[x] for s in pipe.stages_on(coord) for x in pipe.stages[s].nodes]
        read = {name for name, rs in costs.users.items() if any(r in set(idx) for r in rs)}
        parts = [sum(costs.state_parts[x][k] for x in read if x in costs.state_parts) for k in range(4)]
        acts = sum(pipe.stages[s].activations * pipe.stages[s].in_flight for s in pipe.stages_on(coord))
        total = sum(parts) + acts + transient
        if best is None or total > best[0]:
            best = (total, coord, idx, parts, acts)
    total, coord, idx, (params, master, grads, opt), acts = best
    comm_bytes = {a: m * sum(costs.parts[i][1][a] for i in idx) for a in mesh.axis_names}
    comm_time = {a: m * sum(costs.parts[i][2][a] for i in idx) for a in mesh.axis_names}
    sends = [pipe.stages[s].send_bytes for s in pipe.stages_on(coord)]
    recvs = [pipe.stages[s - 1].send_bytes for s in pipe.stages_on(coord) if s > 0]
    comm_bytes[pipe.axis] += m * (sum(sends) + sum(recvs))   # activations out, gradients of the inputs back
    comm_time[pipe.axis] += m * sum(float(cm.collective_time(cm.SEND_RECV, b, 2, link)) for b in sends + recvs)
    compute = m * sum(costs.parts[i][0] for i in idx)
    mem = Memory(params, grads, opt, acts, transient, total, master)
    return Predicted(mem, comm_bytes, comm_time, compute, pipe.step_time,
                     {cm.SEND_RECV: m * (sum(sends) + sum(recvs))})
