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


class _Scaled(torch.nn.Module):
    """A Linear times a plain tensor attribute (not a buffer): torch.export lifts it as a constant."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = torch.tensor([0.1, 2.0, 3.0, 4.0])

    def forward(self, x):
        return self.lin(x) * self.scale


def _move_and_run(rank, model, x):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy="ddp")
    (local_x,) = pm.plan.local_inputs(x)
    saved = pm.state_dict(full=True)
    out = {}
    pm.to("meta")
    out["meta"] = pm(local_x.to("meta"))
    # back from meta: the weights are reloaded; the constant, no state of the model's, keeps its values
    pm.to_empty(device="cpu")
    pm.load_state_dict(saved)
    out["back"] = pm(local_x).detach()
    pm.to(torch.float64)
    out["float64"] = pm(local_x.double()).detach()
    return out


def test_lifted_constants_move_with_the_module():
    torch.manual_seed(0)
    model, x = _Scaled(), torch.randn(4, 4)
    ep = torch.export.export(model, (x,))
    assert [s.kind.name for s in ep.graph_signature.input_specs if s.target == "scale"] == ["CONSTANT_TENSOR"]
    want = model(x).detach()
    # torch's Module.to leaves a plain tensor attribute's dtype as it is: the module computes as model.double() does
    want64 = copy.deepcopy(model).double()(x.double()).detach()
    for rank, out in enumerate(run_threaded(2, _move_and_run, model, x)):
        assert out["meta"].is_meta and out["meta"].shape == (2, 4)
        # (a batch of 2 rows multiplies in another order than one of 4: float32 rounding apart)
        torch.testing.assert_close(out["back"], want.chunk(2)[rank], atol=1e-6, rtol=0)
        assert out["float64"].dtype == torch.float64
        torch.testing.assert_close(out["float64"], want64.chunk(2)[rank], atol=1e-12, rtol=0)


def _meta_built_run(rank):
    from torch.distributed.device_mesh import init_device_mesh
    with torch.device("meta"):
        model = _Scaled()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(model, mesh, (torch.randn(4, 4, device="meta"),), strategy="ddp")
    pm.to_empty(device="cpu")
    pm.init_weights()
    try:
        pm(torch.randn(2, 4))
    except autopar.PlanError as e:
        return str(e)
    return None


def test_a_meta_built_models_constant_is_refused_in_words():
    """A constant made on the meta device has no values: the module says so, naming it, rather than fail in
    torch ("Tensor on device cpu is not on the expected device meta")."""
    for message in run_threaded(2, _meta_built_run):
        assert message is not None and "'scale'" in message and "register_buffer" in message
