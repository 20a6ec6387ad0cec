"""audit: run one training step and set the plan's predictions beside what the step did.

Measured, on this rank:
- bytes each collective moved (the runtime logs every call: kind, axis, tensor size),
- activation bytes autograd saved for backward (a saved-tensor hook; for a
  checkpointed block, the tensors its checkpoint holds), counted by
  storage: a saved view keeps its base's whole storage alive, and tensors that share
  a storage (an attention output and the reshaped view the next linear keeps) are one
  allocation, counted once. Parameters and buffers (the "parameters" row) and FSDP
  re-gathered weights are not activations. Unpipelined, every storage saved in the step
  counts (forward saves them all before backward frees any, so that is also the peak);
  pipelined, the peak of the bytes alive at once: a storage counts from when it is
  first saved until it is freed, which is the microbatches the schedule holds in flight,
- parameter, gradient and optimizer-state bytes actually allocated (gradients
  as backward leaves them, before the optimizer step; with an
  autopar.ShardedOptimizer, its ZeRO-2 gradient slices too; under a pipeline that
  holds FSDP weights whole through the step, the whole weights and their summed
  gradients too, which the step drops as it ends),
- with `timed_steps`, the step's time (the median over that many more steps) and, per
  mesh axis, the time this rank spent blocked in collectives (calls and waits,
  runtime/collectives.Comm.clock): the exposed communication the plan predicts
  (`predicted.exposed_comm_time`; the rest should hide behind compute). On CPU
  (gloo) that is the time the step waited; on CUDA a collective's call returns
  once queued on its stream, so the figure is the host's waits only. The measured
  step includes the optimizer step (`predicted.optimizer_time`) and zero_grad.

A pipelined module (plan.pipeline) trains through `train_step` with `loss_fn(outputs,
targets)` and `targets=` as train_step takes them; its first step also runs torch's shape
inference on every stage (collectives and saved tensors of made-up inputs), so audit runs
one step unmeasured first. The pipeline axis's bytes are what this rank's stages send:
activations forward and the gradients of what they received back (runtime/observe.py).
`plan.predicted` describes one device of the pipeline, the one that needs the most memory
(search/stage_costs.device_prediction); the report says which (`report.device`). On its
ranks every row compares with plan.predicted; on the other ranks only what the plan gives
per device: the activations in flight (search/pipeline.device_activations: the peak over the
schedule of its stages' microbatches in flight times their activations) and the step time
(the whole pipeline's).
The pipeline axis has no exposed-time row: torch's schedule waits on its sends and
receives, where the waits for the bubble and for the link cannot be told apart. On a
device after the first, the time blocked in its once-per-step collectives counts whole,
though the plan prices as hidden what the schedule's idle time around that device's
microbatches absorbs (search/stage_costs.idle_window): time it would otherwise spend
waiting for the device before it, which that row cannot tell apart either.
"""
from __future__ import annotations

import statistics
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import cost_models as cm

from .errors import PlanError
from .runtime.module import ParallelModule
from .runtime.observe import observing
from .search.pipeline import device_activations


@dataclass(frozen=True)
class AuditRow:
    quantity: str
    predicted: float
    measured: float
    unit: str = "bytes"   # or "seconds"

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted else float("inf") if self.measured else 1.0


@dataclass(frozen=True)
class PipelineDevice:
    """Which device of a pipeline a rank is, and which one plan.predicted describes."""
    axis: str
    coord: int            # this rank's coordinate on the pipeline axis
    stages: tuple         # the stages it runs
    described: int        # the coordinate of the device plan.predicted describes
    activations: float    # this device's predicted in-flight activations, from plan.pipeline.stages

    @property
    def is_described(self) -> bool:
        return self.coord == self.described

    def __str__(self) -> str:
        me = f"{self.axis}={self.coord} (stages {', '.join(map(str, self.stages))})"
        if self.is_described:
            return f"{me}: the device plan.predicted describes"
        return (f"{me}: plan.predicted describes {self.axis}={self.described}; rows here are this device's "
                "in-flight activations (plan.pipeline.stages) and the pipeline's step time")


@dataclass(frozen=True)
class AuditReport:
    rows: tuple
    device: PipelineDevice | None = None   # a pipelined module's: which device this rank is

    def row(self, quantity: str) -> AuditRow:
        return next(r for r in self.rows if r.quantity == quantity)

    def __str__(self) -> str:
        lines = [f"pipeline device {self.device}"] if self.device is not None else []
        lines += [f"{'quantity':<34} {'predicted':>14} {'measured':>14} {'measured/pred':>14}"]
        for r in self.rows:
            show = cm.format_bytes if r.unit == "bytes" else (lambda s: f"{s * 1e3:.2f} ms")
            lines.append(f"{r.quantity:<34} {show(r.predicted):>14} {show(r.measured):>14} {r.ratio:>14.3f}")
        return "\n".join(lines)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def audit(module: ParallelModule, *local_inputs, loss_fn=None, optimizer=None, timed_steps: int = 0,
          targets=None) -> AuditReport:
    """One forward + backward (+ optimizer step, if given) on this rank's inputs, measured.

    `loss_fn(output)` (or `loss_fn(output, targets)` with `targets=`, as train_step takes them)
    defaults to the mean of the (first) output. With
    an optimizer, its state is measured after one step (AdamW allocates its
    moments lazily); gradients are zeroed first. `timed_steps` more steps are
    timed after that one (the first step allocates and warms up, so it is not
    timed); 0, the default, keeps audit to one step and leaves the time rows out.
    Call it on every rank: the steps run collectives.
    """
    step = (local_inputs, loss_fn or _mean_of_first, optimizer, targets)
    device = pipeline_device(module) if module.plan.pipeline is not None else None
    if device is not None:   # torch's shape inference runs in the first step (module docstring)
        _train_step(module, *step)
        _zero_grads(module, optimizer)
    with _measuring(module, local_inputs) as (saved, log, sent, held):
        grad_bytes = _train_step(module, *step) + held.grad_bytes
        records = list(log.records)
    comm = _comm_bytes(module.plan, records)
    if device is not None:
        comm[device.axis] += sent.total
    activations = saved.total() if device is None else saved.peak
    rows = _rows(module, optimizer, comm, grad_bytes, activations, device, held.bytes)
    if timed_steps > 0:
        rows += _time_rows(module, _timed(module, step, timed_steps), device)
    return AuditReport(tuple(rows), device)


def pipeline_device(module: ParallelModule) -> PipelineDevice:
    """This rank's device of the module's pipeline, and which device plan.predicted describes: the one whose
    stages' memory (plan.pipeline.stages[s].memory: the peak of the device holding stage s) is the largest,
    the first of equals, as search/stage_costs.device_prediction chooses it."""
    plan, pipe = module.plan, module.plan.pipeline
    p = pipe.num_stages // pipe.stages_per_device
    coord = module.coords[plan.mesh.axis_index(pipe.axis)]
    described = max(range(p), key=lambda c: pipe.stages[c].memory)
    total = plan.predicted.memory.total
    if abs(pipe.stages[described].memory - total) > 1e-9 * max(total, 1.0):
        raise PlanError(f"plan.predicted's memory ({cm.format_bytes(total)}) is no device's of pipeline axis "
                        f"{pipe.axis!r} (stages' peaks {[cm.format_bytes(s.memory) for s in pipe.stages[:p]]}): "
                        "audit cannot tell which device the prediction describes")
    stages = tuple(pipe.stages_on(coord))
    return PipelineDevice(pipe.axis, coord, stages, described, float(device_activations(pipe, coord)))


def _mean_of_first(out):
    first = out[0] if isinstance(out, (tuple, list)) else out
    return first.float().mean()


def _zero_grads(module: ParallelModule, optimizer) -> None:
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    for p in module.parameters():
        p.grad = None


def _timed(module: ParallelModule, step: tuple, steps: int) -> tuple:
    """(step seconds, {axis: seconds blocked in collectives}), each the median over `steps` steps: the
    typical step, not one a hiccup of the machine slowed."""
    times, blocked = [], []
    try:
        for _ in range(steps):
            module.comm.clock = {}
            t0 = time.perf_counter()
            _train_step(module, *step)
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            blocked.append(module.comm.clock)
    finally:
        module.comm.clock = None
    axes = {a for b in blocked for a in b}
    return statistics.median(times), {a: statistics.median(b.get(a, 0.0) for b in blocked) for a in axes}


def _time_rows(module: ParallelModule, timed: tuple, device: PipelineDevice | None) -> list:
    step, blocked = timed
    pred, names = module.plan.predicted, module.plan.mesh.axis_names
    rows = [AuditRow("step time", pred.step_time, step, "seconds")]
    if device is not None and not device.is_described:
        return rows
    rows += [AuditRow(f"exposed comm time on {a}", pred.exposed_comm_time.get(a, pred.comm_time[a]),
                      blocked.get(i, 0.0), "seconds") for i, a in enumerate(names)
             if device is None or a != device.axis]
    return rows


class _SavedActivations:
    """Bytes autograd keeps for backward, one entry per storage (see the module docstring): every storage the
    step saved (`total`), and the most alive at once (`peak`)."""

    def __init__(self, module: ParallelModule, local_inputs: tuple):
        # parameters and buffers are counted in their own row, whichever view of them is saved
        self._weights = {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())}
        # plan.local_inputs cuts a rank's batch as a view of the global one; in a real run the
        # rank holds only its shard, so an input's storage counts as the shard's bytes
        self._shards = {t.untyped_storage().data_ptr(): _nbytes(t) for t in local_inputs
                        if isinstance(t, torch.Tensor)}
        self._bytes: dict = {}   # storage address -> bytes
        self._alive: dict = {}   # what is saved and not freed yet -> bytes
        self._finalizers: list = []
        self.now = self.peak = 0

    def weight(self, t: torch.Tensor) -> None:
        """A tensor counted as a weight, not as an activation, when saved (a weight held whole for the step)."""
        self._weights.add(t.untyped_storage().data_ptr())

    def saved(self, t: torch.Tensor) -> None:
        """A tensor backward keeps (runtime/observe.observing's on_saved)."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._weights:
            return
        self._bytes[ptr] = self._shards.get(ptr, storage.nbytes())
        # the caller holds the inputs' storage through the step: a saved piece of it (a microbatch) lives as
        # long as the tensor saved; any other storage, until it is freed (a storage's Python object lives as
        # long as the storage does)
        key, nbytes, owner = (("input", id(t)), _nbytes(t), t) if ptr in self._shards else (ptr, storage.nbytes(),
                                                                                             storage)
        if key in self._alive or nbytes == 0:
            return
        self._alive[key] = nbytes
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        self._finalizers.append(weakref.finalize(owner, self._freed, key))

    def _freed(self, key) -> None:
        self.now -= self._alive.pop(key)

    def region_inputs(self, inputs) -> None:
        """A checkpointed block keeps no activations but holds the tensors it reads."""
        for t in inputs:
            if isinstance(t, torch.Tensor):
                self.saved(t)

    def total(self) -> int:
        return sum(self._bytes.values())

    def close(self) -> None:
        for f in self._finalizers:   # storages that outlive the step (the caller's) stop calling back
            f.detach()


class _Held:
    """The weights a pipelined FSDP step holds whole (reshard_after_forward False; runtime/observe.py's on_held):
    their bytes, and the bytes of their whole gradients, which the step sums over the microbatches before it
    reduces them and drops both; each counted once, a gradient at the size autograd makes it (the compute
    dtype, as the plan prices it; runtime/pipeline/held_weights.py keeps the sum in the reduce dtype)."""

    def __init__(self, saved: _SavedActivations):
        self._saved, self._seen, self._graded, self._handles = saved, set(), set(), []
        self.bytes = self.grad_bytes = 0

    def __call__(self, t: torch.Tensor) -> None:
        if id(t) in self._seen:   # (every microbatch's stage call shows it again; it lives through the step)
            return
        self._seen.add(id(t))
        self.bytes += _nbytes(t)
        self._saved.weight(t)
        key = id(t)   # the step moves each gradient out of .grad as it comes: it is seen on its way in
        self._handles.append(t.register_hook(lambda grad: self._gradient(key, grad)))

    def _gradient(self, key: int, grad: torch.Tensor) -> None:
        if key not in self._graded:
            self._graded.add(key)
            self.grad_bytes += _nbytes(grad)

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class _Sent:
    """Bytes this rank's pipeline stages send (runtime/observe.observing's on_sent)."""

    def __init__(self):
        self.total = 0

    def __call__(self, t: torch.Tensor) -> None:
        self.total += _nbytes(t)


@contextmanager
def _measuring(module: ParallelModule, local_inputs: tuple):
    """Within: saved tensors are counted, collectives logged to a fresh CommLog and pipeline sends summed
    (runtime/observe.py).

    Yields (the _SavedActivations counting, the fresh CommLog, the _Sent summing, the _Held weights).
    """
    saved, sent = _SavedActivations(module, local_inputs), _Sent()
    held = _Held(saved)
    try:
        with observing(module, saved.saved, saved.region_inputs, sent, held) as log:
            yield saved, log, sent, held
    finally:
        saved.close()
        held.close()


def _train_step(module: ParallelModule, local_inputs: tuple, loss_fn, optimizer, targets) -> int:
    """Forward, backward (train_step: a pipelined module's schedule) and (with an optimizer) a step; returns
    the gradient bytes backward left."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    module.train_step(*local_inputs, loss_fn=loss_fn, targets=targets)
    grad_bytes = sum(_nbytes(p.grad) for p in module.parameters() if p.grad is not None)
    grad_bytes += sum(_nbytes(g) for g in getattr(optimizer, "slice_grads", list)())  # ZeRO-2 slices
    if optimizer is not None:
        optimizer.step()   # ZeRO's reduce-scatter and all-gather run here
    return grad_bytes


def _comm_bytes(plan, records) -> dict:
    """{axis name: bytes this rank's collectives moved on it}, from the CommLog's records."""
    names = plan.mesh.axis_names
    comm = {a: 0.0 for a in names}
    for kind, axis, nbytes, _ in records:
        comm[names[axis]] += cm.bytes_moved(kind, nbytes, plan.mesh.axis_sizes[axis])
    return comm


def _rows(module: ParallelModule, optimizer, comm: dict, grad_bytes: int, activation_bytes: int,
          device: PipelineDevice | None, held_bytes: int = 0) -> list:
    """The report's rows: each prediction of the plan beside what was measured (on a pipeline device that
    plan.predicted does not describe, only its activations: the module docstring). `held_bytes`: weights a
    pipelined FSDP step held whole besides the shards."""
    pred = module.plan.predicted
    if device is not None and not device.is_described:
        return [AuditRow("activations saved for backward", device.activations, activation_bytes)]
    rows = [AuditRow(f"comm bytes on {a}", pred.comm_bytes[a], comm[a]) for a in module.plan.mesh.axis_names]
    rows.append(AuditRow("parameters", pred.memory.params,
                         sum(_nbytes(p) for p in module.parameters()) + sum(_nbytes(b) for b in module.buffers())
                         + held_bytes))
    rows.append(AuditRow("gradients", pred.memory.grads, grad_bytes))
    if optimizer is not None:
        state = sum(_nbytes(v) for s in optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        rows.append(AuditRow("optimizer state", pred.memory.optimizer, state))
    rows.append(AuditRow("activations saved for backward", pred.memory.activations, activation_bytes))
    return rows
