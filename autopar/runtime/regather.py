"""FSDP re-gather in backward: weights gathered in forward are not kept alive for backward.

Autograd would save a gathered weight (a linear keeps its weight to compute
the input's gradient) until backward, losing what FSDP saves. The pack hook
saves the local shard and the module that gathered it instead, and the
unpack hook gathers again (ARCHITECTURE.md section 5).
"""
from __future__ import annotations

import weakref

import torch


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


class GatheredParams:
    """FSDP: weights gathered in forward are not kept for backward.

    Autograd would save the gathered weight (e.g. for a linear's input
    gradient) and keep it alive until backward. The pack hook instead saves
    the local shard and the steps, and the unpack hook gathers again.
    """

    def __init__(self):
        self._entries = {}
        self.groups: list = []   # the LayerGroups of this graph (layer_groups.py): they hold gathered weights too

    def register(self, full: torch.Tensor, local: torch.Tensor, module):   # a rewrite.RedistributeModule
        full = _root(full)
        self._entries[id(full)] = (weakref.ref(full), local, module)

    def clear(self):
        self._entries.clear()
        for g in self.groups:
            g.forget()

    def pack(self, t: torch.Tensor):
        base = _root(t)
        entry = self._entries.get(id(base))
        if entry is not None and entry[0]() is base:
            entry[2].saved()
            return ("regather", entry[1], entry[2], t.size(), t.stride(), t.storage_offset())
        return t

    def unpack(self, packed):
        if isinstance(packed, tuple) and packed and packed[0] == "regather":
            _, local, module, size, stride, offset = packed
            full = module.gather_again(local)
            return full.as_strided(size, stride, offset)
        return packed
