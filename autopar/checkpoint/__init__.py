"""autopar.checkpoint: one home for saving and loading.

    autopar.checkpoint.save(path, pm, opt, step=100)   # every rank: model, optimizer and step, one DCP checkpoint
    step = autopar.checkpoint.load(path, pm, opt)       # under any plan and world size, one whole tensor at a time
    autopar.checkpoint.load_hf(pm, path)                # a Hugging Face save_pretrained directory (safetensors)

run.py saves and loads a run; streaming.py is the DCP reader that holds one whole tensor at a time;
hugging_face.py reads safetensors. (Activation checkpointing -- recomputing layers in backward -- is
another thing: cost/checkpointing.py and runtime/lowering/recompute.py.)

The names of the earlier release, `autopar.load_checkpoint(pm, path)` and
`autopar.load_hf_checkpoint(pm, path)`, still work for this release and warn.
"""
from __future__ import annotations

import warnings

from . import streaming
from .hugging_face import load_hf
from .run import load, save

__all__ = ["save", "load", "load_hf"]


def load_checkpoint(pm, path, *, strict: bool = True):
    """Deprecated: `autopar.checkpoint.load(path, pm)`, which also loads an optimizer."""
    warnings.warn("autopar.load_checkpoint(pm, path) is deprecated and goes in the next release: use "
                  "autopar.checkpoint.load(path, pm) (which also takes the optimizer)", DeprecationWarning, stacklevel=2)
    return streaming.load_model(pm, path, strict=strict)


def load_hf_checkpoint(pm, path, *, key_map=None, strict: bool = True):
    """Deprecated: `autopar.checkpoint.load_hf(pm, path)`."""
    warnings.warn("autopar.load_hf_checkpoint is deprecated and goes in the next release: use "
                  "autopar.checkpoint.load_hf(pm, path)", DeprecationWarning, stacklevel=2)
    return load_hf(pm, path, key_map=key_map, strict=strict)
