"""audit: run one training step and set the plan's predictions beside what the step did.

Measured, on this rank:
- bytes each collective moved (the runtime logs every call: kind, axis, tensor size),
- activation bytes autograd saved for backward (a saved-tensor hook; for a
  checkpointed block, the tensors its checkpoint holds), counted by
  storage: a saved view keeps its base's whole storage alive, and tensors that share
  a storage (an attention output and the reshaped view the next linear keeps) are one
  allocation, counted once. Parameters and buffers (the "parameters" row) and FSDP
  re-gathered weights are not activations,
- parameter, gradient and optimizer-state bytes actually allocated (gradients
  as backward leaves them, before the optimizer step; with an
  autopar.ShardedOptimizer, its ZeRO-2 gradient slices too),
- with `timed_steps`, the step's time (the median over that many more steps) and, per
  mesh axis, the time this rank spent blocked in collectives (calls and waits,
  runtime/collectives.Comm.clock): the exposed communication the plan predicts
  (`predicted.exposed_comm_time`; the rest should hide behind compute). On CPU
  (gloo) that is the time the step waited; on CUDA a collective's call returns
  once queued on its stream, so the figure is the host's waits only. The measured
  step includes the optimizer step (`predicted.optimizer_time`) and zero_grad.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import cost_models as cm

from .runtime.module import ParallelModule
from .runtime.observe import observing


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
class AuditReport:
    rows: tuple

    def row(self, quantity: str) -> AuditRow:
        return next(r for r in self.rows if r.quantity == quantity)

    def __str__(self) -> str:
        lines = [f"{'quantity':<34} {'predicted':>14} {'measured':>14} {'measured/pred':>14}"]
        for r in self.rows:
            show = cm.format_bytes if r.unit == "bytes" else (lambda s: f"{s * 1e3:.2f} ms")
            lines.append(f"{r.quantity:<34} {show(r.predicted):>14} {show(r.measured):>14} {r.ratio:>14.3f}")
        return "\n".join(lines)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def audit(module: ParallelModule, *local_inputs, loss_fn=None, optimizer=None, timed_steps: int = 0) -> AuditReport:
    """One forward + backward (+ optimizer step, if given) on this rank's inputs, measured.

    `loss_fn(output) -> scalar` defaults to the mean of the (first) output. With
    an optimizer, its state is measured after one step (AdamW allocates its
    moments lazily); gradients are zeroed first. `timed_steps` more steps are
    timed after that one (the first step allocates and warms up, so it is not
    timed); 0, the default, keeps audit to one step and leaves the time rows out.
    Call it on every rank: the steps run collectives.
    """
    with _measuring(module, local_inputs) as (saved, log):
        grad_bytes = _train_step(module, local_inputs, loss_fn, optimizer)
        records = list(log.records)
    rows = _rows(module, optimizer, _comm_bytes(module.plan, records), grad_bytes, saved.total())
    if timed_steps > 0:
        rows += _time_rows(module, _timed(module, local_inputs, loss_fn, optimizer, timed_steps))
    return AuditReport(tuple(rows))


def _timed(module: ParallelModule, local_inputs: tuple, loss_fn, optimizer, steps: int) -> tuple:
    """(step seconds, {axis: seconds blocked in collectives}), each the median over `steps` steps: the
    typical step, not one a hiccup of the machine slowed."""
    times, blocked = [], []
    try:
        for _ in range(steps):
            module.comm.clock = {}
            t0 = time.perf_counter()
            _train_step(module, local_inputs, loss_fn, optimizer)
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            blocked.append(module.comm.clock)
    finally:
        module.comm.clock = None
    axes = {a for b in blocked for a in b}
    return statistics.median(times), {a: statistics.median(b.get(a, 0.0) for b in blocked) for a in axes}


def _time_rows(module: ParallelModule, timed: tuple) -> list:
    step, blocked = timed
    pred, names = module.plan.predicted, module.plan.mesh.axis_names
    rows = [AuditRow("step time", pred.step_time, step, "seconds")]
    rows += [AuditRow(f"exposed comm time on {a}", pred.exposed_comm_time.get(a, pred.comm_time[a]),
                      blocked.get(i, 0.0), "seconds") for i, a in enumerate(names)]
    return rows


class _SavedActivations:
    """Bytes autograd keeps for backward, one entry per storage (see the module docstring)."""

    def __init__(self, module: ParallelModule, local_inputs: tuple):
        # parameters and buffers are counted in their own row, whichever view of them is saved
        self._weights = {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())}
        # plan.local_inputs cuts a rank's batch as a view of the global one; in a real run the
        # rank holds only its shard, so an input's storage counts as the shard's bytes
        self._shards = {t.untyped_storage().data_ptr(): _nbytes(t) for t in local_inputs
                        if isinstance(t, torch.Tensor)}
        self._bytes: dict = {}   # storage address -> bytes

    def saved(self, t: torch.Tensor) -> None:
        """A tensor backward keeps (runtime/observe.observing's on_saved)."""
        storage = t.untyped_storage()
        # saved tensors stay alive until backward, so no other storage can reuse this address
        if storage.data_ptr() not in self._weights:
            self._bytes[storage.data_ptr()] = self._shards.get(storage.data_ptr(), storage.nbytes())

    def region_inputs(self, inputs) -> None:
        """A checkpointed block keeps no activations but holds the tensors it reads."""
        for t in inputs:
            if isinstance(t, torch.Tensor):
                self.saved(t)

    def total(self) -> int:
        return sum(self._bytes.values())


@contextmanager
def _measuring(module: ParallelModule, local_inputs: tuple):
    """Within: saved tensors are counted and collectives logged to a fresh CommLog (runtime/observe.py).

    Yields (the _SavedActivations counting, the fresh CommLog).
    """
    saved = _SavedActivations(module, local_inputs)
    with observing(module, saved.saved, saved.region_inputs) as log:
        yield saved, log


def _train_step(module: ParallelModule, local_inputs: tuple, loss_fn, optimizer) -> int:
    """Forward, backward and (with an optimizer) a step; returns the gradient bytes backward left."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    out = module(*local_inputs)
    first = out[0] if isinstance(out, (tuple, list)) else out
    loss = loss_fn(out) if loss_fn is not None else first.float().mean()
    loss.backward()
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


def _rows(module: ParallelModule, optimizer, comm: dict, grad_bytes: int, activation_bytes: int) -> list:
    """The report's rows: each prediction of the plan beside what was measured."""
    pred = module.plan.predicted
    rows = [AuditRow(f"comm bytes on {a}", pred.comm_bytes[a], comm[a]) for a in module.plan.mesh.axis_names]
    rows.append(AuditRow("parameters", pred.memory.params,
                         sum(_nbytes(p) for p in module.parameters()) + sum(_nbytes(b) for b in module.buffers())))
    rows.append(AuditRow("gradients", pred.memory.grads, grad_bytes))
    if optimizer is not None:
        state = sum(_nbytes(v) for s in optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        rows.append(AuditRow("optimizer state", pred.memory.optimizer, state))
    rows.append(AuditRow("activations saved for backward", pred.memory.activations, activation_bytes))
    return rows
