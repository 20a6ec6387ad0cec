"""Watching a ParallelModule train, from outside: the hook autopar.audit measures through.

Within `observing(pm, ...)`:
- every collective the module launches is logged to a fresh CommLog (kind, axis, whole-tensor bytes,
  phase), the one yielded; the module's own log, if any, is put back after;
- `on_saved(t)` sees each tensor autograd keeps for backward (an activation kept as its shard under
  sequence parallelism is seen as the shard; an FSDP weight, kept as a handle to gather again, is not);
- `on_checkpoint_inputs(inputs)` sees the tensors each checkpointed block holds for its recompute.
The saved-tensor hooks run even where the plan gathers nothing again, so every saved tensor is seen.
"""
from __future__ import annotations

from contextlib import contextmanager

from .collectives import CommLog
from .lowering.recompute import CheckpointRegion


@contextmanager
def observing(pm, on_saved=None, on_checkpoint_inputs=None):
    gathered, comm = pm.gathered, pm.comm
    regions = [m for m in pm.modules() if isinstance(m, CheckpointRegion)]
    kept_log, kept_needed = comm.log, gathered.needed
    comm.log = CommLog()
    gathered.observer, gathered.needed = on_saved, True
    for region in regions:
        region.observer = on_checkpoint_inputs
    try:
        yield comm.log
    finally:
        comm.log, gathered.needed, gathered.observer = kept_log, kept_needed, None
        for region in regions:
            region.observer = None
