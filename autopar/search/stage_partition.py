"""Pipeline parallelism: the cut of the graph into stages, by dynamic programming.

Each stage is a contiguous run of ops in graph order, so what crosses a cut
is exactly the tensors made before it and read after it (sent forward, their
gradients sent back). The program minimises the slowest stage (the pipeline
runs at its pace), counting every op where it runs -- the embedding and the
output head included, so a big vocabulary makes the first and last stages
shorter by itself -- and rejects a cut whose stage does not fit memory_limit
with the activations the schedule keeps in flight on it.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

import cost_models as cm

from ..errors import PipelineError
from .pipeline import IDLE_SHARE, INTERLEAVED, MIN_STAGES_PER_DEVICE, PipelinePlan, Stage, in_flight
from .stage_costs import OpCosts, device_memory, idle_window

# a cut may fall where at most this many times the fewest bytes of the model's body cross: "few bytes"
# (a transformer's residual stream between blocks, or between attention and MLP), not mid-attention
CUT_SLACK = 2.0


def partition(prob, costs: OpCosts, *, axis: str, microbatches: int, schedule: str, stages_per_device: int = 1,
              memory_limit=None, transient: float = 0.0) -> PipelinePlan:
    """The cut into stages that makes the slowest stage fastest, each device fitting `memory_limit` with
    everything it holds: under an interleaved schedule a device holds `stages_per_device` stages, whose weights
    and activations in flight add up. `costs`: op_costs of the chosen strategies."""
    p = prob.mesh.axis_sizes[prob.mesh.axis_index(axis)]
    v = stages_per_device
    if (v >= MIN_STAGES_PER_DEVICE[INTERLEAVED]) != (schedule == INTERLEAVED):
        raise PipelineError(f"{v} stage(s) per device under schedule {schedule!r}: interleaved 1F1B runs 2 or more "
                            "per device, every other schedule one")
    num_stages = p * v
    spans = _Spans.of(costs, prob.links[axis], schedule, num_stages, microbatches, transient, v)
    cuts, table, heads = _cut_table(prob, costs, spans)
    if len(cuts) - 1 < num_stages:
        raise PipelineError(f"the model has {len(cuts) - 1} place(s) where a cut passes few bytes, too few for "
                            f"{num_stages} stages on pipeline axis {axis!r}; use fewer stages")
    pipe, lower, last_cap = None, 0.0, None
    for cap in _stage_caps(memory_limit, transient, v):
        if last_cap is not None and cap > last_cap:
            lower = 0.0   # a looser cap's cut may be faster: no guess from the last
        last_cap = cap
        bounds, lower = _best_bounds(spans, cuts, table, num_stages, cap, lower or 0.0)
        if bounds is None:
            if memory_limit is None or memory_limit >= transient:
                break   # the caps only tighten, so no cut meets the next either
            continue    # under a limit below the transient the caps grow (_stage_caps)
        pipe = _pipeline(prob, costs, spans, axis, p, bounds, heads)
        worst = max(st.memory for st in pipe.stages)   # a stage carries its device's peak; every device holds one
        if memory_limit is None or worst <= memory_limit:
            return pipe
    share = (spans.memory(0, spans.n, 0) - transient) / p + transient   # the whole model over p devices, evenly
    raise PipelineError(f"no cut of the model into {num_stages} stages on pipeline axis {axis!r} fits "
                        f"memory_limit={cm.format_bytes(memory_limit)} per device with {microbatches} microbatches "
                        f"under {schedule} (an even share of the model, with stage 0's microbatches in flight, "
                        f"would be about {cm.format_bytes(share)} per device, and layers cannot be split finer "
                        "than the cut points); raise the limit, use 1f1b (fewer microbatches in flight than gpipe "
                        "or interleaving), checkpointing, or more devices")


def _cut_table(prob, costs: OpCosts, spans: "_Spans") -> tuple:
    """(cut points, _span_table of them, per op the _head of its module path) of `costs`, found once for every
    stage count and cap the planner cuts these costs with (kept on the costs, by the pipeline axis's link)."""
    memo = costs.memo.get(("cut table", spans.link))
    if memo is None:
        cuts = _cut_points(costs)
        paths = [prob.cap.info[x].module_path for x in costs.order]
        head = {path: _head(path) for path in set(paths)}   # ops share their module's path
        memo = costs.memo[("cut table", spans.link)] = (cuts, _span_table(spans, cuts), [head[p] for p in paths])
    return memo


def _stage_caps(memory_limit, transient: float, v: int) -> list:
    """The per-stage limits the cut is tried with, loosest first. With one stage per device the limit itself
    is exact. With v stages a device holds v of them, whose sum the program cannot see: the limit, then
    tighter caps down to a v-th of it, which always holds if any cut meets it."""
    if memory_limit is None or v == 1:
        return [memory_limit]
    loose, tight = memory_limit, (memory_limit - transient) / v + transient
    return [loose + (tight - loose) * k / 4 for k in range(5)]


def _pipeline(prob, costs: OpCosts, spans: "_Spans", axis: str, p: int, bounds: list, heads: list) -> PipelinePlan:
    """The plan of a cut: its stages, the bubble, and the step time of the slowest device (every microbatch
    through its stages, the collectives it pays once per step beyond its idle window, and the bubble).
    `heads`: per op, _head of its module path."""
    num_stages, m, schedule = spans.num_stages, spans.microbatches, spans.schedule
    stages = [_stage(costs, spans, heads, s, bounds[s], bounds[s + 1]) for s in range(num_stages)]
    v = spans.stages_per_device
    slowest = max(st.time for st in stages)
    # what a device pays once per step, less what hides in its idle time around its microbatches
    per_device = max(m * sum(stages[s].time for s in range(c, num_stages, p))
                     + max(0.0, sum(spans.once(bounds[s], bounds[s + 1]) for s in range(c, num_stages, p))
                           - idle_window(prob, stages, c, schedule)) for c in range(p))
    idle = IDLE_SHARE[schedule]
    pipe = PipelinePlan(axis, num_stages, m, schedule, tuple(stages), idle * (p - 1) / (v * m),
                        per_device + idle * (p - 1) * slowest, v)
    # each stage's memory: the peak of the device that holds it, everything on it (what the limit is held to)
    peaks = [device_memory(costs, pipe, c, spans.transient) for c in range(p)]
    return replace(pipe, stages=tuple(replace(st, memory=peaks[st.index % p]) for st in stages))


def step_floor(costs: OpCosts, p: int, stages_per_device: int, microbatches: int, schedule: str) -> float:
    """No cut of these ops over p devices steps faster: some device runs at least a p-th of every microbatch's
    ops, and the bubble idles (p-1) times the slowest stage, at least an even share of the ops (_pipeline)."""
    total = sum(costs.time)
    return microbatches * total / p + IDLE_SHARE[schedule] * (p - 1) * total / (stages_per_device * p)


@dataclass
class _Spans:
    """What a stage running ops [i, j) costs, from prefix sums over the graph order."""
    costs: OpCosts
    link: object
    schedule: str
    num_stages: int
    microbatches: int
    transient: float
    t_sum: list          # prefix sums of per-op time per microbatch
    o_sum: list          # ... of the collectives paid once per step
    a_sum: list          # ... of activation bytes
    s_sum: list          # ... of weight state, charged to each weight's first reader
    shared: list         # (readers, bytes) of weights read in more than one place
    reads: list          # sorted positions of every op that reads a weight
    stages_per_device: int

    @staticmethod
    def of(costs: OpCosts, link, schedule: str, num_stages: int, microbatches: int, transient: float,
           stages_per_device: int) -> "_Spans":
        sums = costs.memo.get("span sums")   # the same for every stage count the costs are cut into
        if sums is None:
            n = len(costs.order)
            first_read, shared = [0.0] * n, []
            for name, parts in costs.state_parts.items():
                st = sum(parts[:4])   # bytes held; the fifth is what the optimizer step moves
                readers = costs.users.get(name) or []
                if readers:
                    first_read[readers[0]] += st
                    if readers[-1] != readers[0]:   # a stage holds its own copy of a weight it reads
                        shared.append((readers, st))
            reads = sorted({r for rs in costs.users.values() for r in rs})
            once = [sum(step_seconds.values()) for _, step_seconds in costs.step_parts]
            sums = costs.memo["span sums"] = (_prefix(costs.time), _prefix(once), _prefix(costs.acts),
                                              _prefix(first_read), shared, reads)
        return _Spans(costs, link, schedule, num_stages, microbatches, transient, *sums, stages_per_device)

    @property
    def n(self) -> int:
        return len(self.costs.order)

    def send(self, k: int) -> float:
        """Seconds per microbatch to send the activations crossing cut k forward and their gradients back."""
        if k in (0, self.n):
            return 0.0
        return 2 * float(cm.collective_time(cm.SEND_RECV, self.costs.crossing[k], 2, self.link))

    def time(self, i: int, j: int) -> float:
        return self.t_sum[j] - self.t_sum[i] + self.send(i) + self.send(j)

    def once(self, i: int, j: int) -> float:
        """Seconds of the collectives ops [i, j) pay once per step."""
        return self.o_sum[j] - self.o_sum[i]

    def state(self, i: int, j: int) -> float:
        extra = sum(st for readers, st in self.shared if readers[0] < i and any(i <= r < j for r in readers))
        return self.s_sum[j] - self.s_sum[i] + extra

    def activations(self, i: int, j: int) -> float:
        return self.a_sum[j] - self.a_sum[i]

    def memory(self, i: int, j: int, stage: int) -> float:
        kept = in_flight(self.schedule, stage, self.num_stages, self.microbatches, self.stages_per_device)
        return self.state(i, j) + kept * self.activations(i, j) + self.transient


def _best_bounds(spans: _Spans, cuts: list, table: "_SpanTable", num_stages: int, memory_limit,
                 lower: float = 0.0) -> tuple:
    """(the stage boundaries [0, ..., n] minimising (slowest stage, total time), the slowest stage's time), or
    (None, None) if no cut fits.

    A dynamic program over (stages so far, cut): for each stage count s, a stage [i, j) ending at every cut j is
    priced from every earlier cut i at once (numpy), the least (slowest, total) kept per (s, j), ties to the first
    i. A 126-layer model has ~540 cut points and up to ~110 stages, so the program looks only at stages no slower
    than a bound (_program), first `lower` (a guess: the slowest stage of a looser cap's cut) or a tenth over an
    even share of the time, then larger, up to the slowest stage that fits at all. Within a bound the program's
    answer is the unbounded one's whenever it finds a cut (_program), so the bounds change the time taken only.
    `table`: _span_table of the cuts."""
    n = len(cuts)
    kept = np.array([in_flight(spans.schedule, s, spans.num_stages, spans.microbatches, spans.stages_per_device)
                     for s in range(num_stages)], dtype=float)
    fits = table.holds   # stages that hold a weight and may fit with the fewest or the most microbatches in flight
    if memory_limit is not None:
        few, most = kept.min(), kept.max()
        fits = fits & (table.state + np.minimum(few * table.acts, most * table.acts) + spans.transient <= memory_limit)
    if not fits[:, n - 1].any():
        return None, None
    largest = float(table.time[fits].max())
    bound = max(lower, float(table.t_at[-1] - table.t_at[0]) / num_stages * (1 + _FIRST_MARGIN))
    tried = False
    while True:
        if not bound > 0 or bound >= largest:
            bound = largest
        bounds, slowest = _program(spans, cuts, table, fits, kept, num_stages, memory_limit, bound)
        if bounds is not None or bound >= largest:
            return bounds, slowest
        if not tried and not _feasible(spans, table, fits, kept, num_stages, memory_limit):
            return None, None   # no cut fits at all: say so now rather than after every larger bound
        tried = True
        bound *= _GROWTH


# _best_bounds' first bound is this much over an even share of the time, and each next one this many times larger
_FIRST_MARGIN = 0.1
_GROWTH = 1.6
# a stage count derived from a sum of stage times (_program) allows for this relative rounding of that sum
_ROUNDING = 1e-9


def _program(spans: _Spans, cuts: list, table: "_SpanTable", fits, kept, num_stages: int, memory_limit,
             bound: float) -> tuple:
    """_best_bounds' program over the stages no slower than `bound` only: (boundaries, slowest) or (None, None).

    Where it finds a cut, it is the cut the program over every stage finds: every (s, j) whose least slowest
    stage is at most `bound` is reached by the same stages here (its best earlier cuts i have a slowest stage
    at most `bound` too, and the others are slower here, never faster), with the same totals and ties, and a
    cut found here has every stage at most `bound`. The (s, j) left out besides: those no s stages of at most
    `bound` reach (their times add up to the time before cut j at least: sends take no less than nothing) or
    from which the N - s stages left cannot finish; no cut this program finds passes them.

    The stages [i, j) are held as a band per j of the W cuts i before it (W: the most any allowed stage spans),
    and each stage count s computed for all its cuts j at once."""
    n, N = len(cuts), num_stages
    inf = math.inf
    allowed = fits & (table.time <= bound)
    j = np.arange(n)
    span = j - np.where(allowed.any(axis=0), allowed.argmax(axis=0), j)   # per j: the cuts back its earliest i is
    W = max(1, int(span.max()))
    bt = _banded(table.time, W, inf)
    ok = _banded(allowed, W, False)
    if memory_limit is not None:
        bs, ba = _banded(table.state, W, 0.0), _banded(table.acts, W, 0.0)
    need_before = need_after = np.zeros(n)
    scale = (1 - _ROUNDING) / bound if bound > 0 else math.inf
    if math.isfinite(scale):   # (a bound so small its inverse overflows, ~1e-308 s, bounds no stage count: 0 * inf)
        need_before = np.ceil((table.t_at - table.t_at[0]) * scale)   # the fewest stages of at most `bound` to cut j
        need_after = np.ceil((table.t_at[-1] - table.t_at) * scale)   # ... from cut j to the end
    slowest = np.full((N + 1, n + W), inf)   # (stages, W + cut index) -> slowest stage so far; W infinite first
    total = np.full((N + 1, n + W), inf)     # ... and the sum of the stages' times, the tie-break
    prev = np.zeros((N + 1, n), dtype=np.int64)
    slowest[0, W] = total[0, W] = 0.0
    slow_w, total_w = _windows(slowest, W), _windows(total, W)   # [s, j, k]: the value at cut j - W + k
    timed = {}   # microbatches in flight -> bt, infinite where such a stage may not be
    for s in range(1, N + 1):
        a, b = _ends(s, N, n)
        rows = np.flatnonzero((need_before[a:b] <= s) & (need_after[a:b] <= N - s))
        if not rows.size:
            return None, None
        a, b = a + int(rows[0]), a + int(rows[-1]) + 1
        k = kept[s - 1]
        if k not in timed:
            fit = ok if memory_limit is None else ok & (bs + k * ba + spans.transient <= memory_limit)
            timed[k] = np.where(fit, bt, inf)
        w = max(1, int(span[a:b].max()))   # the band these cuts j need
        time = timed[k][a:b, W - w:]
        worst = np.maximum(slow_w[s - 1, a:b, W - w:], time)   # infinite where no stage [i, j) may be
        least = worst.min(axis=1)
        if not (least < inf).any():
            return None, None
        tie = np.where(worst == least[:, None], total_w[s - 1, a:b, W - w:] + time, inf)
        c = tie.argmin(axis=1)   # the first i of the least (slowest, total), as a scan in order picks
        slowest[s, W + a:W + b], total[s, W + a:W + b] = least, tie[np.arange(b - a), c]
        prev[s, a:b] = j[a:b] - w + c
    if not math.isfinite(slowest[N, W + n - 1]):
        return None, None
    bounds, k = [cuts[-1]], n - 1
    for s in range(N, 0, -1):
        k = int(prev[s, k])
        bounds.append(cuts[k])
    return bounds[::-1], float(slowest[N, W + n - 1])


def _feasible(spans: _Spans, table: "_SpanTable", fits, kept, num_stages: int, memory_limit) -> bool:
    """Whether any cut into `num_stages` stages fits, however slow (the program's stages, times aside)."""
    n, N = len(table.t_at), num_stages
    j = np.arange(n)
    span = j - np.where(fits.any(axis=0), fits.argmax(axis=0), j)
    W = max(1, int(span.max()))
    ok = _banded(fits, W, False)
    if memory_limit is not None:
        bs, ba = _banded(table.state, W, 0.0), _banded(table.acts, W, 0.0)
    masks = {}
    reach = np.zeros((1, n + W), dtype=bool)   # W + cut index -> some stages so far end there
    reach[0, W] = True
    window = _windows(reach, W)[0]
    for s in range(1, N + 1):
        a, b = _ends(s, N, n)
        k = kept[s - 1]
        if k not in masks:
            masks[k] = ok if memory_limit is None else ok & (bs + k * ba + spans.transient <= memory_limit)
        ends = (window[a:b] & masks[k][a:b]).any(axis=1)
        if not ends.any():
            return False
        reach[0] = False
        reach[0, W + a:W + b] = ends
    return bool(reach[0, W + n - 1])


def _ends(s: int, num_stages: int, n: int) -> tuple:
    """[a, b): the cut indices stage s (from 1) may end at, a cut for each stage before it and after it, and
    the last stage only at the last cut."""
    if s == num_stages:
        return n - 1, n
    return s, max(s, min(n - 2, n - 1 - (num_stages - s)) + 1)


def _banded(m, width: int, fill):
    """(n, width) of an (n, n) array by (i, j): row j holds m[j - width + k, j] for k < width, `fill` before 0."""
    n = m.shape[0]
    i = np.arange(n)[:, None] - width + np.arange(width)[None, :]
    return np.where(i >= 0, m[np.maximum(i, 0), np.arange(n)[:, None]], fill)


def _windows(m, width: int):
    """A read-only view (rows, cols - width, width) of a (rows, cols) array: [s, j, k] is m[s, j + k]."""
    rows, cols = m.shape
    return np.lib.stride_tricks.as_strided(m, (rows, cols - width, width),
                                           (m.strides[0], m.strides[1], m.strides[1]), writeable=False)


@dataclass
class _SpanTable:
    """What a stage [cuts[i], cuts[j]) costs, for every pair of cuts, as (i, j) arrays: what _Spans.time,
    .state and .activations give one span, in the same order of operations."""
    time: np.ndarray
    state: np.ndarray
    acts: np.ndarray
    holds: np.ndarray     # a stage holds weights if some op in it reads one (a device with no weights to train
                          # wastes its share, and an optimizer refuses it); False where j <= i
    t_at: np.ndarray      # the time before each cut (_Spans.t_sum)


def _span_table(spans: _Spans, cuts: list) -> _SpanTable:
    at = np.asarray(cuts, dtype=np.int64)
    n = len(cuts)
    t_at, s_at, a_at = (np.asarray(x)[at] for x in (spans.t_sum, spans.s_sum, spans.a_sum))
    send_at = np.array([spans.send(c) for c in cuts])
    reads = np.asarray(spans.reads, dtype=np.int64)
    k = np.searchsorted(reads, at, side="left")
    next_read = np.where(k < len(reads), reads[np.minimum(k, max(len(reads) - 1, 0))] if len(reads) else 0, np.inf)
    time = (t_at[None, :] - t_at[:, None]) + send_at[:, None] + send_at[None, :]
    extra = np.zeros((n, n))
    for readers, st in spans.shared:   # a weight first read before i and read again in [i, j)
        last = np.array([max((r for r in readers if r < c), default=-1) for c in cuts])
        extra += np.where((readers[0] < at[:, None]) & (at[:, None] <= last[None, :]), st, 0.0)
    state = (s_at[None, :] - s_at[:, None]) + extra
    acts = a_at[None, :] - a_at[:, None]
    holds = (j := np.arange(n))[:, None] < j[None, :]
    holds &= next_read[:, None] < at[None, :]
    return _SpanTable(time, state, acts, holds, t_at)


def _stage(costs: OpCosts, spans: _Spans, heads: list, s: int, i: int, j: int) -> Stage:
    named = costs.memo.setdefault("stage names", {})   # (i, j) -> (its ops, its modules): cuts share stages
    if (i, j) not in named:
        named[i, j] = (tuple(costs.order[i:j]), _compress_heads(heads[i:j]))
    nodes, modules = named[i, j]
    return Stage(s, nodes, modules, spans.time(i, j),
                 spans.memory(i, j, s), spans.activations(i, j),
                 in_flight(spans.schedule, s, spans.num_stages, spans.microbatches, spans.stages_per_device),
                 costs.crossing[j] if j < spans.n else 0.0)


def _prefix(values) -> list:
    return list(itertools.accumulate(values, initial=0.0))


def _cut_points(costs: OpCosts) -> list:
    """Where a stage may end: the ends, and the points where at most CUT_SLACK times the fewest bytes
    crossing anywhere in the model's body (between its first and last weight) cross."""
    n = len(costs.order)
    readers = [r for rs in costs.users.values() for r in rs]
    lo, hi = (min(readers) + 1, max(readers)) if readers else (1, n - 1)
    body = [c for c in costs.crossing[lo:hi + 1] if c < math.inf] or [c for c in costs.crossing if c < math.inf]
    fewest = min(body) if body else 0.0
    return [0] + [k for k in range(1, n) if costs.crossing[k] <= CUT_SLACK * fewest] + [n]


def _head(path: str) -> str:
    """A module path up to its layer number."""
    parts = path.split(".") if path else ["<root>"]
    k = next((i for i, x in enumerate(parts) if x.isdigit()), 0)
    return ".".join(parts[:k + 1])


def _compress_heads(ops_heads) -> str:
    """The _head of each op's module path, to a short list: each head once, consecutive layers as a range.
    (Per op rather than per path, as a stage is priced for every cut tried: the heads are found once.)"""
    heads = []
    for head in ops_heads:
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
