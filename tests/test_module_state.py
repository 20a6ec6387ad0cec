"""A ParallelModule's state as a child: a parent module's state_dict and load_state_dict (and
torch.compile's OptimizedModule, which holds it as `_orig_mod`) see every entry under the right key."""
from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

import autopar
from autopar.testing import GPT, GPTConfig, run_threaded


class _Parent(torch.nn.Module):
    def __init__(self, pm):
        super().__init__()
        self.head = torch.nn.Linear(2, 2)
        self.pm = pm


def _whole(state: dict) -> dict:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in state.items()}


def _state_through_parents(rank, model, idx):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (idx,), strategy="fsdp")
    parent, compiled = _Parent(pm), torch.compile(pm)
    saved = {"parent": _whole(parent.state_dict()), "compiled": _whole(compiled.state_dict())}
    # loaded through each wrapper, under its keys: the module then holds what was loaded
    scaled = {k: v * 1.5 for k, v in pm.state_dict(full=True).items()}
    parent.load_state_dict({**{f"pm.{k}": v for k, v in scaled.items()}, **parent.head.state_dict(prefix="head.")})
    saved["loaded by parent"] = _whole(pm.state_dict())
    compiled.load_state_dict({f"_orig_mod.{k}": v * 2 for k, v in scaled.items()})
    saved["loaded by compiled"] = _whole(pm.state_dict())
    try:
        parent.load_state_dict({f"pm.{k}": v for k, v in scaled.items()})   # head.* missing, strict
    except RuntimeError as e:
        saved["strict"] = str(e)
    return saved


def test_parent_and_compiled_module_list_and_load_every_entry_under_its_key():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1))
    idx = torch.randint(0, 64, (4, 16))
    expected = {k: v.detach() for k, v in model.state_dict().items()}
    for r in run_threaded(2, _state_through_parents, model, idx):
        parent = r["parent"]
        assert set(parent) == {f"pm.{k}" for k in expected} | {"head.weight", "head.bias"}
        assert set(r["compiled"]) == {f"_orig_mod.{k}" for k in expected}
        for k, v in expected.items():
            torch.testing.assert_close(parent[f"pm.{k}"], v, atol=0, rtol=0)
            torch.testing.assert_close(r["compiled"][f"_orig_mod.{k}"], v, atol=0, rtol=0)
            torch.testing.assert_close(r["loaded by parent"][k], v * 1.5, atol=0, rtol=0)
            torch.testing.assert_close(r["loaded by compiled"][k], v * 3.0, atol=0, rtol=0)
        assert "Missing key(s)" in r.get("strict", "") and "head.weight" in r["strict"]
        assert "pm." not in r["strict"], r["strict"]   # nothing of the module's own reported missing
