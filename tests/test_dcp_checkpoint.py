"""autopar.checkpoint.load of a model alone (a single device's dcp.save(model.state_dict())): the DCP round trip
in one call, reading one whole tensor at a time at most; the deprecated autopar.load_checkpoint still works."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.testing import GPT, GPTConfig, run_threaded

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


@pytest.mark.filterwarnings("ignore::UserWarning")   # dcp.save without a process group says it assumes one
def test_load_checkpoint_fills_uneven_shards_of_a_meta_built_model(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = GPT(CFG)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    calls = []   # requests per call of DCP's own reader, under ours
    base_read = dcp.FileSystemReader.read_data

    def counting(self, plan, planner):   # the base reader, called by ours: one request per call
        calls.append(len(plan.items))
        return base_read(self, plan, planner)
    monkeypatch.setattr(dcp.FileSystemReader, "read_data", counting)
    x = torch.randint(0, CFG.vocab_size, (6, CFG.block_size))

    def run(rank):
        with torch.device("meta"):
            meta = GPT(CFG)
        pm = autopar.parallelize(meta, init_device_mesh("cpu", (3,), mesh_dim_names=("dp",)), (x,),
                                 strategy="fsdp", hardware="cpu")
        pm.to_empty(device="cpu")
        step = autopar.checkpoint.load(tmp_path, pm)
        return step, pm.state_dict(full=True)

    for step, full in run_threaded(3, run):
        assert step is None   # a model's state_dict alone: no step saved
        for name, want in model.state_dict().items():
            torch.testing.assert_close(full[name], want, atol=0, rtol=0, msg=name)
    assert calls and set(calls) == {1}   # one whole tensor read, sliced and dropped, before the next


def test_the_old_names_still_load_and_warn_and_an_optimizer_needs_its_state(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    x = torch.randint(0, CFG.vocab_size, (6, CFG.block_size))

    def run(rank):
        with torch.device("meta"):
            meta = GPT(CFG)
        pm = autopar.parallelize(meta, init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)), (x,),
                                 strategy="fsdp", hardware="cpu")
        pm.to_empty(device="cpu")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = autopar.load_checkpoint(pm, tmp_path)
        opt = autopar.ShardedOptimizer(pm, torch.optim.SGD, lr=0.1)
        with pytest.raises(autopar.PlanError, match="holds a model's state_dict alone .* no optimizer state"):
            autopar.checkpoint.load(tmp_path, pm, opt)
        with pytest.raises(autopar.PlanError, match="no DCP checkpoint there"):
            autopar.checkpoint.load(tmp_path / "nowhere", pm)
        return caught, result, pm.state_dict(full=True)

    ((caught, result, full),) = run_threaded(1, run)
    assert [w.category for w in caught] == [DeprecationWarning]
    assert "autopar.checkpoint.load(path, pm)" in str(caught[0].message)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for name, want in model.state_dict().items():
        torch.testing.assert_close(full[name], want, atol=0, rtol=0, msg=name)
