"""Search: one strategy per node by integer linear programming (HiGHS via scipy), the program solved.

search/formulation.py builds each search's program (variables, rows, objective); this module solves it: the LP
relaxation first (an integral one is the answer), else HiGHS's branch and bound over the variables whose
reduced costs leave them a chance (_ILP.solve); several programs from the lowest bound up, one no better than a
plan found not branched on (_cheapest); HiGHS's answers kept in the solve cache; the greedy's plan where HiGHS
runs out of time with none (_fallback); the answer read back as a Solution (_finish). Entry points: solve,
free_search.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from ..cost.checkpointing import KINDS, NONE
from ..cost.problem import Problem, reshards
from .classics import Roles
from . import solve_cache
from .formulation import build
from .formulation_vars import MEM_SCALE, TIME_SCALE, Formulation, RoleMemo, tie_price
from .greedy import bound_gap, greedy
from .solution import GREEDY_NO_BOUND, INFEASIBLE, OPTIMAL, PRUNED, TIME_LIMIT, Solution

# one DEBUG record per ILP solved, its figures in `record.stage` (benchmarks/search_time.py tabulates them)
log = logging.getLogger(__name__)


class _ILP(Formulation):
    """A Formulation solved: its relaxation, reduced-cost fixing and HiGHS's branch and bound."""

    def relax(self, objective, time_limit):
        """The program with integrality dropped, by the dual simplex: its optimum is a lower bound on the
        program's, its reduced costs say how much each variable would add off its bound (solve uses them),
        and where its basic solution sets every binary to 0 or 1 it is the program's optimum itself -- as
        for most searches without a memory limit. HiGHS's presolve is off: on these programs it took
        twice the simplex's own time (measured on the README demo's 2-layer GPT on 2 x 2, 17346 variables:
        0.1-0.2 s without it, 0.3-0.55 s with it)."""
        A, row_lower, row_upper = self.matrix()
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
        A, row_lower, row_upper = self.matrix()
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
        """What HiGHS minimises: memory, or time with the search's tie-break (formulation_vars._at_step_tie_break)."""
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
    """The integer program of one search (see _solve), built (formulation.build) but not solved."""
    t_build = time.perf_counter()
    ilp = _ILP()
    built = build(prob, roles, ilp, memory_limit, minimize_memory, kind, memo)
    return _Program(prob, roles, memory_limit, time_limit, minimize_memory, gap, ilp, built.xvars, built.bvars,
                    built.stacks, built.reserve, time.perf_counter() - t_build, bounds=built.bounds)


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
    A, row_lower, row_upper = ilp.matrix()
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
    sol.priced = sol.objective + sum(tie_price(prob, name, i) for name, i in sol.choice.items())
    bound = getattr(res, "mip_dual_bound", None)
    if (bound is None or not np.isfinite(bound)) and relaxed.status == 0 and relaxed.fun is not None:
        bound = float(relaxed.fun)
    if bound is None or not np.isfinite(bound):
        sol.status, sol.mip_gap = GREEDY_NO_BOUND, 1.0
    else:
        sol.mip_gap = bound_gap(sol.priced, bound / TIME_SCALE)
    return sol
