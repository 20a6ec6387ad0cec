"""Watching a ParallelModule train, from outside: the hook autopar.audit measures through.

Within `observing(pm, ...)`:
- every collective the module launches is logged to a fresh CommLog (kind, axis, whole-tensor bytes,
  phase), the one yielded; the module's own log, if any, is put back after;
- `on_saved(t)` sees each tensor autograd keeps for backward (an activation kept as its shard under
  sequence parallelism is seen as the shard; an FSDP weight, kept as a handle to gather again, is not);
- `on_checkpoint_inputs(inputs)` sees the tensors each checkpointed block holds for its recompute;
- `on_sent(t)`, on a pipelined module, sees each tensor this rank's stages hand to torch's schedule to send over
  the pipeline axis: what a stage's forward returns (but the last stage's: the model's outputs) and, in
  backward, the gradient of each input a stage received that requires one (but the first stage's: the model's
  inputs). Passes on meta tensors or without gradients are not seen; torch's shape inference at a schedule's
  first step runs each stage on real made-up tensors and is, so autopar.audit measures a later step;
- `on_held(t)`, on a pipelined module that keeps FSDP weights whole through the step (reshard_after_forward
  False, runtime/pipeline/held_weights.py), sees each whole weight a stage reads as the stage is called.
The saved-tensor hooks run even where the plan gathers nothing again, so every saved tensor is seen.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from .collectives import CommLog
from .lowering.recompute import CheckpointRegion


@contextmanager
def observing(pm, on_saved=None, on_checkpoint_inputs=None, on_sent=None, on_held=None):
    gathered, comm = pm.gathered, pm.comm
    regions = [m for m in pm.modules() if isinstance(m, CheckpointRegion)]
    kept_log, kept_needed = comm.log, gathered.needed
    comm.log = CommLog()
    gathered.observer, gathered.needed = on_saved, True
    for region in regions:
        region.observer = on_checkpoint_inputs
    handles = _watch_sends(pm, on_sent) if on_sent is not None else []
    handles += _watch_held(pm, on_held) if on_held is not None else []
    try:
        yield comm.log
    finally:
        comm.log, gathered.needed, gathered.observer = kept_log, kept_needed, None
        for region in regions:
            region.observer = None
        for h in handles:
            h.remove()


def _watch_sends(pm, on_sent) -> list:
    """Hooks on this rank's pipeline stages (pm.pipeline_stages; none unpipelined) that show `on_sent` what each
    stage sends; returns their handles (the gradient hooks on received tensors join the list as they are made)."""
    if pm.plan.pipeline is None:
        return []
    handles, last = [], pm.plan.pipeline.num_stages - 1

    def received(stage, args):
        for t in args:   # torch sends back the gradient of each received tensor that requires one
            if _real(t) and t.requires_grad:
                handles.append(t.register_hook(on_sent))

    def returned(stage, args, out):
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if _real(t):
                on_sent(t)

    for s, stage in pm.pipeline_stages:
        if s > 0:
            handles.append(stage.register_forward_pre_hook(received))
        if s < last:
            handles.append(stage.register_forward_hook(returned))
    return handles


def _watch_held(pm, on_held) -> list:
    """Hooks on this rank's pipeline stages that show `on_held` each weight a stage reads that the module does
    not hold (StageModule.parameters(): a held weight is the whole tensor the step gathered)."""
    own = {id(p) for p in pm.parameters()}

    def reading(stage, args):
        for t in stage.parameters():
            if id(t) not in own:
                on_held(t)

    return [stage.register_forward_pre_hook(reading) for _, stage in pm.pipeline_stages]


def _real(t) -> bool:
    """A tensor of a training step, not of torch's metadata passes."""
    return isinstance(t, torch.Tensor) and t.device.type != "meta" and torch.is_grad_enabled()
