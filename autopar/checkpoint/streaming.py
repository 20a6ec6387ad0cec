"""Reading a torch.distributed.checkpoint (DCP) directory into a ParallelModule's shards, one whole
tensor at a time at most (run.load reads through it; load_model is the model alone).

The standard round trip works as it is: `sd = pm.state_dict(); dcp.load(sd, checkpoint_id=path);
pm.load_state_dict(sd)`. `pm.state_dict()`'s DTensors view this rank's shards, so DCP writes the
slices into them. But a checkpoint that one device wrote stores every tensor whole, and DCP's
filesystem reader `torch.load`s each whole tensor, copies the slice this rank needs, and moves to
the next while its loop still holds the previous one: two whole tensors at once (measured by
benchmarks/peak_memory.py). `one_tensor_at_a_time_reader` hands the reader one read request at a time, so
the whole tensor it loaded is dropped before the next is read.
"""
from __future__ import annotations

import dataclasses
import functools
import os

from ..errors import PlanError
from ..runtime.state_dict import LoadResult


def one_tensor_at_a_time_reader(path):
    """A DCP FileSystemReader of directory `path` whose `read_data` serves one read request per call."""
    return _reader_class()(os.fspath(path))


@functools.cache
def _reader_class():
    # made at first use: importing torch.distributed.checkpoint (and the DTensor op tables it pulls in)
    # costs every process that imports autopar about a second, and most never checkpoint
    from torch.distributed.checkpoint import FileSystemReader

    class OneTensorAtATimeReader(FileSystemReader):
        def read_data(self, plan, planner):
            fut = None
            for item in plan.items:
                fut = super().read_data(dataclasses.replace(plan, items=[item]), planner)
                fut.wait()
            return fut if fut is not None else super().read_data(plan, planner)

    return OneTensorAtATimeReader


def load_model(pm, path, *, strict: bool = True) -> LoadResult:
    """Fill `pm`'s shards from the DCP checkpoint in directory `path`; call on every rank, after
    `pm.to_empty(device=...)`.

    The checkpoint may be a single device's `dcp.save(model.state_dict(), checkpoint_id=path)` or
    any autopar module's `pm.state_dict()`, in any layout: each rank reads the slices its shards
    hold, and holds at most one whole tensor of the checkpoint while it does. `strict`: as in
    `load_state_dict`, a tensor the checkpoint lacks raises (its shard would hold garbage).
    """
    import torch.distributed.checkpoint as dcp

    if pm.plan.pipeline is not None:
        raise PlanError("autopar.load_checkpoint fills the DTensors of pm.state_dict(), which a pipelined module does not "
                        "give; plan without a pipeline to load a checkpoint into shards")
    from torch.distributed.checkpoint import DefaultLoadPlanner

    sd = pm.state_dict()
    dcp.load(sd, storage_reader=one_tensor_at_a_time_reader(path),
             planner=DefaultLoadPlanner(allow_partial_load=not strict))
    return pm.load_state_dict(sd, strict=strict)
