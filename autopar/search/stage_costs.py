"""Pipeline parallelism: what each op of the chosen layout costs a stage, and what one device of a
cut pipeline is predicted to cost per step.

op_costs charges each op its compute, its collectives and the activations it keeps, per
microbatch, and finds the bytes crossing every point of the graph (what a send between stages
there would carry); stage_partition.py cuts the graph with these numbers; device_prediction
prices the busiest device of the cut for the plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import cost_models as cm

from ..capture.export import BUFFER, INPUT, OP, PARAM, Captured
from ..cost.predict import Memory, Predicted, group_redistributions, redistribution_collectives
from ..cost.problem import regather_model
from ..cost.terms import (activation_bytes, collectives_bytes, collectives_time, copied_kept_bytes, first_meta,
                          node_compute_time, op_collectives, output_bytes, param_memory, regather_saving,
                          zero_collectives)
from ..sharding.placement import numel
from .pipeline import PipelinePlan


@dataclass
class OpCosts:
    order: list               # op nodes in graph order: stage k runs order[cut_k:cut_k+1]
    time: list                # per op: compute + collectives charged there, per microbatch
    acts: list                # per op: bytes kept for backward
    users: dict               # param/buffer -> sorted positions of the ops that read it
    crossing: list            # per cut position k (before op k): bytes crossing, inf where no cut may fall
    parts: list               # per op: (compute s, {axis: comm bytes}, {axis: comm s})
    state_parts: dict         # param/buffer -> bytes of (weight, master copy, gradient, optimizer state,
                              # what the optimizer step moves)


def op_costs(prob, choice) -> OpCosts:
    """Each op's share of a microbatch's time and memory under the chosen strategies, and what crosses
    a cut at each point of the graph."""
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
            state_parts[name] = (float(m.params), float(m.master), float(m.grads), float(m.optimizer),
                                 float(m.update))
            if name in prob.grad_nodes and users.get(name):
                charge(users[name][0], zero_collectives(name, first_meta(info.meta), s, mesh, prob.param_bytes[name]))
        elif info.kind == BUFFER and info.meta is not None:
            meta = first_meta(info.meta)
            state_parts[name] = (float(numel(meta.hint) * meta.itemsize), 0.0, 0.0, 0.0, 0.0)
        elif info.kind == OP and name in pos:
            i = pos[name]
            acts[i] = float(activation_bytes(name, cap, s.output, mesh, prob.saved, strategy=s))
            compute[i] = float(node_compute_time(cap.node(name), cap, s, mesh, prob.hardware))
            charge(i, op_collectives(cap.node(name), cap, s, mesh))
        elif info.kind == INPUT:
            acts[0] += float(activation_bytes(name, cap, s.output, mesh, prob.saved)) if order else 0.0
    for r in group_redistributions(prob, choice):
        first = min((pos[c] for c, _ in r.consumers if c in pos), default=len(order) - 1)
        charge(first, redistribution_collectives(prob, r))
        for c, i in r.consumers:   # an activation kept as its shard where it is gathered (sequence parallel)
            if c in pos:
                acts[pos[c]] += float(regather_saving(cap, regather_model(prob), r.producer, c, i, r.src, r.dst,
                                                      r.grad_partial, mesh, prob.grad_nodes))
        # a reader kept as the all-to-all's new tensor (Ulysses; terms.copied_kept_bytes)
        acts[first] += float(copied_kept_bytes(cap, prob.saved, r.producer, r.consumers, r.src, r.dst, r.grad_partial,
                                               mesh))
    time = [compute[i] + sum(comm_time[i].values()) for i in range(len(order))]
    parts = [(compute[i], comm_bytes[i], comm_time[i]) for i in range(len(order))]
    crossing = _crossing_bytes(cap, order, pos, strategy, mesh)
    return OpCosts(order, time, acts, users, crossing, parts, state_parts)


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


def device_prediction(prob, costs: OpCosts, pipe: PipelinePlan, transient: float):
    """Predicted per step for the busiest device of the pipeline: its stages' weights, the activations in
    flight, every microbatch's collectives and sends, and the step time of the schedule."""
    pos = {n: i for i, n in enumerate(costs.order)}
    mesh, m = prob.mesh, pipe.microbatches
    p = pipe.num_stages // pipe.stages_per_device
    link = prob.links[pipe.axis]
    best = None
    for coord in range(p):
        idx = [pos[x] for s in pipe.stages_on(coord) for x in pipe.stages[s].nodes]
        read = {name for name, rs in costs.users.items() if any(r in set(idx) for r in rs)}
        parts = [sum(costs.state_parts[x][k] for x in read if x in costs.state_parts) for k in range(5)]
        acts = sum(pipe.stages[s].activations * pipe.stages[s].in_flight for s in pipe.stages_on(coord))
        total = sum(parts[:4]) + acts + transient
        if best is None or total > best[0]:
            best = (total, coord, idx, parts, acts)
    total, coord, idx, (params, master, grads, opt, update), acts = best
    optimizer_time = float(cm.optimizer_time(update, prob.hardware))   # after the schedule, on the busiest device
    comm_bytes = {a: m * sum(costs.parts[i][1][a] for i in idx) for a in mesh.axis_names}
    comm_time = {a: m * sum(costs.parts[i][2][a] for i in idx) for a in mesh.axis_names}
    sends = [pipe.stages[s].send_bytes for s in pipe.stages_on(coord)]
    recvs = [pipe.stages[s - 1].send_bytes for s in pipe.stages_on(coord) if s > 0]
    comm_bytes[pipe.axis] += m * (sum(sends) + sum(recvs))   # activations out, gradients of the inputs back
    comm_time[pipe.axis] += m * sum(float(cm.collective_time(cm.SEND_RECV, b, 2, link)) for b in sends + recvs)
    compute = m * sum(costs.parts[i][0] for i in idx)
    mem = Memory(params, grads, opt, acts, transient, total, master)
    # the pipeline model prices every collective as waited for, and its stages' compute as run eagerly
    # (compiled_step_time: the same, no fusion claimed)
    return Predicted(mem, comm_bytes, comm_time, compute, pipe.step_time + optimizer_time,
                     {cm.SEND_RECV: m * (sum(sends) + sum(recvs))},
                     dict(comm_time), optimizer_time, pipe.step_time + optimizer_time)
