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
    cuts = _cut_points(costs)
    if len(cuts) - 1 < num_stages:
        raise PipelineError(f"the model has {len(cuts) - 1} place(s) where a cut passes few bytes, too few for "
                            f"{num_stages} stages on pipeline axis {axis!r}; use fewer stages")
    columns = list(_span_columns(spans, cuts))   # the same for every cap
    paths = [prob.cap.info[x].module_path for x in costs.order]
    head = {path: _head(path) for path in set(paths)}   # ops share their module's path
    heads = [head[path] for path in paths]
    pipe = None
    for cap in _stage_caps(memory_limit, transient, v):
        bounds = _best_bounds(spans, cuts, columns, num_stages, cap)
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
        return _Spans(costs, link, schedule, num_stages, microbatches, transient, _prefix(costs.time), _prefix(once),
                      _prefix(costs.acts), _prefix(first_read), shared, reads, stages_per_device)

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


def _best_bounds(spans: _Spans, cuts: list, columns: list, num_stages: int, memory_limit) -> list | None:
    """The stage boundaries [0, ..., n] minimising (slowest stage, total time), or None if none fits.

    A dynamic program over (stages so far, cut): a stage [i, j) is priced for every stage count s and every
    earlier cut i at once, an (s, i) array per cut j (numpy; a 126-layer model has ~540 cut points and up to
    ~110 stages), but the earliest cuts i, from which no stage to j fits. `columns`: _span_columns of the cuts."""
    n = len(cuts)
    inf = math.inf
    slowest = np.full((num_stages + 1, n), inf)   # (stages, cut index) -> slowest stage so far
    total = np.full((num_stages + 1, n), inf)     # ... and the sum of the stages' times, the tie-break
    prev = np.zeros((num_stages + 1, n), dtype=np.int64)
    slowest[0, 0] = total[0, 0] = 0.0
    kept = np.array([in_flight(spans.schedule, s, spans.num_stages, spans.microbatches, spans.stages_per_device)
                     for s in range(num_stages)], dtype=float)[:, None]
    few, most = kept.min(), kept.max()
    rows = np.arange(num_stages)
    for j, (time, state, acts, holds) in enumerate(columns, start=1):
        # stage s may end at the j-th cut only with a cut for each stage before it and after it, and the last
        # stage only at the last cut
        lo, hi = max(1, num_stages - (n - 1 - j)), min(num_stages, j)
        if cuts[j] == spans.n:
            lo = max(lo, num_stages)
        else:
            hi = min(hi, num_stages - 1)
        if lo > hi:
            continue
        # s - 1 stages end no earlier than cut s - 1, and from the cuts i before the first where a stage to j
        # may fit, none does (with the fewest or the most microbatches in flight, as the activations' sign has it)
        may = holds
        if memory_limit is not None:
            may = may & (state + np.minimum(few * acts, most * acts) + spans.transient <= memory_limit)
        first = max(lo - 1, int(may.argmax()))
        if not may[first:].any():
            continue
        time, state, acts, holds = time[first:], state[first:], acts[first:], holds[first:]
        before = slowest[lo - 1:hi, first:j]   # row r: s = lo + r; column c: i = first + c
        ok = holds & np.isfinite(before)
        if memory_limit is not None:
            ok &= state + kept[lo - 1:hi] * acts + spans.transient <= memory_limit
        # a row with no i that fits stays infinite (its prev is never followed)
        worst = np.where(ok, np.maximum(before, time), inf)
        least = worst.min(axis=1)
        tie = np.where(ok & (worst == least[:, None]), total[lo - 1:hi, first:j] + time, inf)
        c = tie.argmin(axis=1)   # the first i of the least (slowest, total), as a scan in order picks
        slowest[lo:hi + 1, j], total[lo:hi + 1, j], prev[lo:hi + 1, j] = least, tie[rows[:len(c)], c], first + c
    if not math.isfinite(slowest[num_stages, n - 1]):
        return None
    bounds, k = [cuts[-1]], n - 1
    for s in range(num_stages, 0, -1):
        k = int(prev[s, k])
        bounds.append(cuts[k])
    return bounds[::-1]


def _span_columns(spans: _Spans, cuts: list):
    """For each cut j after the first, (time, state, activations, holds weights) of the stages [i, j) for
    every earlier cut i, as arrays: what _Spans.time, .state and .activations give one span, in the same
    order of operations; a stage holds weights if some op in it reads one (a device with no weights to train
    wastes its share, and an optimizer refuses it)."""
    at = np.asarray(cuts, dtype=np.int64)
    t_at, s_at, a_at = (np.asarray(x)[at] for x in (spans.t_sum, spans.s_sum, spans.a_sum))
    send_at = np.array([spans.send(c) for c in cuts])
    reads = np.asarray(spans.reads, dtype=np.int64)
    k = np.searchsorted(reads, at, side="left")
    next_read = np.where(k < len(reads), reads[np.minimum(k, max(len(reads) - 1, 0))] if len(reads) else 0, np.inf)
    for j in range(1, len(cuts)):
        time = (t_at[j] - t_at[:j]) + send_at[:j] + send_at[j]
        extra = np.zeros(j)
        for readers, st in spans.shared:   # a weight first read before i and read again in [i, j)
            last = max((r for r in readers if r < cuts[j]), default=-1)
            extra += np.where((readers[0] < at[:j]) & (at[:j] <= last), st, 0.0)
        yield time, (s_at[j] - s_at[:j]) + extra, a_at[j] - a_at[:j], next_read[:j] < cuts[j]


def _stage(costs: OpCosts, spans: _Spans, heads: list, s: int, i: int, j: int) -> Stage:
    nodes = tuple(costs.order[i:j])
    return Stage(s, nodes, _compress_heads(heads[i:j]), spans.time(i, j),
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
