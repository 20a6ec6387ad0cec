"""Gather again in backward: a tensor all-gathered in forward is not kept whole for backward.

Autograd would keep what an op saves -- a weight gathered whole (FSDP: a linear
keeps its weight for its input's gradient), or an activation gathered whole
(sequence parallelism: a column-parallel linear keeps the norm output it reads)
-- alive until backward, losing what the split saves. The pack hook keeps the
local shard and the module that gathered it instead, and the unpack hook
gathers again (ARCHITECTURE.md section 5).

An activation is gathered again once however many tensors autograd kept of it
(the query, key and value projections all keep the one norm output): the first
unpack gathers, and the result lives until the last of them has been unpacked.
A weight is gathered again for each op that kept it (the layer groups decide
when that is; layer_groups.py).
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from ..._compat import view_base


def _root(t: torch.Tensor) -> torch.Tensor:
    base = view_base(t)
    return base if base is not None else t


class GatheredParams:
    """The saved-tensor hooks of one graph: weights (FSDP) and activations (sequence parallelism)
    gathered in forward are kept as their shards, and gathered again when backward unpacks them."""

    def __init__(self):
        self._entries = {}
        self.groups: list = []   # the LayerGroups of this graph (layer_groups.py): they hold gathered weights too
        # whether any layout change of the graph gathers again (rewrite sets it): without one, forward runs
        # without the hooks, whose Python call per saved tensor costs a data-parallel step ~1%
        self.needed = True
        # observer(t), if set, sees each tensor backward keeps: an activation kept as its shard is seen as the
        # shard; an FSDP weight, kept as a handle to gather again, is not seen (runtime/observe.py)
        self.observer = None

    def hooks(self):
        """The saved-tensor hooks forward runs under, or a context that does nothing when none is needed."""
        if not self.needed:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def register(self, full: torch.Tensor, local: torch.Tensor, module):   # a rewrite.RedistributeModule
        full = _root(full)
        slot = _Regathered() if module.activation else None
        self._entries[id(full)] = (weakref.ref(full), local, module, slot)

    def clear(self):
        self._entries.clear()
        for g in self.groups:
            g.forget()

    def pack(self, t: torch.Tensor):
        base = _root(t)
        entry = self._entries.get(id(base))
        if entry is not None and entry[0]() is base:
            module, slot = entry[2], entry[3]
            module.saved()
            if slot is not None:
                slot.pending += 1
            if self.observer is not None and module.activation:
                self.observer(entry[1])
            return ("regather", entry[1], module, t.size(), t.stride(), t.storage_offset(), slot)
        if self.observer is not None:
            self.observer(t)
        return t

    def unpack(self, packed):
        if isinstance(packed, tuple) and packed and packed[0] == "regather":
            _, local, module, size, stride, offset, slot = packed
            if slot is None:
                full = module.gather_again(local)
            else:   # an activation: gathered by the first unpack, held until the last
                if slot.full is None:
                    slot.full = module.gather_again(local)
                full = slot.full
                slot.pending -= 1
                if slot.pending <= 0:
                    slot.full = None
            return full.as_strided(size, stride, offset)
        return packed


class _Regathered:
    """An activation's saved copies still to unpack, and its re-gathered value while some are."""

    def __init__(self):
        self.pending = 0
        self.full: torch.Tensor | None = None
