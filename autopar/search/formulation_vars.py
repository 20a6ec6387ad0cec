"""The integer program's variables and their prices (search/formulation.py builds the program from them).

x[v, s] (node_vars): 1 if node v takes strategy s, priced its compute time and the memory it keeps; b[a]
(batch_vars): 1 if mesh axis a splits the batch; y[e, p, k] (edge_vars): continuous, 1 when the producer of
edge e outputs layout p and its consumer wants key k, priced the collectives between them. `Formulation` holds
the columns and rows as they are added; search/ilp.py solves it. Times are scaled to microseconds and memory
to MiB (TIME_SCALE, MEM_SCALE).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from ..capture.export import PARAM
from ..cost.problem import (Problem, edge_signature, follows_batch, node_memory, node_time, pair_seconds,
                            recompute_edge_cost, regather_model, repeat_memory, reshards)
from ..cost.terms import (collectives_time, copied_kept_bytes, first_meta, gathered_weight_bytes, kept_weight_bytes,
                          regather_saving, regathers, zero_collectives)
from ..errors import InfeasiblePlanError
from .classics import Roles, allow_edge, allowed_flags

TIME_SCALE = 1e6      # seconds -> microseconds keeps HiGHS's tolerances meaningful
MEM_SCALE = 2.0 ** -20  # bytes -> MiB


class Formulation:
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

    def matrix(self):
        """The rows as a CSR matrix and their bounds, made once the program is built. The rows' entries as
        they were added go then, and the columns' lists become arrays: solve relaxes every program of a search
        before it branches on any (ilp._cheapest), so several are held at once."""
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


@dataclass
class RoleMemo:
    """What the searches of one role assignment share: the roles decide which layout pairs an edge allows,
    and a pair's price depends on the search's variant only where that changes the edge (its recompute,
    re-gather or reshard), so the searches of an assignment price most edges once."""
    pairs: dict = field(default_factory=dict)    # (producer, consumer, index) -> allowed (producer key, consumer key)
    allowed: dict = field(default_factory=dict)  # allow_edge's answers (see _allowed_pairs)
    tables: dict = field(default_factory=dict)   # _edge_table's priced pairs, by all their prices depend on


def node_vars(prob: Problem, roles: Roles, ilp: Formulation) -> dict[str, list]:
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
            ties[name][vs[-1]] = ilp.tie[vs[-1]] = tie_price(prob, name, i) * TIME_SCALE
        if all(v is None for v in vs):
            raise InfeasiblePlanError(
                f"no strategy of node {name!r} (module {info.module_path or '<root>'}) fits the requested "
                f"roles {roles.roles} on mesh {mesh}: its shape {first_meta(info.meta).hint if info.meta else ''} "
                "may not divide by the axis sizes. Use strategy='auto' or another mesh.")
        xvars[name] = vs
        ilp.row({v: 1.0 for v in vs if v is not None}, 1, 1)
    _charge_repeats(prob, ilp, xvars, times, ties, copies)
    return xvars


def _charge_repeats(prob: Problem, ilp: Formulation, xvars: dict, times: dict, ties: dict, copies: list) -> None:
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


def tie_price(prob: Problem, name: str, i: int) -> float:
    """Seconds the search adds to strategy i of a node to break ties (_at_step_tie_break), once per problem; the
    plan's objective leaves them out (ilp._finish)."""
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
    search's gap and, with the smaller programs branched to a tight gap (ilp._ILP.solve), picks the overlapped one."""
    info = prob.cap.info[name]
    if info.kind != PARAM or not s.zero or name not in prob.grad_nodes or not prob.hardware.comm_overlaps_compute:
        return 0.0
    colls = [c for c in zero_collectives(name, first_meta(info.meta), s, prob.mesh, prob.param_bytes[name])
             if c.phase == "optimizer"]
    return AT_STEP_TIE_BREAK * float(collectives_time(colls, prob.mesh, prob.links))



def batch_vars(prob: Problem, roles: Roles, ilp: Formulation, xvars) -> list:
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


def edge_vars(prob: Problem, roles: Roles, ilp: Formulation, xvars, edges: list, rerun: set, memo: RoleMemo) -> dict:
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
        sizes = [len(vars_) for vars_ in groups.values()]
        rows.append(np.repeat(np.arange(offset, offset + len(sizes)), sizes))
        cols.append(np.fromiter(itertools.chain.from_iterable(groups.values()), dtype=np.int64, count=sum(sizes)))
        vals.append(np.full(sum(sizes), -1.0))
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
    src_keys: list      # the edge's producer keys (output layout, ZeRO axes), in variable order
    dst_keys: list      # its consumer keys (input layout, partial-gradient axes)
    cost: np.ndarray    # TIME_SCALE-scaled seconds per pair
    src: np.ndarray     # per pair: the index of its producer key in src_keys
    dst: np.ndarray     # ... of its consumer key in dst_keys
    gathered: list      # (pair index, MiB of the weight it gathers whole)

    @property
    def pairs(self) -> list:
        """((output layout, ZeRO axes), (input layout, partial-gradient axes)) per pair (made when asked: only
        a rerun or a memory-saving choice prices pair by pair)."""
        return [(self.src_keys[i], self.dst_keys[j]) for i, j in zip(self.src.tolist(), self.dst.tolist())]


def _base_table(prob: Problem, memo: RoleMemo, pair_key: tuple, alike: dict, src_groups: dict,
                dst_groups: dict) -> _BaseTable:
    key = ("base", pair_key, tuple((sig, n) for sig, (_, n, _) in alike.items()))
    table = memo.tables.get(key)
    if table is not None:
        return table
    cap = prob.cap
    e = next(iter(alike.values()))[0]
    src_keys, dst_keys = list(src_groups), list(dst_groups)
    a, b = memo.pairs[pair_key]
    # every repeat's seconds, summed in the order the repeats' signatures came (the float a loop would give);
    # inf where some repeat cannot be redistributed so: that pair gets no variable
    total = None
    for sig, (member, n, _) in alike.items():
        term = n * pair_seconds(prob, member, sig, src_keys, dst_keys, a, b)
        total = term if total is None else total + term
    kept = np.flatnonzero(np.isfinite(total))
    src, dst = a[kept].astype(np.int32), b[kept].astype(np.int32)
    gathered = []
    if cap.info[e.producer].kind == PARAM:   # a weight: the bytes a pair gathers whole, once per layout pair
        by_layouts: dict = {}
        for j, (i, k) in enumerate(zip(src.tolist(), dst.tolist())):
            p, dst_layout = src_keys[i][0], dst_keys[k][0]
            gb = by_layouts.get((p, dst_layout))
            if gb is None:
                gb = by_layouts[(p, dst_layout)] = float(gathered_weight_bytes(cap, e.producer, p, dst_layout,
                                                                                 prob.mesh))
            if gb:
                gathered.append((j, gb * MEM_SCALE))
    table = memo.tables[key] = _BaseTable(src_keys, dst_keys, total[kept] * TIME_SCALE, src, dst, gathered)
    return table


def _allowed_pairs(roles: Roles, cap, e, src_groups: dict, dst_groups: dict, consumer_replicated_only: bool,
                   allowed: dict) -> tuple[np.ndarray, np.ndarray]:
    """(producer key index, consumer key index) arrays of the pairs of an edge that the roles allow, in the
    order the variables take (producer keys outer). `allowed`: allow_edge's answers under these roles (they
    depend on the layouts and whether the producer is a weight, not on the edge), shared by the edges. Asked
    once per pair of layouts, not of keys: the keys add ZeRO and partial-gradient axes to them."""
    producer = cap.info[e.producer]
    is_tuple = isinstance(producer.meta, list)
    is_param = producer.kind == PARAM
    outputs = {p: i for i, p in enumerate(dict.fromkeys(p for p, _ in src_groups))}
    inputs = {dst: k for k, dst in enumerate(dict.fromkeys(dst for dst, _ in dst_groups))}
    # (the whole table too: the edges of one kind of op ask it of the same layouts)
    table_key = ("table", is_param, is_tuple, tuple(outputs), tuple(inputs), consumer_replicated_only)
    ok = allowed.get(table_key)
    if ok is None:
        ok = allowed[table_key] = np.zeros((len(outputs), len(inputs)), dtype=bool)
        for i, p in enumerate(outputs):
            for k, dst in enumerate(inputs):
                key = (is_param, p, dst, consumer_replicated_only)
                found = allowed.get(key)
                if found is None:
                    found = allowed[key] = allow_edge(roles, producer, p, dst, consumer_replicated_only)
                # a tuple (split's pieces) is never redistributed whole; getitem takes it as is
                ok[i, k] = found and not (is_tuple and p != dst)
    src_output = np.array([outputs[p] for p, _ in src_groups], dtype=np.intp)
    dst_input = np.array([inputs[dst] for dst, _ in dst_groups], dtype=np.intp)
    mask = ok[src_output][:, dst_input]
    if is_tuple:
        mask &= np.array([not gp for _, gp in dst_groups], dtype=bool)[None, :]
    a, b = np.nonzero(mask)   # row-major: producer keys outer, as the variables are numbered
    return a, b


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
