"""Greedy search: a plan for when HiGHS stops at its time limit before it finds one.

It reads the same Problem as the ILP, allows the same strategies
(classics.py) and prices them with the same functions (search.node_time,
node_memory, edge_cost), so its objective compares with the ILP's.

Ops are placed one at a time in graph order: a strategy costs its time, plus
lambda x its memory, plus the edges to the nodes already placed. A
placeholder (parameter, user input) is placed with the first op that reads
it, in the layout best for that op's strategy: placed alone it would see its
memory and never the cost of gathering it. One choice per op (a plain
greedy) is short-sighted -- an op that splits the hidden dim is cheap, the
gather a norm three ops later needs is not -- so the pass is a beam: it
keeps the `beam_width` cheapest partial plans, and of those that agree on
what the rest of the pass can see (the layouts of the placed nodes that
unpriced edges still join: the frontier) only the cheapest, since the rest
costs them the same. On a chain whose frontier takes fewer layouts than the
beam holds, a pass is exact. A beam still ranks partial plans by their cost
so far, and a plan that splits less pays for it now and is repaid later; so
the pass runs twice, in graph order and in reverse (where a norm's need for
a whole hidden dim is seen before the ops that would split it), and the
cheaper plan wins. Repeats of a block (blocks.py) take their first copy's
choice; each edge is priced, for all its copies, when the later of the two
variables it joins is placed.

Lambda (seconds per byte) is bisected, geometrically, towards the smallest
value whose plan fits the memory limit as predict.predict counts it; a
partial plan whose nodes' memory already passes the limit is dropped, and
under a limit the beam keeps, per frontier, every plan that no other is both
faster and smaller than. Every set of batch axes the roles allow is tried.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from ..capture.export import OP, OUTPUT
from ..cost.predict import predict
from ..cost.problem import (Problem, edge_cost, edge_signature, follows_batch, memory_reserve, node_memory, node_time,
                            repeat_memory)
from ..sharding.redistribute import UnsupportedRedistribution
from .classics import Roles, allow_edge, allowed_flags
from .solution import GREEDY, Solution

BEAM_WIDTH = 256
# lambda in seconds per byte: at the low end memory never tips a choice, at the high end it always does
LAMBDA_RANGE = (1e-21, 1e3)
NUM_BISECTIONS = 10   # 24 decades / 2^10: lambda within 6% of the boundary


@dataclass(frozen=True)
class Costs:
    """What the passes read, computed once per search. Arrays run over a node's allowed strategies."""
    allowed: dict       # node with variables of its own -> np.array of allowed strategy indices
    time: dict          # node -> seconds per allowed strategy: all its copies, and edges among them
    memory: dict        # node -> bytes per allowed strategy, summed over its copies
    out_group: dict     # node -> per allowed strategy, an id of what its consumers see: (output, ZeRO axes)
    prices: dict        # (producer, consumer) -> seconds[producer strategy, consumer strategy] of the
                        # edges (every copy's) between their variables; inf where not allowed


@dataclass(frozen=True)
class Tables:
    """Costs arranged for one order of placement."""
    costs: Costs
    order: tuple        # nodes placed in turn: first copies of ops, and the output
    inputs: dict        # node -> ((other node, seconds[other's strategy, node's strategy]), ...): the
                        # edges priced when the node is placed (the other placed before, or a placeholder)
    last_use: dict      # node -> position in `order` of the last placement that prices an edge of it
    consumer_until: dict  # node -> the same, for the edges into it
    pending_group: dict   # node -> per allowed strategy, an id of what its unpriced edges see of it


def greedy(prob: Problem, roles: Roles, memory_limit: float | None,
           beam_width: int = BEAM_WIDTH) -> Solution | None:
    """The cheapest plan found within the memory limit, or None. Status GREEDY; mip_gap is left
    to the caller, who knows the ILP's bound."""
    t0 = time.perf_counter()
    costs = make_costs(prob, roles)
    best = None
    fits: dict = {}   # the plans the passes found -> whether predict counts them within the limit
    for backward in (False, True):
        tables = arrange(prob, costs, backward)
        for batch_axes in batch_options(prob, roles):
            penalty = batch_penalty(prob, costs, batch_axes)
            if penalty is None:
                continue
            found = fit(prob, tables, penalty, memory_limit, beam_width, fits)
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], found[1], batch_axes)
    if best is None:
        return None
    _, choice, batch_axes = best
    # priced again in full, as the ILP would price it (the pass's sum, but for rounding)
    return Solution(choice, batch_axes, objective(prob, choice), time.perf_counter() - t0, GREEDY)


def bound_gap(objective: float, bound: float) -> float:
    """How far above a lower bound a plan may be, as a fraction of the plan: (plan - bound) / plan in [0, 1]."""
    if objective <= 0:
        return 0.0
    return min(1.0, max(0.0, (objective - bound) / objective))


def objective(prob: Problem, choice: dict) -> float:
    """Seconds, as the ILP prices a choice: each node's time (a repeat pays its first copy's), plus
    the collectives of every edge."""
    total = 0.0
    for name, ns in prob.strategies.items():
        total += node_time(prob, prob.canonical.get(name, name), ns.strategies[choice[name]])
    for e in prob.edges:
        u = prob.strategies[e.producer].strategies[choice[e.producer]]
        v = prob.strategies[e.consumer].strategies[choice[e.consumer]]
        total += edge_cost(prob, e, u.output, v.inputs[e.index], v.grad_partial(e.index), u.zero_axes)
    return total


def allowed_strategies(prob: Problem, roles: Roles) -> dict[str, tuple[int, ...]]:
    """Per node with variables of its own, the strategies the roles allow (as formulation_vars.node_vars)."""
    return {name: tuple(i for i, ok in enumerate(allowed_flags(prob, roles, name)) if ok)
            for name in prob.strategies if name not in prob.canonical}


def batch_options(prob: Problem, roles: Roles) -> list[tuple[int, ...]]:
    """Every set of batch-splitting axes the roles allow: pinned axes as pinned, free axes either way."""
    pinned = roles.batch_axes()
    per_axis = [(pinned[a],) if a in pinned else (False, True) for a in range(prob.mesh.num_axes)]
    return [tuple(a for a, split in enumerate(combo) if split) for combo in itertools.product(*per_axis)]


def batch_penalty(prob: Problem, costs: Costs, batch_axes: tuple) -> dict | None:
    """inf on the strategies of user inputs (ndim > 0) and the output that do not split the batch on
    exactly `batch_axes` (formulation_vars.batch_vars); None if one of them cannot."""
    out = {}
    for name, idx in costs.allowed.items():
        if not follows_batch(prob, name):
            continue
        strategies = prob.strategies[name].strategies
        ok = np.array([all((strategies[i].output[a] == "S(0)") == (a in batch_axes)
                           for a in range(prob.mesh.num_axes)) for i in idx], dtype=bool)
        if not ok.any():
            return None
        out[name] = np.where(ok, 0.0, np.inf)
    return out


def make_costs(prob: Problem, roles: Roles) -> Costs:
    allowed = {n: np.array(idx, dtype=int) for n, idx in allowed_strategies(prob, roles).items()}
    canon = prob.canonical
    copies = {name: [name] for name in allowed}
    for name, first in canon.items():
        if name in prob.strategies and first in copies:
            copies[first].append(name)
    times, memory, out_group = {}, {}, {}
    for name, idx in allowed.items():
        strategies = [prob.strategies[name].strategies[i] for i in idx]
        # every copy pays its first copy's time, as in the ILP; memory is each copy's own
        times[name] = np.array([len(copies[name]) * node_time(prob, name, s) for s in strategies])
        memory[name] = np.array([node_memory(prob, name, s) for s in strategies])
        for c in copies[name][1:]:
            memory[name] = memory[name] + np.array(repeat_memory(prob, c, name))[idx]
        ids: dict = {}
        out_group[name] = np.array([ids.setdefault((s.output, s.zero_axes), len(ids)) for s in strategies])
    # edges by the variables they join, as the ILP ties them (search.tied_edges)
    joined: dict = {}
    for e in prob.edges:
        joined.setdefault((canon.get(e.producer, e.producer), canon.get(e.consumer, e.consumer)), []).append(e)
    prices = {}
    for (u, v), edges in joined.items():
        matrix = _price_matrix(prob, roles, edges, allowed[u], allowed[v])
        if u == v:   # a repeat reading its first copy's twin (equal layers in a row): one choice, both ends
            times[v] = times[v] + np.diagonal(matrix)
        else:
            prices[(u, v)] = matrix
    return Costs(allowed, times, memory, out_group, prices)


def arrange(prob: Problem, costs: Costs, backward: bool) -> Tables:
    """Which edges each placement prices: those whose other end is placed before it, or is a
    placeholder (placed with it). An edge into a repeat may come from a node placed after the
    repeat's first copy: the consumer then waits in the frontier for it."""
    order = tuple(n for n in costs.allowed if prob.cap.info[n].kind in (OP, OUTPUT))
    order = order[::-1] if backward else order
    position = {n: i for i, n in enumerate(order)}
    inputs: dict = {}
    last_use: dict = {}
    consumer_until: dict = {}
    pending: dict = {}   # node -> its input indices on edges priced after it is placed
    edges_of: dict = {}
    for e in prob.edges:
        key = (prob.canonical.get(e.producer, e.producer), prob.canonical.get(e.consumer, e.consumer))
        edges_of.setdefault(key, set()).add(e.index)
    for (u, v), matrix in costs.prices.items():
        if u not in position or position[u] < position[v]:
            inputs.setdefault(v, []).append((u, matrix))
            last_use[u] = max(last_use.get(u, -1), position[v])
        else:
            inputs.setdefault(u, []).append((v, matrix.T))
            last_use[v] = max(last_use.get(v, -1), position[u])
            consumer_until[v] = max(consumer_until.get(v, -1), position[u])
            pending.setdefault(v, set()).update(edges_of[(u, v)])
    pending_group = {}
    for v, indices in pending.items():
        ids: dict = {}
        strategies = (prob.strategies[v].strategies[j] for j in costs.allowed[v])
        pending_group[v] = np.array([ids.setdefault((s.output, s.zero_axes) + tuple(
            (s.inputs[i], s.grad_partial(i)) for i in sorted(indices)), len(ids)) for s in strategies])
    return Tables(costs, order, {v: tuple(i) for v, i in inputs.items()}, last_use, consumer_until,
                  pending_group)


def _price_matrix(prob, roles, edges, producer_idx, consumer_idx) -> np.ndarray:
    """Seconds of the collectives on `edges` (copies of one edge between two sets of variables) for
    every pair of allowed strategies; inf where the roles forbid it or it cannot be redistributed."""
    alike: dict = {}   # copies that cost the same are priced once, as in formulation_vars.edge_vars
    for e in edges:
        entry = alike.setdefault((edge_signature(prob, e), e.index), [e, 0])
        entry[1] += 1
    total = np.zeros((len(producer_idx), len(consumer_idx)))
    for (sig, index), (e, count) in alike.items():
        us = [prob.strategies[e.producer].strategies[i] for i in producer_idx]
        vs = [prob.strategies[e.consumer].strategies[j] for j in consumer_idx]
        # the price depends only on what the two sides show each other: compute it once per pair of those
        src_ids: dict = {}
        rows = [src_ids.setdefault((u.output, u.zero_axes), len(src_ids)) for u in us]
        dst_ids: dict = {}
        cols = [dst_ids.setdefault((v.inputs[index], v.grad_partial(index)), len(dst_ids)) for v in vs]
        table = np.array([[edge_price(prob, roles, e, src, dst, sig) for dst in dst_ids] for src in src_ids])
        total += count * table[np.ix_(rows, cols)]
    return total


def edge_price(prob: Problem, roles: Roles, e, src_key, dst_key, signature=None) -> float:
    """Seconds of edge e from producer (output, ZeRO axes) to consumer (input layout, partial-gradient
    axes); inf if the roles forbid it or it cannot be redistributed."""
    (src, zero_axes), (dst, gp) = src_key, dst_key
    info = prob.cap.info[e.producer]
    if not allow_edge(roles, info, src, dst, len(prob.strategies[e.consumer].strategies) == 1):
        return math.inf
    if isinstance(info.meta, list) and (src != dst or gp):
        return math.inf   # a tuple (split's pieces) is never redistributed whole
    try:
        return edge_cost(prob, e, src, dst, gp, zero_axes, signature)
    except UnsupportedRedistribution:
        return math.inf


def fit(prob: Problem, tables: Tables, penalty: dict, memory_limit: float | None, beam_width: int,
        fits: dict | None = None):
    """(objective seconds, choice) of the cheapest pass over lambda that fits the limit, or None.
    `fits`: plan (its strategy indices in prob.strategies' order) -> whether it fits, shared by the
    calls of one search: passes at nearby lambdas often find the same plan, and predict is most of a
    pass's time on small models."""
    fits = {} if fits is None else fits
    # what the nodes' own memory may add up to: predict adds the buffers and the transient peak
    budget = math.inf if memory_limit is None else memory_limit - memory_reserve(prob)

    def attempt(lam):
        found = beam_pass(prob, tables, penalty, lam, beam_width, budget)
        if found is None:
            return None
        if memory_limit is None:
            return found
        key = tuple(found[1].values())
        if key not in fits:
            fits[key] = predict(prob, found[1], symbolic=False)[0].memory.total <= memory_limit
        return found if fits[key] else None

    best = attempt(0.0)
    if best is not None or memory_limit is None:
        return best
    lo, hi = LAMBDA_RANGE
    best = attempt(hi)
    if best is None:
        return None
    # memory falls as lambda grows, roughly: bisect towards the boundary, keeping the cheapest plan that
    # fits (the cost is not monotone in lambda, so the last plan that fits need not be the cheapest)
    for _ in range(NUM_BISECTIONS):
        mid = math.sqrt(lo * hi)
        found = attempt(mid)
        if found is None:
            lo = mid
            continue
        hi = mid
        if found[0] < best[0]:
            best = found
    return best


def beam_pass(prob: Problem, tables: Tables, penalty: dict, lam: float, beam_width: int,
              budget: float = math.inf) -> tuple[float, dict] | None:
    """One pass at memory price `lam`: (seconds, node -> strategy index) -- the seconds being
    objective()'s, summed as the pass goes -- or None if no partial plan places every op (each
    strategy of some op is forbidden by what is placed, or would take the nodes' memory past
    `budget`)."""
    costs = tables.costs

    def own_time(name):
        return costs.time[name] + penalty.get(name, 0.0)

    seconds, nbytes = np.zeros(1), np.zeros(1)   # per partial plan, so far
    chosen: dict = {}    # frontier node -> per partial plan, position in its allowed strategies
    history = []         # per placement: (node, parent plan, its choice, {placeholder: choice per choice})
    for pos, v in enumerate(tables.order):
        t = seconds[:, None] + own_time(v)[None, :]
        m = nbytes[:, None] + costs.memory[v][None, :]
        placed = {}
        for u, prices in tables.inputs.get(v, ()):
            if u in chosen:
                t = t + prices[chosen[u]]
            else:   # a placeholder: the layout best for each strategy of v
                total = own_time(u)[:, None] + prices
                best = placed[u] = _argmin_then_smallest(total + lam * costs.memory[u][:, None], costs.memory[u])
                t = t + total[best, np.arange(total.shape[1])][None, :]
                m = m + costs.memory[u][best][None, :]
        plans, picks = np.nonzero(np.isfinite(t) & (m <= budget))
        if not len(plans):
            return None
        frontier = [u for u in chosen if tables.last_use[u] > pos]
        columns = {u: chosen[u][plans] for u in frontier}
        for u in [v, *placed]:
            if tables.last_use.get(u, -1) > pos:
                frontier.append(u)
                columns[u] = picks if u == v else placed[u][picks]
        # what the rest of the pass sees of a frontier node: what it outputs, and while edges into
        # it are still to be priced, what those take
        seen = [(tables.pending_group[u] if tables.consumer_until.get(u, -1) > pos else costs.out_group[u])[
                columns[u]] for u in frontier]
        keep = _select(t[plans, picks], m[plans, picks], seen, costs.out_group[v][picks], lam, beam_width,
                       pareto=budget < math.inf)
        history.append((v, plans[keep], picks[keep], placed))
        chosen = {u: columns[u][keep] for u in frontier}
        seconds, nbytes = t[plans, picks][keep], m[plans, picks][keep]
    plan = int(np.argmin(seconds + lam * nbytes))
    return float(seconds[plan]), _trace_back(prob, costs, history, plan,
                                             lambda name: own_time(name) + lam * costs.memory[name])


def _argmin_then_smallest(score: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Per column, the row of least score, and of those the one of fewest bytes: at lam = 0 a
    weight split where it is used costs what a whole one does, and takes less memory."""
    ties = score <= score.min(axis=0)[None, :]
    return np.argmin(np.where(ties, nbytes[:, None], np.inf), axis=0)


def _select(seconds: np.ndarray, nbytes: np.ndarray, groups: list, newest: np.ndarray, lam: float,
            beam_width: int, pareto: bool) -> np.ndarray:
    """Indices of the partial plans to keep: the `beam_width` cheapest (seconds + lam x bytes) of
    those no other plan with the same frontier layouts beats -- the rest of the pass costs such
    plans the same. Beaten means cheaper at lam; under a memory budget (`pareto`), faster and no
    larger, or as fast and smaller: a plan that is slower but smaller may be the one that fits.
    The cheapest plan for each layout of the node just placed (`newest`) goes first, so the beam
    does not fill with variants of one layout."""
    gid = _group_key(groups, len(seconds))
    score = seconds + lam * nbytes
    if pareto:
        order = np.lexsort((nbytes, seconds, gid))
        start = np.concatenate(([True], gid[order][1:] != gid[order][:-1]))
        group = np.cumsum(start) - 1   # dense, in sorted order
        # the smallest plan so far within each group, in int64 so the groups can be offset apart
        # exactly: earlier groups sit higher, so a running minimum never carries into the next group
        size = np.rint(nbytes[order]).astype(np.int64)
        shifted = size + (group[-1] - group) * (int(size.max()) + 1)
        before = np.concatenate(([np.iinfo(np.int64).max], np.minimum.accumulate(shifted)[:-1]))
        kept = order[shifted < before]
    else:
        order = np.lexsort((score, gid))
        kept = order[np.concatenate(([True], gid[order][1:] != gid[order][:-1]))]
    kept = kept[np.argsort(score[kept], kind="stable")]
    # the first (cheapest) of each layout of the newest node, then the cheapest of the rest
    first = np.full(int(newest.max()) + 1, len(kept))
    np.minimum.at(first, newest[kept], np.arange(len(kept)))
    lead = np.zeros(len(kept), dtype=bool)
    lead[np.sort(first[first < len(kept)])[:beam_width]] = True
    chosen = lead | (np.cumsum(~lead) <= beam_width - lead.sum())
    return kept[chosen]


def _group_key(columns: list, n: int) -> np.ndarray:
    """An int64 per row of `columns` (n rows each), equal exactly where every column is."""
    gid = np.zeros(n, dtype=np.int64)
    for col in columns:
        gid = gid * (int(col.max()) + 1) + col
        if gid.max() > 2 ** 40:   # re-number before the mixed-radix key can overflow
            gid = np.unique(gid, return_inverse=True)[1].ravel()
    return gid


def _trace_back(prob: Problem, costs: Costs, history: list, plan: int, own) -> dict:
    """The choice of partial plan `plan` of the last placement, read back through its parents."""
    choice: dict = {}
    for v, parents, picks, placed in reversed(history):
        pick = picks[plan]
        choice[v] = int(costs.allowed[v][pick])
        for u, best in placed.items():
            choice[u] = int(costs.allowed[u][best[pick]])
        plan = parents[plan]
    for name, idx in costs.allowed.items():   # placeholders nothing placed reads
        if name not in choice:
            choice[name] = int(idx[np.argmin(own(name))])
    for name, first in prob.canonical.items():
        if name in prob.strategies:
            choice[name] = choice[first]
    return {name: choice[name] for name in prob.strategies}
