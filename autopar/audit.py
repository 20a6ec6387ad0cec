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
  autopar.ShardedOptimizer, its ZeRO-2 gradient slices too).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import cost_models as cm

from .runtime.collectives import CommLog
from .runtime.recompute import CheckpointRegion
from .runtime.module import ParallelModule


@dataclass(frozen=True)
class AuditRow:
    quantity: str
    predicted: float
    measured: float

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
            lines.append(f"{r.quantity:<34} {cm.format_bytes(r.predicted):>14} {cm.format_bytes(r.measured):>14} "
                         f"{r.ratio:>14.3f}")
        return "\n".join(lines)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def audit(module: ParallelModule, *local_inputs, loss_fn=None, optimizer=None) -> AuditReport:
    """One forward + backward (+ optimizer step, if given) on this rank's inputs, measured.

    `loss_fn(output) -> scalar` defaults to the mean of the (first) output. With
    an optimizer, its state is measured after one step (AdamW allocates its
    moments lazily); gradients are zeroed first.
    """
    plan = module.plan
    names = plan.mesh.axis_names
    # parameters and buffers are counted in their own row, whichever view of them is saved
    weights = {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())}
    # plan.local_inputs cuts a rank's batch as a view of the global one; in a real run the
    # rank holds only its shard, so an input's storage counts as the shard's bytes
    shards = {t.untyped_storage().data_ptr(): _nbytes(t) for t in local_inputs if isinstance(t, torch.Tensor)}
    saved: dict = {}
    gathered = module._gathered
    inner_pack = gathered.pack

    def counting_pack(t):
        packed = inner_pack(t)
        regathered = packed is not t          # an FSDP weight: a handle is kept, not the tensor
        storage = t.untyped_storage()
        # saved tensors stay alive until backward, so no other storage can reuse this address
        if not regathered and storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = shards.get(storage.data_ptr(), storage.nbytes())
        return packed

    def counting_region_inputs(inputs):
        # a checkpointed block keeps no activations but holds the tensors it reads until backward
        for t in inputs:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in weights:
                    saved[storage.data_ptr()] = shards.get(storage.data_ptr(), storage.nbytes())

    regions = [m for m in module.modules() if isinstance(m, CheckpointRegion)]
    log = module.comm.log
    module.comm.log = CommLog()
    gathered.pack = counting_pack
    for region in regions:
        region.observer = counting_region_inputs
    try:
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
        records = list(module.comm.log.records)
    finally:
        gathered.pack = inner_pack
        module.comm.log = log
        for region in regions:
            region.observer = None

    comm = {a: 0.0 for a in names}
    for kind, axis, nbytes, _ in records:
        comm[names[axis]] += cm.bytes_moved(kind, nbytes, plan.mesh.axis_sizes[axis])
    pred = plan.predicted
    rows = [AuditRow(f"comm bytes on {a}", pred.comm_bytes[a], comm[a]) for a in names]
    rows.append(AuditRow("parameters", pred.memory.params,
                         sum(_nbytes(p) for p in module.parameters()) + sum(_nbytes(b) for b in module.buffers())))
    rows.append(AuditRow("gradients", pred.memory.grads, grad_bytes))
    if optimizer is not None:
        state = sum(_nbytes(v) for s in optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        rows.append(AuditRow("optimizer state", pred.memory.optimizer, state))
    rows.append(AuditRow("activations saved for backward", pred.memory.activations, sum(saved.values())))
    return AuditReport(tuple(rows))
