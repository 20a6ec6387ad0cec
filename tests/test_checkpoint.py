"""state_dict is layout-independent: DTensors (or whole tensors) under the original names."""
import copy

import torch

import autopar
from autopar.testing import GPT, GPTConfig, run_threaded


def _save_and_reload(rank, model, idx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    fsdp = autopar.parallelize(copy.deepcopy(model), mesh, (idx,), strategy="fsdp")
    tp = autopar.parallelize(copy.deepcopy(model), mesh, (idx,), strategy="tp")
    with torch.no_grad():  # make the saved state differ from the initial one
        for p in fsdp.parameters():
            p.mul_(1.5)
    dtensors = fsdp.state_dict()
    assert all(isinstance(v, DTensor) for v in dtensors.values())
    whole = {k: v.full_tensor() for k, v in dtensors.items()}
    tp.load_state_dict(dtensors)           # FSDP layout -> TP layout
    return whole, tp.state_dict(full=True), fsdp.plan.param_placements, tp.plan.param_placements


def test_checkpoint_moves_between_layouts():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    idx = torch.randint(0, 64, (4, 16))
    results = run_threaded(4, _save_and_reload, model, idx)
    expected = {k: v.detach() * 1.5 for k, v in model.state_dict().items()}
    for whole, reloaded, fsdp_pl, tp_pl in results:
        assert fsdp_pl != tp_pl   # the two layouts really differ
        assert set(whole) == set(expected) == set(reloaded)
        for k in expected:
            torch.testing.assert_close(whole[k], expected[k], atol=0, rtol=0)
            torch.testing.assert_close(reloaded[k], expected[k], atol=0, rtol=0)
