"""Pipeline parallelism, planning side: what a pipelined plan is, and which requests make sense.

One mesh axis (the pipeline axis) holds consecutive stages of the model
instead of copies of it; the batch goes through in microbatches. Within a
stage the other axes still split it as the ILP chose (the pipeline axis
plays role classics.PIPE there: every tensor whole on it).

Schedules (torch.distributed.pipelining): GPipe runs every microbatch's
forward, then every backward (all m in flight); 1F1B alternates once the
pipe is full, so stage s holds at most p - s; both idle (p-1)/m of the
step (the bubble). Interleaved 1F1B puts v stages on each device, cutting
the bubble to (p-1)/(v m) for more sends. Zero bubble (Qi et al., torch's
ScheduleInterleavedZeroBubble, their ZB-H1) splits each backward into the
inputs' gradients, which the previous stage waits for, and the weights'
gradients, which fill the idle slots: each idles F + B - W instead of
F + B + W (ZB-H1), a third of it when the three are equal (backward is two
forwards, half of it the weights'), so the bubble shrinks to (p-1)/(3m), with
1F1B's activations in flight. schedule="auto" lets the
planner price each and keep the fastest.

The planning of a pipeline reads in three steps: stage_costs.py prices each
op of the chosen layout and what crosses each point of the graph;
stage_partition.py cuts the graph into stages; planning/planner.py tries pipeline
axes and microbatch counts and keeps the fastest plan. runtime/pipeline/stages.py
runs the result.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import numpy as np

from ..capture.blocks import block_nodes
from ..capture.export import Captured
from ..errors import PipelineError

GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE = "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"
SCHEDULES = (ONE_F_ONE_B, GPIPE, INTERLEAVED, ZERO_BUBBLE)
AUTO = "auto"   # schedule=: the planner tries each that fits and keeps the fastest
# the fewest stages a device runs under each schedule; interleaving runs v >= 2, searched (stages_per_device_candidates)
MIN_STAGES_PER_DEVICE = {GPIPE: 1, ONE_F_ONE_B: 1, INTERLEAVED: 2, ZERO_BUBBLE: 1}
# each of the bubble's p-1 idle slots, as a share of a stage's forward + backward (F + B + W, weights'
# gradients W apart): zero bubble's ZB-H1 idles F + B - W, a third of it where F = B = W
IDLE_SHARE = {GPIPE: 1.0, ONE_F_ONE_B: 1.0, INTERLEAVED: 1.0, ZERO_BUBBLE: 1 / 3}


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
    bubble: float             # idle fraction of the step relative to useful work: (p-1)/m, (p-1)/(v m), (p-1)/(3m)
    step_time: float
    stages_per_device: int    # v: 1, or interleaved's virtual stages per device

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
        # a plan saved before v was searched interleaved over 2 stages per device
        v = d.get("stages_per_device", MIN_STAGES_PER_DEVICE[d["schedule"]])
        return PipelinePlan(**dict(d, stages=stages, stages_per_device=v))


# ---------------------------------------------------------------- requests

def check_request(spec, pipeline_axis, microbatches, schedule, batch: int | None, stages_per_device=None) -> None:
    """Bad pipeline options fail before any capture or search, with what to do."""
    if schedule is not None and schedule not in SCHEDULES + (AUTO,):
        raise PipelineError(f"schedule={schedule!r}: use one of {', '.join(SCHEDULES + (AUTO,))}")
    if stages_per_device is not None:
        if isinstance(stages_per_device, bool) or not isinstance(stages_per_device, int) or stages_per_device < 2:
            raise PipelineError(f"stages_per_device={stages_per_device!r}: give an integer of 2 or more (the "
                                "virtual stages each device runs under interleaved 1F1B), or None to search it")
        if schedule not in (INTERLEAVED, AUTO):
            raise PipelineError(f"stages_per_device={stages_per_device} interleaves stages, which schedule="
                                f"{schedule!r} does not; use schedule='interleaved-1f1b' (or 'auto')")
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


def schedule_candidates(schedule: str | None) -> list[str]:
    """The schedules to price: the one asked for; 1F1B by default (the one torch's users know);
    under "auto" 1F1B, zero bubble and interleaved 1F1B."""
    if schedule == AUTO:
        return [ONE_F_ONE_B, ZERO_BUBBLE, INTERLEAVED]
    return [schedule or ONE_F_ONE_B]


def schedule_fits(schedule: str, p: int, microbatches: int) -> str | None:
    """Why torch's `schedule` cannot run `microbatches` over p devices, or None if it can."""
    if schedule != GPIPE and microbatches < p:
        return f"schedule {schedule!r} needs at least {p} microbatches, one in flight per stage"
    rounds = max(1, microbatches // p)
    if schedule in (INTERLEAVED, ZERO_BUBBLE) and microbatches % rounds:
        return f"schedule {schedule!r} needs microbatches a multiple of microbatches // {p} ({rounds})"
    return None


def stages_per_device_candidates(schedule: str, p: int, depth: int, pinned: int | None) -> list[int]:
    """The virtual stages per device to price: one but under interleaving; there the one pinned, else every v
    from 2 while v p stages leave each a layer of the model's `depth` (torch's interleaved schedule takes any v:
    its microbatch rule, rounds of m // p, does not depend on it). More v cuts the bubble to (p-1)/(v m) but
    pays a send each way per stage and microbatch, and holds more in flight on a device's first stage."""
    if schedule != INTERLEAVED:
        return [MIN_STAGES_PER_DEVICE[schedule]]
    if pinned is not None:
        return [pinned]
    return list(range(MIN_STAGES_PER_DEVICE[INTERLEAVED], depth // p + 1))


def least_bubble(schedules: list, p: int, microbatches: int, depth: int, pinned: int | None) -> float:
    """The least share of a step any of `schedules` idles with p devices and `microbatches` (PipelinePlan.bubble):
    a floor under every pipelined plan they make, for the planner to skip pipelines that cannot win."""
    return min(IDLE_SHARE[s] * (p - 1) / (max(stages_per_device_candidates(s, p, depth, pinned), default=1)
                                          * microbatches) for s in schedules)


def microbatch_candidates(p: int, batch: int, pinned: int | None) -> list[int]:
    """What the search tries when the user pins no count: p, 2p and 4p microbatches (fewer than p
    leaves a stage idle most of the step; past 4p the bubble is already under a quarter of p-1 parts
    in p, while every microbatch pays its collectives' latency again)."""
    if pinned is not None:
        return [pinned]
    return [m for m in (p, 2 * p, 4 * p) if batch % m == 0] or [batch]


# ---------------------------------------------------------------- schedules

@functools.lru_cache(maxsize=4096)   # the stage cut's search asks it per candidate span
def in_flight(schedule: str, stage: int, num_stages: int, microbatches: int, stages_per_device: int) -> int:
    """Microbatches whose activations a stage holds at the schedule's peak."""
    v = stages_per_device
    p = num_stages // v
    if schedule == GPIPE:
        return microbatches
    if schedule in (ONE_F_ONE_B, ZERO_BUBBLE):
        return min(microbatches, num_stages - stage)
    return interleaved_in_flight(p, v, microbatches, stage % p)[stage // p]


@functools.lru_cache(maxsize=1024)
def interleaved_in_flight(p: int, v: int, microbatches: int, rank: int) -> list:
    """Per local stage of device `rank`, the most microbatches it holds at once under torch's
    ScheduleInterleaved1F1B (_interleaved_alive)."""
    peak = [0] * v
    for alive in _interleaved_alive(p, v, microbatches, rank):
        peak = [max(a, b) for a, b in zip(peak, alive)]
    return tuple(peak)   # cached: immutable


def device_activations(pipe: PipelinePlan, coord: int) -> float:
    """Peak bytes of activations in flight on the device at `coord`: under an interleaved schedule its
    stages peak at different times (the first local stage while the last has drained), so the peak of their
    sum, not the sum of their peaks."""
    stages = [pipe.stages[s] for s in pipe.stages_on(coord)]
    if pipe.schedule != INTERLEAVED:
        return sum(st.activations * st.in_flight for st in stages)
    p = pipe.num_stages // pipe.stages_per_device
    return max(sum(n * st.activations for n, st in zip(alive, stages))
               for alive in _interleaved_alive(p, pipe.stages_per_device, pipe.microbatches, coord))


@functools.lru_cache(maxsize=1024)
def alive_counts(p: int, v: int, microbatches: int, rank: int) -> tuple:
    """(the distinct per-stage counts of microbatches in flight that _interleaved_alive goes through, those of them
    no other count exceeds on every stage): over the latter, the peak device_activations takes where no stage keeps
    less than nothing (stage_costs._device_activations: a device's memory, for every device of every cut tried)."""
    every = tuple(dict.fromkeys(tuple(a) for a in _interleaved_alive(p, v, microbatches, rank)))
    counts = np.array(every, dtype=np.int64).reshape(len(every), v)
    covers = (counts[None, :, :] >= counts[:, None, :]).all(axis=2)   # [a, b]: b holds as many as a on every stage
    np.fill_diagonal(covers, False)   # the counts are distinct: another one covering a exceeds it somewhere
    return every, tuple(a for a, covered in zip(every, covers.any(axis=1)) if not covered)


def _interleaved_alive(p: int, v: int, microbatches: int, rank: int):
    """The microbatches each local stage of device `rank` holds after each forward, in the order torch's
    ScheduleInterleaved1F1B runs them: a warm-up of forwards, then one forward and one backward a step, then
    the cool-down's backwards. Forwards go round the local stages a round of microbatches at a time, first
    stage first, backwards the other way round, so the first local stage runs furthest ahead."""
    rounds = max(1, microbatches // p)
    per_round = microbatches // rounds
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), microbatches * v)
    forwards = microbatches * v
    alive = [0] * v
    for op in range(forwards + warmup):
        if op < forwards:
            alive[(op // per_round) % v] += 1
            yield list(alive)
        if op >= warmup:
            alive[v - 1 - ((op - warmup) // per_round) % v] -= 1
