"""The integer program of one search, built (search/ilp.py solves it).

Variables (search/formulation_vars.py): x[v, s] = 1 if node v takes strategy s; for every edge u -> v, a
continuous y[e, p, k] that is 1 when u outputs placement p and v wants key k (its input placement and which
axes its gradient comes back partial on) -- with 0/1 marginals the only feasible y is their product, so y
needs no integrality. b[a] = 1 if mesh axis a splits the batch: every user input and the output follow it.
Objective: compute time of the chosen strategies plus the time of the collectives on every edge (and what
recomputing adds). Constraint: memory per device -- what the chosen strategies keep plus the transient peak,
bounded here row by row (this module), under the limit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..capture.export import PARAM
from ..cost.checkpointing import recomputed_ops, rerun_blocks, rerun_ops
from ..cost.layer_groups import alive_spans, layer_of
from ..cost.problem import (Problem, charge_key, checkpoint_model, memory_reserve, node_memory, node_recompute_time,
                            repeat_memory, tied_edges)
from ..cost.terms import first_meta, is_saved, output_bytes, read_bytes, reduce_itemsize
from ..sharding.placement import local_shape, numel
from .classics import Roles
from .formulation_vars import MEM_SCALE, TIME_SCALE, Formulation, RoleMemo, batch_vars, edge_vars, node_vars


@dataclass(frozen=True)
class Built:
    """A search's program as build leaves it: what reading its answer back needs (ilp._Program holds it)."""
    xvars: dict      # node -> one variable per strategy (None where the roles forbid it); repeats share a list
    bvars: list      # per mesh axis, the variable that is 1 where it splits the batch
    stacks: list     # the stacks recomputed (those of the search's checkpointing kind)
    reserve: float   # bytes every plan holds besides the program's terms (memory_reserve)
    bounds: list     # variables that only bound others from above (ilp._Program.bounds)


def build(prob: Problem, roles: Roles, ilp: Formulation, memory_limit: float | None, minimize_memory: bool,
          kind: str, memo: RoleMemo | None = None) -> Built:
    """The integer program of one search (ilp._solve) written into `ilp`: its variables, the memory rows, the
    recompute terms of the stacks of `kind`, and the memory limit's row (with a limit, unless minimize_memory)."""
    xvars = node_vars(prob, roles, ilp)
    bvars = batch_vars(prob, roles, ilp, xvars)
    # the largest working set of any forward op, in MiB like all memory terms
    transient = ilp.var(0.0, 1.0, integer=False, upper=np.inf)
    gathered_at: dict = {}   # (first copy of) op -> {y: MiB of the weight that y gathers for it}
    by_weight: list = []     # (weight, the op it is gathered for, {y: MiB}) for every copy of a tied edge
    stacks = [st for st in prob.stacks if st.kind == kind]
    rerun = set().union(*(rerun_ops(st, prob.saved) for st in stacks))
    for edges in tied_edges(prob):
        gathered = edge_vars(prob, roles, ilp, xvars, edges, rerun, memo or RoleMemo())
        if gathered:
            consumer = prob.canonical.get(edges[0].consumer, edges[0].consumer)
            gathered_at.setdefault(consumer, {}).update(gathered)
            by_weight += [(e.producer, e.consumer, gathered) for e in edges]
    layers = [] if prob.pipelined else gathered_layers(prob, by_weight)
    _transient_rows(prob, ilp, xvars, gathered_at, transient, layers)
    hold = _zero_bucket_rows(prob, ilp, xvars)
    _backward_start_rows(prob, ilp, xvars, transient, hold)
    _recompute_terms(prob, stacks, ilp, xvars, transient, layers)
    reserve = memory_reserve(prob)
    if memory_limit is not None and not minimize_memory:
        mem = np.asarray(ilp.mem, dtype=float)
        nonzero = np.flatnonzero(mem)
        ilp.rows(1, np.zeros(len(nonzero), dtype=np.int64), nonzero, mem[nonzero], -np.inf,
                 (memory_limit - reserve) * MEM_SCALE)
    return Built(xvars, bvars, stacks, reserve, [v for v in (hold, transient) if v is not None])


def gathered_layers(prob: Problem, by_weight: list) -> list:
    """Per forward op (prob.live's order): {y: MiB} of the weights gathered whole while it runs when the
    module gathers FSDP weights a layer at a time (the prediction's spans, layer_groups.alive_spans: its
    layer, the next one prefetched, the root). Every gathered weight counts with its layer here, also one
    the module gathers alone for its op (not groupable): the search cannot tell those apart before it has
    chosen, and over-counting keeps the plans it picks within the memory limit the prediction checks."""
    position = {point: i for i, (point, _) in enumerate(prob.live)}
    parts, uses = {}, {}   # layer -> the {y: MiB} of its weights (the repeats of a tied edge share one dict)
    for weight, consumer, gathered in by_weight:
        if consumer not in position:
            continue
        layer = layer_of(prob.cap.info[weight].target_name)
        parts.setdefault(layer, []).append(gathered)
        uses.setdefault(layer, []).append(position[consumer])
    alive: list = [[] for _ in prob.live]   # per op, the layers gathered there, in the order their terms add up
    for layer, (start, end) in alive_spans(uses).items():
        for i in range(start, end + 1):
            alive[i].append(layer)
    # one dict per set of dicts gathered together: the layers of a stack share their weights' dicts, so an op's
    # layer and the next one prefetched sum alike all down the stack (the rows dedupe by it)
    sums: dict = {}
    at = []
    for layers in alive:
        key = tuple(sorted(id(g) for layer in layers for g in parts[layer]))
        if key not in sums:
            total: dict = {}
            for layer in layers:
                for g in parts[layer]:
                    for y, mib in g.items():
                        total[y] = total.get(y, 0.0) + mib
            sums[key] = total
        at.append(sums[key])
    return at


def _transient_rows(prob: Problem, ilp: Formulation, xvars, gathered_at: dict, transient: int, layers: list) -> None:
    """transient >= what is alive at each forward op beyond saved activations: tensors made and not
    yet read for the last time, plus the weights gathered whole for that op (FSDP) -- or, where the
    module gathers them a layer at a time, those of the layers gathered around it (`layers`)."""
    seen = set()
    canon = prob.canonical
    # id of a gathered dict -> a number for its items (ops share their dicts: gathered_layers), so that a row's key
    # compares two numbers, not two sets of thousands of items (measured: 3.4 s of Llama-3-70B's 16 x 8 x 8 plan)
    as_sets: dict = {}
    numbers: dict = {}   # the items as a set -> their number
    for i, (point, alive, alive_key) in enumerate(_transients(prob)):
        gathered = layers[i] if layers else gathered_at.get(canon.get(point, point), {})
        if id(gathered) not in as_sets:   # (holding the dict keeps the id its own)
            as_sets[id(gathered)] = (numbers.setdefault(frozenset(gathered.items()), len(numbers)), gathered)
        key = (alive_key, as_sets[id(gathered)][0])
        if key in seen:   # repeated blocks repeat their rows
            continue
        seen.add(key)
        row = dict(gathered)
        for u in alive:
            for var, mib in zip(xvars[u], _output_mib(prob, u)):
                if var is not None:
                    row[var] = row.get(var, 0.0) + mib
        if row:
            ilp.row({**row, transient: -1.0}, -np.inf, 0)


def _transients(prob: Problem) -> list:
    """Per forward op (prob.live's order): (op, the transient tensors alive there, a key equal for ops of
    repeated blocks that hold the same), once per problem: every search asks."""
    found = prob.node_cost_cache.get(("transients",))
    if found is None:
        canon = prob.canonical
        found = []
        for point, alive in prob.live:
            alive = [u for u in alive if u in prob.strategies and not is_saved(prob, u)]
            found.append((point, alive, (canon.get(point, point), tuple(sorted(canon.get(u, u) for u in alive)))))
        prob.node_cost_cache[("transients",)] = found
    return found


def _output_mib(prob: Problem, name: str) -> list:
    """MiB of a node's output on one device, per strategy (once per problem)."""
    key = ("output MiB", name)
    mib = prob.node_cost_cache.get(key)
    if mib is None:
        mib = prob.node_cost_cache[key] = [float(output_bytes(name, prob.cap, s.output, prob.mesh)) * MEM_SCALE
                                           for s in prob.strategies[name].strategies]
    return mib


def _backward_start_rows(prob: Problem, ilp: Formulation, xvars, transient: int, hold: int | None) -> None:
    """transient >= the outputs' gradients + the input gradients of one op making an output, for each such
    op (cost/predict.backward_start_bytes prices the same), + what ZeRO-2's buckets hold (`hold`)."""
    start = prob.backward_start
    if start is None or not start.graded:
        return

    def terms(node, positions) -> dict:
        return {var: float(read_bytes(node, positions, prob.cap, s, prob.mesh)) * MEM_SCALE
                for s, var in zip(prob.strategies[node].strategies, xvars[node]) if var is not None}

    outputs = terms(start.output, start.graded)
    for head in [h for h, positions in start.heads if h in prob.strategies] or [None]:
        row = dict(outputs)
        if hold is not None:
            row[hold] = 1.0
        if head is not None:
            row.update(terms(head, dict(start.heads)[head]))
        ilp.row({**row, transient: -1.0}, -np.inf, 0)


def _zero_bucket_rows(prob: Problem, ilp: Formulation, xvars) -> int | None:
    """A variable bounding what ZeRO-2's buckets hold in backward (cost/predict.zero_bucket_hold: three times
    the largest bucket) wherever a ZeRO-2 strategy is chosen, for the backward-start rows to add: a bucket
    holds at most `bucket_bytes` unless one weight alone is bigger, and never more than all of them."""
    held = []   # (variable, MiB of that weight's whole local gradient)
    for name, ns in prob.strategies.items():
        info = prob.cap.info[name]
        if info.kind != PARAM or name not in prob.grad_nodes:
            continue
        meta = first_meta(info.meta)
        itemsize = reduce_itemsize(prob.param_bytes, name) or meta.itemsize
        for s, var in zip(ns.strategies, xvars[name]):
            if var is not None and s.zero >= 2 and len(s.zero_axes) == 1:
                held.append((var, numel(local_shape(meta.hint, s.output, prob.mesh.axis_sizes)) * itemsize))
    if not held:
        return None
    bucket = min(prob.bucket_bytes, sum(b for _, b in held))
    hold = ilp.var(0.0, 0.0, integer=False, upper=np.inf)
    for var, b in dict.fromkeys(held):   # a repeated layer's weight shares its first copy's variable: one row
        ilp.row({var: 3 * max(b, bucket) * MEM_SCALE, hold: -1.0}, -np.inf, 0)
    return hold


def _recompute_terms(prob: Problem, stacks, ilp: Formulation, xvars, transient: int, layers: list) -> None:
    """Every block of `stacks` checkpointed: activation bytes change by D(x) (negative where it saves;
    the tensors a checkpoint holds are charged to their producers), time grows by one more forward
    of each block's ops up to the last that keeps a tensor (the collectives before them are priced
    on the edges, edge_vars), and backward's working set holds one block's activations B(x).
    """
    for st in stacks:
        model = checkpoint_model(prob, (st.key,))
        memo: dict = {}
        for name in set(model.charges) | set(prob.saved.charges):
            if name not in prob.strategies:
                continue
            key = (prob.canonical.get(name, name), charge_key(prob.saved, name), charge_key(model, name))
            if key not in memo:
                memo[key] = [node_memory(prob, name, s, model) - node_memory(prob, name, s)
                             for s in prob.strategies[name].strategies]
            for d, var in zip(memo[key], xvars[name]):
                if var is not None:
                    ilp.mem[var] += d * MEM_SCALE
        repeats: dict = {}   # first copy of an op -> how many blocks rerun it
        for name in recomputed_ops(st, prob.saved):
            if name in prob.strategies:
                canon = prob.canonical.get(name, name)
                repeats[canon] = repeats.get(canon, 0) + 1
        for canon, n in repeats.items():
            for s, var in zip(prob.strategies[canon].strategies, xvars[canon]):
                if var is not None:
                    ilp.cost[var] += node_recompute_time(prob, canon, s) * n * TIME_SCALE
        # backward holds one rerun block's activations at a time, beside its FSDP layer gathered again
        # (cost/predict.transient_bytes): one row per kind of block that reruns (a frozen one does not) and set of
        # layers gathered at one of its ops (`layers`: gathered_layers, shared dicts)
        position = {point: i for i, (point, _) in enumerate(prob.live)} if layers else {}
        rows: dict = {}
        for block_nodes in rerun_blocks(st, prob.saved):
            block: dict = {}
            for name in block_nodes:
                if name in prob.strategies:
                    canon = prob.canonical.get(name, name)
                    for mem, var in zip(repeat_memory(prob, name, canon), xvars[name]):
                        if var is not None and mem:
                            block[var] = block.get(var, 0.0) + mem * MEM_SCALE
            held = {id(d): d for d in (layers[position[n]] for n in block_nodes if n in position)}
            for gathered in list(held.values()) or [{}]:
                row = {v: -b for v, b in block.items()}
                for v, mib in gathered.items():
                    row[v] = row.get(v, 0.0) - mib
                rows.setdefault(frozenset(row.items()), row)
        for row in rows.values():
            ilp.row({transient: 1.0, **row}, 0.0, np.inf)
