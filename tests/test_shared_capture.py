"""The ranks of one threaded run share one capture (capture/shared.py): traced once, not once per rank, and
never shared where the graphs could differ; a process of a gloo run traces one model once however many
times it parallelizes it."""
import copy

import torch

import autopar
import autopar.capture.export as export
from autopar.capture.shared import shared_in_run
from autopar.testing import MLP, run_gloo, run_threaded


def _count_traces(monkeypatch) -> list:
    traced = []
    real = export._export

    def counting(model, *args):
        traced.append(type(model).__name__)
        return real(model, *args)
    monkeypatch.setattr(export, "_export", counting)
    return traced


class _Scaled(torch.nn.Module):
    """A plain tensor attribute (no buffer): a constant of the graph, whose value the capture keeps."""

    def __init__(self, scale: float):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = torch.tensor([scale])

    def forward(self, x):
        return self.lin(x) * self.scale


def _parallelize(rank, model, x):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy="ddp")
    return pm(*pm.plan.local_inputs(x)).detach()


def test_the_ranks_of_a_threaded_run_trace_the_model_once(monkeypatch):
    traced = _count_traces(monkeypatch)
    torch.manual_seed(0)
    model, x = MLP([4, 8, 4]), torch.randn(8, 4)
    outs = run_threaded(4, _parallelize, model, x)
    assert traced == ["MLP"]   # not four traces one after another
    torch.testing.assert_close(torch.cat(outs), model(x))
    run_threaded(4, _parallelize, model, x)
    assert traced == ["MLP", "MLP"]   # a new run traces again: nothing outlives a run


def _scaled(rank, x):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = _Scaled(1.0 + rank)   # the ranks' models differ in a constant's value only
    pm = autopar.parallelize(model, mesh, (x,), strategy="ddp")
    return pm(*pm.plan.local_inputs(x)).detach(), model(x[4 * rank: 4 * rank + 4]).detach()


def test_models_whose_constants_differ_do_not_share_a_capture(monkeypatch):
    traced = _count_traces(monkeypatch)
    x = torch.randn(8, 4)
    for got, want in run_threaded(2, _scaled, x):
        torch.testing.assert_close(got, want)   # each rank computes with its own model's constant
    assert traced == ["_Scaled", "_Scaled"]


def test_outside_a_threaded_run_nothing_is_shared():
    calls = []
    fn = shared_in_run(lambda *args: calls.append(args) or len(calls))
    model, x = MLP([4, 4]), torch.randn(2, 4)
    assert (fn(model, (x,), None), fn(model, (x,), None)) == (1, 2)


def _parallelize_twice(rank, model, x, scale):
    """One process of a gloo run: the same model under two strategies, then a model that differs in a
    constant's value; the traces counted in this process."""
    import autopar.capture.export as export_here
    from torch.distributed.device_mesh import init_device_mesh
    traced, real = [], export_here._export
    export_here._export = lambda m, *args: traced.append(type(m).__name__) or real(m, *args)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    outs = []
    for strategy in ("ddp", "fsdp"):
        pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy=strategy)
        outs.append(pm(*pm.plan.local_inputs(x)).detach())
    other = copy.deepcopy(model)
    other.scale = torch.tensor([scale])
    pm = autopar.parallelize(other, mesh, (x,), strategy="ddp")
    outs.append(pm(*pm.plan.local_inputs(x)).detach())
    return traced, outs


def test_a_process_of_a_gloo_run_traces_one_model_once():
    torch.manual_seed(0)
    model, x = _Scaled(1.0), torch.randn(8, 4)
    other = copy.deepcopy(model)
    other.scale = torch.tensor([3.0])
    results = run_gloo(2, _parallelize_twice, model, x, 3.0)
    for rank, (traced, outs) in enumerate(results):
        assert traced == ["_Scaled", "_Scaled"], traced   # the second strategy reuses the first capture
        shard = slice(4 * rank, 4 * rank + 4)
        for got, want in zip(outs, (model(x)[shard], model(x)[shard], other(x)[shard])):
            torch.testing.assert_close(got, want.detach())
