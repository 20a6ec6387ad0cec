"""Search: one strategy per node by integer linear programming (HiGHS via scipy).

Variables: x[v, s] = 1 if node v takes strategy s; for every edge u -> v, a
continuous y[e, p, k] that is 1 when u outputs placement p and v wants key k
(its input placement and which axes its gradient comes back partial on) --
with 0/1 marginals the only feasible y is their product, so y needs no
integrality. b[a] = 1 if mesh axis a splits the batch: every user input and
the output follow it. Objective: compute time of the chosen strategies plus
the time of the collectives on every edge. Constraint: memory per device.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from ..capture.export import PARAM
from ..cost.checkpointing import KINDS, NONE, recomputed_ops, rerun_blocks, rerun_ops
from ..cost.layer_groups import alive_spans, layer_of
from ..cost.problem import (Problem, charge_key, checkpoint_model, edge_cost, edge_signature, follows_batch,
                            memory_reserve, node_memory, node_recompute_time, node_time, recompute_edge_cost,
                            regather_model, repeat_memory, reshards, tied_edges)
from ..cost.terms import (collectives_time, copied_kept_bytes, first_meta, gathered_weight_bytes, is_saved,
                          kept_weight_bytes, output_bytes, read_bytes, reduce_itemsize, regather_saving, regathers,
                          zero_collectives)
from ..errors import InfeasiblePlanError
from ..sharding.placement import local_shape, numel
from ..sharding.redistribute import UnsupportedRedistribution
from .classics import Roles, allow_edge, allowed_flags
from . import solve_cache
from .greedy import bound_gap, greedy
from .solution import GREEDY_NO_BOUND, INFEASIBLE, OPTIMAL, PRUNED, TIME_LIMIT, Solution

# one DEBUG record per ILP solved, its figures in `record.stage` (benchmarks/search_time.py tabulates them)
log = logging.getLogger(__name__)

TIME_SCALE = 1e6      # seconds -> microseconds keeps HiGHS's tolerances meaningful
MEM_SCALE = 2.0 ** -20  # bytes -> MiB


class _ILP:
    """Columns (variables) and sparse rows of a MILP, built up one piece at a time: a node's few
    variables and rows one by one, an edge's many (a table of layout pairs) in bulk."""

    def __init__(self):
        self.cost, self.mem, self.integer = [], [], []
        self.tie = []                      # per variable: what the search adds to its cost to break ties (TIME_SCALE)
        self.upper = []
        self.lb, self.ub = [], []          # per row
        self.ri, self.ci, self.data = [], [], []   # the rows' entries, one by one
        self.chunks = []                   # ... and in bulk: (row, column, value) arrays

    def var(self, cost=0.0, mem=0.0, integer=True, upper=1.0) -> int:
        self.cost.append(cost)
        self.tie.append(0.0)
        self.mem.append(mem)
        self.integer.append(1 if integer else 0)
        self.upper.append(upper)
        return len(self.cost) - 1

    def columns(self, cost: np.ndarray, mem: np.ndarray) -> int:
        """Continuous variables in [0, 1], one per entry; returns the first one's index."""
        first = len(self.cost)
        self.cost.extend(cost.tolist())
        self.tie.extend([0.0] * len(cost))
        self.mem.extend(mem.tolist())
        self.integer.extend([0] * len(cost))
        self.upper.extend([1.0] * len(cost))
        return first

    def row(self, coefs: dict, lb: float, ub: float):
        r = len(self.lb)
        self.ri.extend([r] * len(coefs))
        self.ci.extend(coefs)
        self.data.extend(coefs.values())
        self.lb.append(lb)
        self.ub.append(ub)

    def rows(self, count: int, rows, cols, vals, lb: float, ub: float) -> int:
        """`count` rows at once, their entries as arrays (`rows` numbered from 0); returns the first row's index."""
        first = len(self.lb)
        self.chunks.append((np.asarray(rows) + first, np.asarray(cols), np.asarray(vals, dtype=float)))
        self.lb.extend([lb] * count)
        self.ub.extend([ub] * count)
        return first

    @property
    def num_rows(self) -> int:
        return len(self.lb)

    def _matrix(self):
        """The rows as a CSR matrix and their bounds, made once the program is built. The rows' entries as
        they were added go then, and the columns' lists become arrays: solve relaxes every program of a search
        before it branches on any (_cheapest), so several are held at once."""
        if getattr(self, "_built", None) is None:
            ri = np.concatenate([np.asarray(self.ri, dtype=np.int64)] + [c[0] for c in self.chunks])
            ci = np.concatenate([np.asarray(self.ci, dtype=np.int64)] + [c[1] for c in self.chunks])
            data = np.concatenate([np.asarray(self.data, dtype=float)] + [c[2] for c in self.chunks])
            self._built = (sp.csr_array((data, (ri, ci)), shape=(len(self.lb), len(self.cost))),
                           np.array(self.lb, float), np.array(self.ub, float))
            self.ri = self.ci = self.data = self.chunks = None   # no row may be added after this
            self.cost, self.mem, self.tie = (np.asarray(v, dtype=float) for v in (self.cost, self.mem, self.tie))
            self.upper, self.integer = np.asarray(self.upper, dtype=float), np.asarray(self.integer)
        return self._built

    def relax(self, objective, time_limit):
        """The program with integrality dropped, by the dual simplex: its optimum is a lower bound on the
        program's, its reduced costs say how much each variable would add off its bound (solve uses them),
        and where its basic solution sets every binary to 0 or 1 it is the program's optimum itself -- as
        for most searches without a memory limit. HiGHS's presolve is off: on these programs it took
        twice the simplex's own time (measured on the README demo's 2-layer GPT on 2 x 2, 17346 variables:
        0.1-0.2 s without it, 0.3-0.55 s with it)."""
        A, row_lower, row_upper = self._matrix()
        n = len(self.cost)
        c, lower, upper = np.array(objective, dtype=float), np.zeros(n), np.array(self.upper, dtype=float)
        options = {"presolve": False} if time_limit is None else {"presolve": False, "time_limit": time_limit}
        key = (solve_cache.program_key(c, np.zeros(n), lower, upper, A, row_lower, row_upper,
                                       {**options, "method": "highs-ds"}) if solve_cache.cache_dir() else None)
        res = solve_cache.load(key) if key else None
        if res is not None and (res.status == 2 or getattr(res, "reduced_at_lower", None) is not None):
            return res
        eq = row_lower == row_upper
        le, ge = np.isfinite(row_upper) & ~eq, np.isfinite(row_lower) & ~eq
        res = linprog(c, A_ub=sp.vstack([A[le], -A[ge]]).tocsr(), b_ub=np.concatenate([row_upper[le], -row_lower[ge]]),
                      A_eq=A[eq], b_eq=row_upper[eq], bounds=np.stack([lower, upper], axis=1), method="highs-ds",
                      options=options)
        if res.status == 0:
            res.reduced_at_lower, res.reduced_at_upper = res.lower.marginals, -res.upper.marginals
        if key:
            solve_cache.store(key, res)
        return res

    def solve(self, objective, time_limit, gap, relaxed=None, spent=0.0):
        """The program's optimum within `gap`. Where the relaxation (`relaxed`, if the caller has it) is
        integral, that; else HiGHS's branch and bound over the variables whose reduced costs leave them a
        chance: a 0/1 variable whose reduced cost exceeds margin M adds more than M to any plan that sets it
        off its bound, so where the best plan of the program without those costs at most relaxation + M,
        it is the best plan of the whole program (reduced-cost fixing). M starts at REDUCED_MARGIN of the
        relaxation's optimum and grows fourfold while the smaller program's best is above it.

        Measured on the README demo (2 x 2, 1 MiB; 17346 variables; 1% margin keeps 2300-2700): each
        search under the limit in 0.15-0.3 s, relaxation included, against 1.3-4.5 s for HiGHS's branch
        and bound over the whole program, which spent most of it in presolve and heuristics finding a
        first plan; the same plans. The smaller programs are branched to a tight gap (SMALL_PROGRAM_GAP).

        `time_limit` bounds the whole of it, relaxation included (`spent` seconds of it already), not each
        call; if the clock stops the last try without a plan, the best plan a smaller program found is
        returned (status 1: its gap is measured against the relaxation)."""
        start = time.perf_counter() - spent
        left = ((lambda: max(time_limit - (time.perf_counter() - start), 1e-3)) if time_limit is not None
                else (lambda: None))
        relaxed = relaxed if relaxed is not None else self.relax(objective, left())
        if relaxed.status == 2 or integral(relaxed, self.integer):
            return relaxed   # infeasible without integrality: infeasible with it too
        found = None   # the best plan a smaller program found above its ceiling
        if relaxed.status == 0:
            margin = REDUCED_MARGIN
            while margin < 1.0:
                ceiling = float(relaxed.fun) + margin * max(abs(float(relaxed.fun)), 1e-9)
                res = self._solve_fixed(objective, left(), gap, relaxed, ceiling)
                if res.x is not None and res.fun <= ceiling * (1 + 1e-9):
                    return res
                if res.x is not None and (found is None or res.fun < found.fun):
                    found = res
                if res.status not in (0, 2):   # out of time: the whole program, as before
                    break
                margin *= 4
        res = self._run(objective, left(), gap, None)
        if res.x is None and found is not None:
            found.status = 1
            found.mip_gap = (found.fun - float(relaxed.fun)) / max(abs(found.fun), 1e-12)
            return found
        return res

    def _solve_fixed(self, objective, time_limit, gap, relaxed, ceiling):
        """The program with every 0/1 variable whose reduced cost exceeds ceiling - relaxation fixed at its bound
        (those at 0 dropped), its answer laid out over all variables. Only 0/1 variables: a continuous one
        without an upper bound (the transient peak, the buckets' hold) may move by less than 1, and so add less
        than its reduced cost."""
        slack = ceiling - float(relaxed.fun)
        x = np.asarray(relaxed.x)
        binary = np.asarray(self.upper) == 1
        at_zero = (x <= INTEGRAL_TOLERANCE) & (relaxed.reduced_at_lower > slack) & binary
        at_one = (x >= 1 - INTEGRAL_TOLERANCE) & (relaxed.reduced_at_upper > slack) & binary
        keep = np.flatnonzero(~at_zero)
        res = self._run(objective, time_limit, min(gap, SMALL_PROGRAM_GAP), (keep, at_one[keep]))
        if res.x is not None:
            full = np.zeros(len(self.cost))
            full[keep] = res.x
            res.x = full
        return res

    def _run(self, objective, time_limit, gap, kept):
        """HiGHS's branch and bound over the program, or over its columns kept[0] with kept[1] of them fixed at 1."""
        A, row_lower, row_upper = self._matrix()
        # a finite time limit makes HiGHS ration its effort by the clock (measured: a 7 s solve under a 60 s
        # or 120 s limit returned either of two equally cheap plans, by the machine's load); without one
        # the same program always gets the same answer
        options = {"mip_rel_gap": gap} if time_limit is None else {"mip_rel_gap": gap, "time_limit": time_limit}
        c, integrality = np.array(objective, dtype=float), np.array(self.integer)
        upper = np.array(self.upper, dtype=float)
        lower = np.zeros(len(c))
        if kept is not None:
            columns, ones = kept
            c, integrality, upper, A = c[columns], integrality[columns], upper[columns], A[:, columns]
            lower = np.where(ones, 1.0, 0.0)
        key = (solve_cache.program_key(c, integrality, lower, upper, A, row_lower, row_upper, options)
               if solve_cache.cache_dir() else None)
        res = solve_cache.load(key) if key else None
        if res is None:
            res = milp(c, integrality=integrality, bounds=Bounds(lower, upper),
                       constraints=[LinearConstraint(A, row_lower, row_upper)], options=options)
            if key:
                solve_cache.store(key, res)
        return res


def integral(res, integer) -> bool:
    """Whether a relaxation's answer is optimal and sets every integer variable to a whole number."""
    if res.status != 0 or res.x is None:
        return False
    x = np.asarray(res.x)[np.asarray(integer, dtype=bool)]
    return bool(np.all(np.abs(x - np.round(x)) <= INTEGRAL_TOLERANCE))


# HiGHS's own mip_feasibility_tolerance: how far from a whole number its branch and bound accepts a binary
INTEGRAL_TOLERANCE = 1e-6
# the gap HiGHS closes on the smaller programs of reduced-cost fixing: they are small enough to branch to near
# the optimum, so that the search's tie-breaks (AT_STEP_TIE_BREAK) decide between plans it prices alike
SMALL_PROGRAM_GAP = 1e-6
# the first margin of reduced-cost fixing, of the relaxation's optimum (_ILP.solve): the README demo's
# searches under a limit end 0.1-0.8% above their relaxations
REDUCED_MARGIN = 0.01


@dataclass
class RoleMemo:
    """What the searches of one role assignment share: the roles decide which layout pairs an edge allows,
    and a pair's price depends on the search's variant only where that changes the edge (its recompute,
    re-gather or reshard), so the searches of an assignment price most edges once."""
    pairs: dict = field(default_factory=dict)    # (producer, consumer, index) -> allowed (producer key, consumer key)
    allowed: dict = field(default_factory=dict)  # allow_edge's answers (see _allowed_pairs)
    tables: dict = field(default_factory=dict)   # _edge_table's priced pairs, by all their prices depend on


def _node_vars(prob: Problem, roles: Roles, ilp: _ILP) -> dict[str, list]:
    """x[v, s]: one binary per allowed strategy (None where the roles forbid it); exactly one is 1."""
    cap, mesh = prob.cap, prob.mesh
    xvars, times, ties = {}, {}, {}
    copies = []   # (first, repeat) in graph order
    for name, ns in prob.strategies.items():
        info = cap.info[name]
        first = prob.canonical.get(name)
        if first is not None:
            xvars[name] = xvars[first]
            copies.append((first, name))
            continue
        vs, times[name], ties[name] = [], {}, {}
        for i, (s, ok) in enumerate(zip(ns.strategies, allowed_flags(prob, roles, name))):
            if not ok:
                vs.append(None)
                continue
            t, mem = _node_prices(prob, name, i)
            vs.append(ilp.var(t * TIME_SCALE, mem * MEM_SCALE))
            times[name][vs[-1]] = t
            ties[name][vs[-1]] = ilp.tie[vs[-1]] = _tie_price(prob, name, i) * TIME_SCALE
        if all(v is None for v in vs):
            raise InfeasiblePlanError(
                f"no strategy of node {name!r} (module {info.module_path or '<root>'}) fits the requested "
                f"roles {roles.roles} on mesh {mesh}: its shape {first_meta(info.meta).hint if info.meta else ''} "
                "may not divide by the axis sizes. Use strategy='auto' or another mesh.")
        xvars[name] = vs
        ilp.row({v: 1.0 for v in vs if v is not None}, 1, 1)
    _charge_repeats(prob, ilp, xvars, times, ties, copies)
    return xvars


def _charge_repeats(prob: Problem, ilp: _ILP, xvars: dict, times: dict, ties: dict, copies: list) -> None:
    """A repeated block's node takes the variables of its first copy, which pay its costs too: the same time
    (same op on the same shapes), but memory of its own (what autograd keeps of a block's last op depends on
    who reads it next). One vector add per repeat (a Llama-3-70B has ~5600 repeats of ~50 layouts each), in
    graph order, so each variable's sum is added up as a loop over the repeats would."""
    if not copies:
        return
    cost, tie, mem = np.array(ilp.cost), np.array(ilp.tie), np.array(ilp.mem)
    firsts = {}
    for first in dict.fromkeys(f for f, _ in copies):
        alive = [(i, var) for i, var in enumerate(xvars[first]) if var is not None]
        idx = np.array([var for _, var in alive], dtype=np.int64)
        firsts[first] = ([i for i, _ in alive], idx, np.array([times[first][v] * TIME_SCALE for v in idx.tolist()]),
                         np.array([ties[first][v] for v in idx.tolist()]))
    for first, name in copies:
        at, idx, seconds, tied = firsts[first]
        cost[idx] += seconds
        tie[idx] += tied
        mem[idx] += np.array(repeat_memory(prob, name, first), dtype=float)[at] * MEM_SCALE
    ilp.cost, ilp.tie, ilp.mem = cost.tolist(), tie.tolist(), mem.tolist()


def _node_prices(prob: Problem, name: str, i: int) -> tuple[float, float]:
    """(node_time, node_memory) of strategy i of a node, priced once per problem: every search of every
    role assignment asks again, and neither depends on the roles or the search's variants."""
    key = ("prices", name, i)
    prices = prob.node_cost_cache.get(key)
    if prices is None:
        s = prob.strategies[name].strategies[i]
        prices = prob.node_cost_cache[key] = (node_time(prob, name, s), node_memory(prob, name, s))
    return prices


def _tie_price(prob: Problem, name: str, i: int) -> float:
    """Seconds the search adds to strategy i of a node to break ties (_at_step_tie_break), once per problem; the
    plan's objective leaves them out (_finish)."""
    key = ("tie", name, i)
    tie = prob.node_cost_cache.get(key)
    if tie is None:
        tie = prob.node_cost_cache[key] = _at_step_tie_break(prob, name, prob.strategies[name].strategies[i])
    return tie


# of the seconds of ZeRO's collectives that run at the optimizer step, what the search adds (_at_step_tie_break)
AT_STEP_TIE_BREAK = 1e-3


def _at_step_tie_break(prob: Problem, name: str, s) -> float:
    """A little more for ZeRO's collectives at the optimizer step (ZeRO-1's reduce and both levels' gather of the
    updated weight) than the search's price. The search prices every collective as waited for, so a weight FSDP
    splits (gathered in forward), one kept whole under ZeRO-2 (reduced in backward, gathered at the step) and one
    under ZeRO-1 (both at the step) move the same bytes in the same time: equal plans to it. The prediction hides
    what runs beside compute (cost/overlap.py), nothing at the step: Llama-3-70B on 16 x 8 x 8 had two plans of
    one objective 1478 and 1576 ms apart as predicted, Llama-3-8B's shape on 8 x 8 three, 63.3-65.0 ms. Which
    one HiGHS returned was chance. A thousandth of those collectives' seconds moves a plan by less than the
    search's gap and, with the smaller programs branched to a tight gap (_ILP.solve), picks the overlapped one."""
    info = prob.cap.info[name]
    if info.kind != PARAM or not s.zero or name not in prob.grad_nodes or not prob.hardware.comm_overlaps_compute:
        return 0.0
    colls = [c for c in zero_collectives(name, first_meta(info.meta), s, prob.mesh, prob.param_bytes[name])
             if c.phase == "optimizer"]
    return AT_STEP_TIE_BREAK * float(collectives_time(colls, prob.mesh, prob.links))



def _batch_vars(prob: Problem, roles: Roles, ilp: _ILP, xvars) -> list:
    """b[a]: every user input and the output split their batch dim on exactly the axes with b[a] = 1."""
    bvars, pinned = [], roles.batch_axes()
    for a in range(prob.mesh.num_axes):
        b = ilp.var()
        bvars.append(b)
        if a in pinned:
            ilp.row({b: 1.0}, float(pinned[a]), float(pinned[a]))
    for name, ns in prob.strategies.items():
        if not follows_batch(prob, name):
            continue
        for a in range(prob.mesh.num_axes):
            row = {v: 1.0 for v, s in zip(xvars[name], ns.strategies) if v is not None and s.output[a] == "S(0)"}
            row[bvars[a]] = -1.0
            ilp.row(row, 0, 0)
    return bvars


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


def _edge_vars(prob: Problem, roles: Roles, ilp: _ILP, xvars, edges: list, rerun: set, memo: RoleMemo) -> dict:
    """y[e, p, k] for producer layout p and consumer key k (input layout, partial-gradient axes).

    Marginals tie y to x: sum_k y[p, k] = x-mass of the producer on p, and
    sum_p y[p, k] = x-mass of the consumer on k. Pairs that cannot be
    redistributed (or that the roles forbid) get no variable. `edges` are
    repeats of one edge (tied blocks): one set of y, paying for all of them.
    Returns {y: MiB} for the y that gather a weight whole (FSDP). An edge into
    an op of `rerun` (checkpointed blocks) also pays its rerun (recompute_edge_cost).
    `memo`: what the searches of one role assignment share (RoleMemo).
    """
    e = edges[0]
    u, v = prob.strategies[e.producer], prob.strategies[e.consumer]
    src_groups: dict = {}   # (output layout, ZeRO axes whose gradient stays partial) -> x variables
    for s, var in zip(u.strategies, xvars[e.producer]):
        if var is not None:
            src_groups.setdefault((s.output, s.zero_axes), []).append(var)
    dst_groups: dict = {}
    for s, var in zip(v.strategies, xvars[e.consumer]):
        if var is not None:
            dst_groups.setdefault((s.inputs[e.index], s.grad_partial(e.index)), []).append(var)
    pair_key = (e.producer, e.consumer, e.index)
    if pair_key not in memo.pairs:
        memo.pairs[pair_key] = _allowed_pairs(roles, prob.cap, e, src_groups, dst_groups, len(v.strategies) == 1,
                                              memo.allowed)
    table = _edge_table(prob, edges, rerun, memo, pair_key, src_groups, dst_groups)
    first = ilp.columns(table.cost, table.memory)
    # the marginal rows: y of each producer key, then of each consumer key, less that key's x variables
    ys = np.arange(first, first + len(table.cost))
    rows, cols, vals = [table.src, len(src_groups) + table.dst], [ys, ys], [np.ones(len(ys)), np.ones(len(ys))]
    for offset, groups in ((0, src_groups), (len(src_groups), dst_groups)):
        for g, vars_ in enumerate(groups.values()):
            rows.append(np.full(len(vars_), offset + g))
            cols.append(np.asarray(vars_))
            vals.append(np.full(len(vars_), -1.0))
    ilp.rows(len(src_groups) + len(dst_groups), np.concatenate(rows), np.concatenate(cols), np.concatenate(vals),
             0, 0)
    return {first + j: mib for j, mib in table.gathered}


@dataclass(frozen=True)
class _EdgeTable:
    """One edge's priced layout pairs, in the order its y variables take (the pairs that can be redistributed)."""
    cost: np.ndarray    # per pair: TIME_SCALE-scaled seconds of the collectives (and reruns) of every repeat
    memory: np.ndarray  # per pair: MEM_SCALE-scaled bytes kept (re-gathered activations' shards, weights kept whole)
    src: np.ndarray     # per pair: the index of its producer key among the edge's producer keys
    dst: np.ndarray     # per pair: ... of its consumer key among the consumer keys
    gathered: list      # (pair index, MiB of the weight it gathers whole) for the pairs that gather one


def _edge_table(prob: Problem, edges: list, rerun: set, memo: RoleMemo, pair_key: tuple, src_groups: dict,
                dst_groups: dict) -> _EdgeTable:
    """The priced pairs of a tied edge, memoised by all their prices depend on: a role assignment's
    searches (no limit, each recompute kind, each memory-saving choice) ask again of most edges. The
    collectives' seconds (_base_table) are shared by every search whose edge signatures are alike; what a
    rerun adds, and the bytes a memory-saving choice keeps, are priced over them only where they apply."""
    cap = prob.cap
    alike: dict = {}   # repeats that cost the same: signature -> [one of them, how many, how many rerun]
    for member in edges:
        entry = alike.setdefault(edge_signature(prob, member), [member, 0, 0])
        entry[1] += 1
        entry[2] += member.consumer in rerun
    kept = regather_model(prob)   # None: gathered activations are kept whole, and nothing is saved
    key = (pair_key, tuple((sig, n, m) for sig, (_, n, m) in alike.items()), kept is not None,
           reshards(prob), tuple(m.consumer in rerun for m in edges))
    table = memo.tables.get(key)
    if table is not None:
        return table
    base = _base_table(prob, memo, pair_key, alike, src_groups, dst_groups)
    cost, pairs = base.cost, base.pairs
    rerun_alike = [(sig, member, m) for sig, (member, _, m) in alike.items() if m]
    if rerun_alike:
        rerun_key = ("rerun", pair_key, tuple((sig, n) for sig, (_, n, _) in alike.items()),
                     tuple((sig, m) for sig, _, m in rerun_alike))   # (aligned to that base table's pairs)
        extra = memo.tables.get(rerun_key)
        if extra is None:
            extra = memo.tables[rerun_key] = np.array([
                sum(m * recompute_edge_cost(prob, member, p, dst_key, gp, zero_axes, sig)
                    for sig, member, m in rerun_alike) * TIME_SCALE
                for (p, zero_axes), (dst_key, gp) in pairs])
        cost = cost + extra
    # repeats whose op pays for the activation it gathers: the module keeps the shard (regather_saving)
    keepers = _by_weight_shape(prob, [m for m in edges if kept is not None and (m.consumer, m.index) in kept.payers
                                      and m.consumer not in rerun])
    # weights gathered whole for backward stay whole from forward on (not resharded): what each keeps
    holders = [] if reshards(prob) else _by_weight_shape(
        prob, [m for m in edges if m.consumer not in rerun
               and regathers(cap, m.producer, m.consumer, m.index, prob.grad_nodes)])
    # readers kept as a new tensor an all-to-all makes, beside the storage another op pays for (Ulysses)
    # (not where the op keeping that storage recomputes: then it keeps nothing, and the reader pays)
    also = prob.saved.also_kept
    copiers = _by_weight_shape(prob, [m for m in edges if (m.consumer, m.index) in also
                                      and m.consumer not in rerun and also[(m.consumer, m.index)] not in rerun])
    memory = np.zeros(len(pairs))
    if keepers or holders or copiers:
        for j, ((p, zero_axes), (dst_key, gp)) in enumerate(pairs):
            kept_bytes = 0
            if keepers:
                kept_bytes += sum(n * regather_saving(cap, kept, m.producer, m.consumer, m.index, p, dst_key, gp,
                                                      prob.mesh, prob.grad_nodes) for m, n in keepers)
            if copiers:
                kept_bytes += sum(n * copied_kept_bytes(cap, prob.saved, m.producer, ((m.consumer, m.index),), p,
                                                        dst_key, gp, prob.mesh) for m, n in copiers)
            if holders:
                kept_bytes += sum(n * kept_weight_bytes(cap, m.producer, m.consumer, m.index, p, dst_key,
                                                        prob.grad_nodes, prob.mesh) for m, n in holders)
            memory[j] = float(kept_bytes) * MEM_SCALE
    table = memo.tables[key] = _EdgeTable(cost, memory, base.src, base.dst, base.gathered)
    return table


@dataclass(frozen=True)
class _BaseTable:
    """An edge's layout pairs that can be redistributed, and the seconds of their collectives (every repeat's)."""
    pairs: list         # ((output layout, ZeRO axes), (input layout, partial-gradient axes)) per pair
    cost: np.ndarray    # TIME_SCALE-scaled seconds per pair
    src: np.ndarray
    dst: np.ndarray
    gathered: list      # (pair index, MiB of the weight it gathers whole)


def _base_table(prob: Problem, memo: RoleMemo, pair_key: tuple, alike: dict, src_groups: dict,
                dst_groups: dict) -> _BaseTable:
    key = ("base", pair_key, tuple((sig, n) for sig, (_, n, _) in alike.items()))
    table = memo.tables.get(key)
    if table is not None:
        return table
    cap = prob.cap
    e = next(iter(alike.values()))[0]
    members = [(sig, member, n) for sig, (member, n, _) in alike.items()]
    src_index = {k: i for i, k in enumerate(src_groups)}
    dst_index = {k: i for i, k in enumerate(dst_groups)}
    pairs, cost, src, dst, gathered = [], [], [], [], []
    # (this loop runs once per variable, ~60k for Llama-3-8B on 8 x 8: what does not vary is hoisted)
    is_weight = cap.info[e.producer].kind == PARAM
    for src_key, k in memo.pairs[pair_key]:
        p, zero_axes = src_key
        dst_key, gp = k
        try:
            c = sum(n * edge_cost(prob, member, p, dst_key, gp, zero_axes, sig) for sig, member, n in members)
        except UnsupportedRedistribution:
            continue
        if is_weight:
            gb = float(gathered_weight_bytes(cap, e.producer, p, dst_key, prob.mesh))
            if gb:
                gathered.append((len(cost), gb * MEM_SCALE))
        pairs.append((src_key, k))
        cost.append(c * TIME_SCALE)
        src.append(src_index[src_key])
        dst.append(dst_index[k])
    table = memo.tables[key] = _BaseTable(pairs, np.array(cost), np.array(src, dtype=np.int32),
                                          np.array(dst, dtype=np.int32), gathered)
    return table


def _allowed_pairs(roles: Roles, cap, e, src_groups: dict, dst_groups: dict, consumer_replicated_only: bool,
                   allowed: dict) -> list:
    """(producer key, consumer key) pairs of an edge that the roles allow, in the order the variables take.
    `allowed`: allow_edge's answers under these roles (they depend on the layouts and whether the producer
    is a weight, not on the edge), shared by the edges."""
    producer = cap.info[e.producer]
    is_tuple = isinstance(producer.meta, list)
    is_param = producer.kind == PARAM
    out = []
    for src_key in src_groups:
        p, _ = src_key
        for k in dst_groups:
            dst, gp = k
            key = (is_param, p, dst, consumer_replicated_only)
            ok = allowed.get(key)
            if ok is None:
                ok = allowed[key] = allow_edge(roles, producer, p, dst, consumer_replicated_only)
            if not ok:
                continue
            if is_tuple and (p != dst or gp):
                continue  # a tuple (split's pieces) is never redistributed whole; getitem takes it as is
            out.append((src_key, k))
    return out


def _by_weight_shape(prob: Problem, edges: list) -> list:
    """[(one edge, how many)] of edges whose producers are alike (kind, shape, dtype): their memory terms
    are equal, so a deep stack prices each kind once, not once per layer."""
    counts: dict = {}
    for m in edges:
        info = prob.cap.info[m.producer]
        meta = first_meta(info.meta)
        key = (info.kind, meta.shape if meta is not None else None, meta.dtype if meta is not None else None,
               m.producer in prob.grad_nodes, m.index, prob.cap.node(m.consumer).target)
        entry = counts.setdefault(key, [m, 0])
        entry[1] += 1
    return [(m, n) for m, n in counts.values()]


def _transient_rows(prob: Problem, ilp: _ILP, xvars, gathered_at: dict, transient: int, layers: list) -> None:
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


def _backward_start_rows(prob: Problem, ilp: _ILP, xvars, transient: int, hold: int | None) -> None:
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


def _zero_bucket_rows(prob: Problem, ilp: _ILP, xvars) -> int | None:
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


def _recompute_terms(prob: Problem, stacks, ilp: _ILP, xvars, transient: int, layers: list) -> None:
    """Every block of `stacks` checkpointed: activation bytes change by D(x) (negative where it saves;
    the tensors a checkpoint holds are charged to their producers), time grows by one more forward
    of each block's ops up to the last that keeps a tensor (the collectives before them are priced
    on the edges, _edge_vars), and backward's working set holds one block's activations B(x).
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


def solve(prob: Problem, roles: Roles, memory_limit: float | None, time_limit: float | None = 60.0,
          minimize_memory: bool = False, gap: float = 1e-3, checkpointing: str = "none",
          free: Solution | None = None, memo: RoleMemo | None = None) -> Solution:
    """Cheapest plan under the roles and memory limit; see _solve. With checkpointing="auto" under a
    limit, the best of one search per kind: no stack recomputed, every stack's attention cores
    recomputed (selective), every stack's blocks recomputed (full). (A binary per stack in one
    search would also try mixes, but its big-M rows made HiGHS branch for tens of seconds on small
    models.) With one stack, as in most models, those are the whole choice.

    Where the problem leaves it to the search whether gathered activations are kept as shards
    (prob.regather_activations None), or FSDP weights resharded after forward (prob.reshard_after_forward
    None), the faster choice (activations kept whole, weights kept gathered) is solved first, and under a
    limit the best kind is solved once more with each memory-saving choice (every kind, if none fit):
    both only buy memory with time.

    `free`: free_search's answer for these roles, where the caller has it (planner._best bounds role
    assignments by it); `memo`: the RoleMemo of its free search, where the caller has it."""
    limited = minimize_memory or memory_limit is not None
    # the undecided choices; True is the memory-saving side of each
    decide = [field for field in ("regather_activations", "reshard_after_forward") if getattr(prob, field) is None]
    base = replace(prob, **{field: False for field in decide})
    counted = []   # searches made here whose time the answer reports besides its own variants
    memo = memo or RoleMemo()   # the edges' allowed layout pairs and their prices: every search below shares them
    if checkpointing != "auto":
        kinds = [checkpointing]
    else:
        kinds = [NONE] + ([kind for kind in KINDS if any(st.kind == kind for st in prob.stacks)] if limited else [])
    if searches_free_first(prob, memory_limit, minimize_memory, checkpointing):
        # recomputing and re-gathering only add time to a layout: where the fastest plan without either
        # meets the limit anyway, no other is faster, and one solve answers for all of them
        if free is None:
            free = free_search(prob, roles, time_limit, gap, memo)
            counted.append(free)
        if free.status == OPTIMAL and free.memory <= memory_limit:   # (not a greedy plan: unmeasured)
            return free
        if free.status == INFEASIBLE:
            # no layout at all under these roles (the limit is not in it): the limit, recomputing
            # and re-gathering only take layouts away or reprice them, so none of their searches can
            # find one either
            return free

    def programs(prob_, kinds_):
        return [_program(prob_, roles, memory_limit, time_limit, minimize_memory, gap, kind, memo) for kind in kinds_]

    sols = _cheapest(programs(base, kinds))
    best = min(sols, key=lambda sol: sol.objective if sol.choice else float("inf"))
    if decide and limited:
        again = [next(iter(best.checkpointed.values()), NONE)] if best.choice else kinds
        # each memory-saving choice alone, then all of them
        variants = [{field: True} for field in decide] + ([{field: True for field in decide}] if len(decide) > 1 else [])
        sols += _cheapest([p for variant in variants for p in programs(replace(base, **variant), again)],
                          best.priced if best.choice else float("inf"))
        best = min(sols, key=lambda sol: sol.objective if sol.choice else float("inf"))
    best.solve_seconds = sum(sol.solve_seconds for sol in sols + counted)
    best.build_seconds = sum(sol.build_seconds for sol in sols + counted)
    return best


def _cheapest(programs: list, incumbent: float = float("inf")) -> list[Solution]:
    """The solutions of several programs (in their order), each solved only where it may beat the best found:
    every program's relaxation is solved first (a lower bound on its optimum, and where integral the
    optimum itself), then the programs from the lowest bound up, and one whose bound is within its gap of
    the best plan so far (`incumbent` to start with, seconds) is not branched on: its plan could be no
    faster than that one by more than the gap the search promises anyway (issue 53: plans may change within
    the gap). Measured on the README demo (2-layer GPT, 2 x 2, 1 MiB): 5 of its 8 searches under the limit
    end at their bound, and the search takes a third of the time it took branching on all of them."""
    bounds = [p.bound() for p in programs]
    sols: list = [None] * len(programs)
    for i in sorted(range(len(programs)), key=lambda i: (bounds[i], i)):
        p = programs[i]
        if incumbent < float("inf") and bounds[i] >= incumbent * (1 - p.gap):
            sols[i] = Solution({}, (), float("inf"), p.relax_seconds, PRUNED, len(p.ilp.cost), p.ilp.num_rows,
                               build_seconds=p.build_seconds)
            _log(p, p.relax_seconds, PRUNED, True)
            continue
        sols[i] = _finish(p)
        if sols[i].choice:
            incumbent = min(incumbent, sols[i].priced)
    return sols


def searches_free_first(prob: Problem, memory_limit, minimize_memory: bool, checkpointing: str) -> bool:
    """Whether solve starts with free_search: under a limit, where recomputing or a memory-saving choice
    is open. Its optimum is then a lower bound on solve's answer: each of those only adds time."""
    if minimize_memory or memory_limit is None:
        return False
    decide = any(getattr(prob, field) is None for field in ("regather_activations", "reshard_after_forward"))
    recompute = checkpointing == "auto" and any(st.kind in KINDS for st in prob.stacks)
    return (checkpointing in ("auto", NONE)) and (recompute or decide)


def free_search(prob: Problem, roles: Roles, time_limit: float | None, gap: float = 1e-3,
                memo: RoleMemo | None = None) -> Solution:
    """The fastest plan under the roles with no memory limit, nothing recomputed, and the faster side of
    each undecided choice (activations kept whole, weights kept gathered)."""
    decide = [field for field in ("regather_activations", "reshard_after_forward") if getattr(prob, field) is None]
    return _solve(replace(prob, **{field: False for field in decide}), roles, None, time_limit, False, gap, NONE,
                  memo)


@dataclass
class _Program:
    """One search's integer program, built (_program), and what reading its answer back needs."""
    prob: Problem
    roles: Roles
    memory_limit: float | None
    time_limit: float | None
    minimize_memory: bool
    gap: float
    ilp: _ILP
    xvars: dict
    bvars: list
    stacks: list
    reserve: float
    build_seconds: float
    relaxed: object = None        # the relaxation's answer, once solved (bound)
    relax_seconds: float = 0.0
    # variables that only bound others from above (the ZeRO-2 buckets' hold, then the transient peak), in the
    # order they read each other: no cost of their own, so an answer may leave them above what they bound
    bounds: list = field(default_factory=list)

    @property
    def objective(self):
        """What HiGHS minimises: memory, or time with the search's tie-break (_at_step_tie_break)."""
        if self.minimize_memory:
            return self.ilp.mem
        return np.asarray(self.ilp.cost, dtype=float) + np.asarray(self.ilp.tie, dtype=float)

    def bound(self) -> float:
        """A lower bound on the program's optimum as the search prices it (Solution.priced: seconds with the
        tie-break, or bytes with minimize_memory): its relaxation's optimum, solved once; inf where that is
        infeasible."""
        if self.relaxed is None:
            t0 = time.perf_counter()
            self.relaxed = self.ilp.relax(self.objective, self.time_limit)
            self.relax_seconds = time.perf_counter() - t0
        if self.relaxed.status == 2:
            return float("inf")
        if self.relaxed.status != 0 or self.relaxed.fun is None:
            return 0.0   # out of time: no bound (costs are never negative)
        return _unscaled(self, float(self.relaxed.fun))


def _unscaled(program: _Program, fun: float) -> float:
    return fun / MEM_SCALE + program.reserve if program.minimize_memory else fun / TIME_SCALE


def _solve(prob: Problem, roles: Roles, memory_limit: float | None, time_limit: float | None,
           minimize_memory: bool, gap: float, kind: str, memo: RoleMemo | None = None) -> Solution:
    """Cheapest plan under the roles and memory limit (or, with minimize_memory, the least memory).

    `gap`: HiGHS stops once the plan is provably within this fraction of the
    optimum; the plan reports the gap it reached. `kind`: the checkpointing
    of every stack in prob.stacks (NONE, SELECTIVE or FULL). `memo`: what searches
    under the same roles share (RoleMemo).
    """
    return _finish(_program(prob, roles, memory_limit, time_limit, minimize_memory, gap, kind, memo))


def _program(prob: Problem, roles: Roles, memory_limit: float | None, time_limit: float | None,
             minimize_memory: bool, gap: float, kind: str, memo: RoleMemo | None = None) -> _Program:
    """The integer program of one search (see _solve), built but not solved."""
    t_build = time.perf_counter()
    ilp = _ILP()
    xvars = _node_vars(prob, roles, ilp)
    bvars = _batch_vars(prob, roles, ilp, xvars)
    # the largest working set of any forward op, in MiB like all memory terms
    transient = ilp.var(0.0, 1.0, integer=False, upper=np.inf)
    gathered_at: dict = {}   # (first copy of) op -> {y: MiB of the weight that y gathers for it}
    by_weight: list = []     # (weight, the op it is gathered for, {y: MiB}) for every copy of a tied edge
    stacks = [st for st in prob.stacks if st.kind == kind]
    rerun = set().union(*(rerun_ops(st, prob.saved) for st in stacks))
    for edges in tied_edges(prob):
        gathered = _edge_vars(prob, roles, ilp, xvars, edges, rerun, memo or RoleMemo())
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
    return _Program(prob, roles, memory_limit, time_limit, minimize_memory, gap, ilp, xvars, bvars, stacks, reserve,
                    time.perf_counter() - t_build, bounds=[v for v in (hold, transient) if v is not None])


def _log(program: _Program, seconds: float, status, relaxation: bool) -> None:
    """One DEBUG record per search, its figures in `record.stage` (benchmarks/search_time.py tabulates them)."""
    prob, ilp = program.prob, program.ilp
    nvar, nrow = len(ilp.cost), ilp.num_rows
    log.debug("ilp: %d variables, %d rows, built in %.2f s, solved in %.2f s", nvar, nrow, program.build_seconds,
              seconds, extra={"stage": {
                  "stage": "ilp", "roles": ",".join(str(r or "any") for r in program.roles.roles),
                  "checkpointing": program.stacks[0].kind if program.stacks else NONE,
                  "regather": bool(prob.regather_activations), "reshard": reshards(prob),
                  "limited": program.memory_limit is not None or program.minimize_memory, "variables": nvar,
                  "rows": nrow, "build_seconds": program.build_seconds, "solve_seconds": seconds,
                  "relaxation": relaxation, "status": status}})


def _finish(program: _Program) -> Solution:
    """Solve a built program (its relaxation first, see _ILP.solve) and read its answer back as a Solution."""
    prob, roles, ilp, xvars = program.prob, program.roles, program.ilp, program.xvars
    memory_limit, time_limit, minimize_memory = program.memory_limit, program.time_limit, program.minimize_memory
    stacks, reserve, built = program.stacks, program.reserve, program.build_seconds
    program.bound()   # (timed on its own: relax_seconds)
    t0 = time.perf_counter()
    res = ilp.solve(program.objective, time_limit, program.gap, program.relaxed, program.relax_seconds)
    elapsed = time.perf_counter() - t0 + program.relax_seconds
    nvar, nrow = len(ilp.cost), ilp.num_rows
    _log(program, elapsed, int(res.status), res is program.relaxed)
    if res.x is None:
        # stopped at the time limit, not infeasible; the greedy never recomputes, so not under "full"
        if res.status == 1 and not minimize_memory and not stacks:
            fallback = _fallback(prob, roles, memory_limit, res, program.relaxed)
            if fallback is not None:
                fallback.solve_seconds = time.perf_counter() - t0 + program.relax_seconds
                fallback.num_variables, fallback.num_constraints, fallback.build_seconds = nvar, nrow, built
                return fallback
        return Solution({}, (), float("inf"), elapsed, INFEASIBLE if res.status == 2 else res.message,
                        nvar, nrow, build_seconds=built)
    x = res.x
    picked: dict = {}   # id of a variable list -> its chosen strategy (repeats share their first copy's list)
    choice = {}
    for name, vs in xvars.items():
        if id(vs) not in picked:
            picked[id(vs)] = max((i for i, v in enumerate(vs) if v is not None), key=lambda i: x[vs[i]])
        choice[name] = picked[id(vs)]
    batch_axes = tuple(a for a, b in enumerate(program.bvars) if x[b] > 0.5)
    # the plan's own time, without the tie-break; `priced`, with it, is what the search compares
    objective = _unscaled(program, float(res.fun) if minimize_memory else float(np.dot(ilp.cost, x)))
    status = OPTIMAL if res.status == 0 else TIME_LIMIT
    sol = Solution(choice, batch_axes, objective, elapsed, status, nvar, nrow,
                   float(getattr(res, "mip_gap", 0.0) or 0.0), built, {st.path: st.kind for st in stacks},
                   bool(prob.regather_activations), reshards(prob))
    x = _lowest_bounds(ilp, np.array(x, dtype=float), program.bounds)
    sol.memory = float(np.dot(ilp.mem, x)) / MEM_SCALE + reserve   # the search's own measure of the plan
    sol.priced = _unscaled(program, float(res.fun))
    return sol


def _lowest_bounds(ilp: _ILP, x: np.ndarray, variables: list) -> np.ndarray:
    """`x` with each of `variables` at the least value its rows allow given the others: a search without a memory
    limit gives them no cost, so its answer may hold any value above, and the memory the search measures for the
    plan (Solution.memory: whether the fastest plan already meets a limit, ilp.solve) would be too high."""
    A, row_lower, row_upper = ilp._matrix()
    A = A.tocsc()
    for var in variables:
        rows = A.indices[A.indptr[var]:A.indptr[var + 1]]
        coefs = A.data[A.indptr[var]:A.indptr[var + 1]]
        others = A[rows] @ x - coefs * x[var]   # each row's activity without the variable
        # a <= 0 rows (upper side): var >= (others - upper) / -a; a > 0 rows (lower side): var >= (lower - others) / a
        lo, hi = row_lower[rows], row_upper[rows]
        with np.errstate(invalid="ignore", divide="ignore"):
            need = np.where(coefs < 0, np.where(np.isfinite(hi), (others - hi) / -coefs, 0.0),
                            np.where(np.isfinite(lo), (lo - others) / coefs, 0.0))
        x[var] = max(0.0, float(need.max(initial=0.0)))
    return x


def _fallback(prob: Problem, roles: Roles, memory_limit, res, relaxed) -> Solution | None:
    """HiGHS stopped at its time limit with no plan: the greedy's (greedy.py), or None if it finds
    none within the memory limit either. Its mip_gap is its distance from a lower bound on the
    ILP's optimum: HiGHS's dual bound, or else -- scipy reports none when HiGHS has no solution
    yet -- the LP relaxation's optimum (`relaxed`, solved before HiGHS branched); status GREEDY_NO_BOUND
    (mip_gap 1: costs are never negative, so 0 is the only bound) if that ran out of time too."""
    sol = greedy(prob, roles, memory_limit)
    if sol is None:
        return None
    sol.regather_activations = bool(prob.regather_activations)
    sol.reshard_after_forward = reshards(prob)
    # priced as the search prices plans (tie-break included): the bound below is of that, and pruning compares it
    sol.priced = sol.objective + sum(_tie_price(prob, name, i) for name, i in sol.choice.items())
    bound = getattr(res, "mip_dual_bound", None)
    if (bound is None or not np.isfinite(bound)) and relaxed.status == 0 and relaxed.fun is not None:
        bound = float(relaxed.fun)
    if bound is None or not np.isfinite(bound):
        sol.status, sol.mip_gap = GREEDY_NO_BOUND, 1.0
    else:
        sol.mip_gap = bound_gap(sol.priced, bound / TIME_SCALE)
    return sol
