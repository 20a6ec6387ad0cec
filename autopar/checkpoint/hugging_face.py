"""Filling a ParallelModule's shards from a Hugging Face `save_pretrained` checkpoint (safetensors).

A model too big for one device is built on the meta device, parallelized and
allocated shard by shard (`pm.to_empty(device=...)`); its shards then hold
garbage. `load_hf` fills them from the `*.safetensors` files that
`save_pretrained` wrote (one `model.safetensors`, or the shards that
`model.safetensors.index.json` lists), and no rank reads more than its shards
hold: torch.distributed.checkpoint plans, from the DTensors of
`pm.state_dict()`, which slice of which tensor each rank needs, and its
HuggingFaceStorageReader reads just that slice
(`safe_open(file).get_slice(name)[slices]`: safetensors copies only those
bytes out of the mapped file). Those DTensors view this rank's shards, so the
slices land in place and nothing whole is built.

Non-persistent buffers (Hugging Face's rotary `inv_freq`) are not in a
checkpoint; they are recomputed as the model's own initialization computes
them (`_recompute_buffers`).
"""
from __future__ import annotations

import glob
import os
import threading
import warnings

import torch

from ..errors import PlanError
from ..runtime.initialization import module_initializers, qualified_name, run_initializers
from ..runtime.state_dict import LoadResult

# Ranks run as threads of one process (autopar.testing.run_threaded) share one meta module tree: each
# makes a module real and puts it back on meta, so one at a time, or a rank finds another's module on meta
_tree_lock = threading.Lock()


def load_hf(pm, path, *, key_map=None, strict: bool = True) -> LoadResult:
    """Fill `pm`'s shards from the safetensors checkpoint in directory `path`; call on every rank.

    Call it after `pm.to_empty(device=...)`. It is collective (the ranks agree on who reads what),
    and each rank reads only the slices of the tensors its own shards hold. Values are converted
    to the shards' dtype (a bf16 checkpoint loads into fp32 shards).

    key_map: how a checkpoint name becomes one of `pm`'s names (those of the model given to
      parallelize). Default None, names unchanged: right for a Hugging Face model parallelized as
      it is. A dict renames the names it lists and keeps the others; a callable maps every name
      (None: skip it), e.g. `lambda k: "model." + k` for a wrapper holding the HF model as
      `self.model`.
    strict: True (the default, as in torch's load_state_dict) raises PlanError when the
      checkpoint lacks a tensor `pm` needs, since a shard left unloaded holds garbage; False
      loads the rest and returns the missing names, for you to fill (`pm.load_state_dict(...,
      strict=False)`).

    Tied weights (`lm_head.weight` is `model.embed_tokens.weight`, which HF stores once) load from
    whichever of their names the checkpoint has. Non-persistent buffers (rotary `inv_freq`) are
    not in a checkpoint: for a model built on meta they are recomputed by the model's own
    initialization (the nearest `_init_weights` of a module or its parents, as in Transformers 5,
    else the module's `reset_parameters`), with a warning naming any that none recomputes. A model
    built with real tensors keeps the values of the buffers the checkpoint lacks (persistent ones
    too: it no longer tells which are which).

    Returns LoadResult(missing_keys: `pm` names nothing loaded, unexpected_keys: checkpoint names
    that match nothing in `pm` and were not read). A shape that differs raises PlanError.
    """
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    _check_ready(pm, path)
    reader = dcp.HuggingFaceStorageReader(path)
    stored = reader.read_metadata().state_dict_metadata       # checkpoint name -> whole size, dtype
    by_name = {}                                               # pm name -> checkpoint name
    for key in stored:
        name = _renamed(key, key_map)
        if name is not None:
            by_name[name] = key
    sd = pm.state_dict()
    optional = _buffers_the_checkpoint_may_lack(pm)
    to_read, missing, used, loaded = _match(sd, by_name, stored, optional)
    if missing and strict:
        shown = missing if len(missing) <= 6 else missing[:5] + [f"... {len(missing) - 5} more"]
        raise PlanError(f"the checkpoint in {path} has no tensor for {shown} (names of the parallel module"
                        f"{' after key_map' if key_map is not None else ''}); it has e.g. {sorted(stored)[:3]}. "
                        "If the names differ by a prefix (a wrapper around the HF model), pass "
                        "key_map=lambda k: 'prefix.' + k; if the checkpoint really lacks them, pass strict=False "
                        "and fill them with pm.load_state_dict({...}, strict=False)")
    if to_read:
        dcp.load(to_read, storage_reader=reader)
    if pm.meta_model is not None:
        _recompute_buffers(pm, (optional & {n for n, _ in pm.store.named_buffers()}) - loaded)
    return LoadResult(missing, sorted(set(stored) - used))


def _check_ready(pm, path: str) -> None:
    if not os.path.isdir(path):
        raise PlanError(f"autopar.checkpoint.load_hf takes the directory save_pretrained wrote, got {path!r}")
    if not glob.glob(os.path.join(glob.escape(path), "*.safetensors")):
        raise PlanError(f"no *.safetensors file in {path}: save with model.save_pretrained(path) (safetensors "
                        "is its default), or convert a pytorch_model.bin checkpoint first")
    if pm.plan.pipeline is not None:
        raise PlanError("autopar.checkpoint.load_hf loads into pm.state_dict()'s DTensors, which a pipelined module "
                        "cannot give; load the stages' whole tensors with pm.load_state_dict instead")
    if any(t.is_meta for t in [*pm.parameters(), *pm.buffers()]):
        raise PlanError("the parallel module's shards are still on the meta device: call "
                        "pm.to_empty(device=...) before autopar.checkpoint.load_hf")


def _match(sd: dict, by_name: dict, stored: dict, optional: set) -> tuple:
    """Pair `sd`'s tensors with checkpoint names: ({checkpoint name: DTensor to fill}, names missing
    (`optional` ones aside), checkpoint names used, `sd` names filled). A tied weight is read once."""
    to_read, missing, used, loaded = {}, [], set(), set()
    for names in _tied_groups(sd):
        found = [n for n in names if n in by_name]
        if not found:
            if not set(names) <= optional:
                missing.extend(names)
            continue
        key, name = by_name[found[0]], found[0]
        if tuple(stored[key].size) != tuple(sd[name].shape):
            raise PlanError(f"checkpoint tensor {key!r} has shape {tuple(stored[key].size)}, but {name!r} of the "
                            f"parallel module has shape {tuple(sd[name].shape)}: the checkpoint is of another "
                            "configuration (or key_map pairs the wrong names)")
        to_read[key] = sd[name]       # DCP matches state_dict keys with the checkpoint's names
        used.update(by_name[n] for n in found)
        loaded.update(names)
    return to_read, missing, used, loaded


def _renamed(key: str, key_map):
    if key_map is None:
        return key
    if callable(key_map):
        return key_map(key)
    return key_map.get(key, key)


def _tied_groups(sd: dict) -> list:
    """The names of each tensor of `sd`: state_dict lists a tied weight under each name, as one object."""
    groups = {}
    for name, t in sd.items():
        groups.setdefault(id(t), []).append(name)
    return list(groups.values())


def _buffers_the_checkpoint_may_lack(pm) -> set:
    """Non-persistent buffers: those of the module tree its state_dict leaves out. A model built with
    real tensors is no longer at hand, but its buffers hold their values already: all may be absent."""
    if pm.meta_model is None:
        return {n for n, _ in pm.store.named_buffers()}
    tree = pm.meta_model
    return {n for n, _ in tree.named_buffers(remove_duplicate=False)} - set(tree.state_dict(keep_vars=True))


def _recompute_buffers(pm, names: set) -> None:
    """Recompute the buffers `names` of a meta-built `pm` one module at a time, as its initialization does.

    The module is made real (its own tensors only), its buffers set to a sentinel (NaN, or the largest
    integer; runtime/initialization.run_initializers) so that an initializer that does not set them shows,
    initialized, and the buffers copied whole (every rank keeps buffers whole) before the module goes back
    to meta.
    """
    own_buffers = dict(pm.store.named_buffers())
    tree = pm.meta_model
    not_set = []
    # fork_rng: an initializer also redraws the module's parameters (thrown away), which must not move the
    # caller's random state
    with _tree_lock, torch.random.fork_rng(devices=[]), torch.no_grad():
        for prefix, module in tree.named_modules():
            own = {n: qualified_name(prefix, n) for n, _ in module.named_buffers(recurse=False) if qualified_name(prefix, n) in names}
            if not own:
                continue
            module.to_empty(device=own_buffers[next(iter(own.values()))].device, recurse=False)
            try:
                inits = module_initializers(tree, prefix)   # init_weights' policy, run as init_weights runs it
                unset = run_initializers(module, own, inits)
                for n, fqn in own.items():
                    if not inits or n in unset:
                        not_set.append(fqn)
                    else:
                        own_buffers[fqn].copy_(getattr(module, n))
            finally:
                module.to_empty(device="meta", recurse=False)
    if not_set:
        warnings.warn(f"autopar.checkpoint.load_hf: non-persistent buffer(s) {not_set} are not in the checkpoint and no "
                      "initializer of the model recomputes them (no _init_weights of the module or its parents "
                      "sets them, no reset_parameters): they hold garbage; set them with "
                      "pm.load_state_dict({name: value}, strict=False)", stacklevel=3)
