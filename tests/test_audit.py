"""autopar.audit: one measured step beside the plan's predictions."""
import copy

import pytest
import torch

import autopar
from autopar.testing import MLP, GPT, GPTConfig, run_threaded


def _audit(rank, model, x, mesh_shape, names, strategy):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy=strategy)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    report = autopar.audit(pm, *pm.plan.local_inputs(x), optimizer=opt)
    return report, str(report)


@pytest.mark.parametrize("strategy, mesh_shape", [("ddp", (2,)), ("fsdp", (2,)), ("tp", (2,)), ("fsdp+tp", (2, 2))])
def test_audit_comm_and_parameter_memory_equal_prediction(strategy, mesh_shape):
    torch.manual_seed(0)
    names = ("dp", "tp")[:len(mesh_shape)]
    for model, x in ((MLP([16, 32, 16]), torch.randn(8, 16)),
                     (GPT(GPTConfig(n_layer=1)), torch.randint(0, 64, (4, 16)))):
        world = 1
        for n in mesh_shape:
            world *= n
        for report, text in run_threaded(world, _audit, model, x, mesh_shape, names, strategy):
            for axis in names:
                row = report.row(f"comm bytes on {axis}")
                assert row.measured == pytest.approx(row.predicted, rel=1e-12)
            for quantity in ("parameters", "gradients", "optimizer state"):
                row = report.row(quantity)
                assert row.measured == row.predicted, (quantity, row)
            assert report.row("activations saved for backward").measured > 0
            assert "measured/pred" in text


def _timed_audit(rank, model, x, strategy, delay):
    import time
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy=strategy)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)

    def loss_fn(out):   # rank 0 comes late to every step's gradient reduction
        if rank == 0:
            time.sleep(delay)
        return out.float().mean()
    return autopar.audit(pm, *pm.plan.local_inputs(x), optimizer=opt, loss_fn=loss_fn, timed_steps=3)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_audit_times_the_step_and_the_waits_for_collectives(strategy):
    # the clock counts the time a rank is blocked in collectives: rank 1 waits for rank 0, which sleeps
    # `delay` before each backward, at the gradient reduction; rank 0 finds rank 1 there and hardly waits
    torch.manual_seed(0)
    delay = 0.2
    model, x = MLP([16, 32, 16]), torch.randn(8, 16)
    late, waiting = run_threaded(2, _timed_audit, model, x, strategy, delay)
    for report in (late, waiting):
        step, exposed = report.row("step time"), report.row("exposed comm time on dp")
        assert step.unit == exposed.unit == "seconds" and " ms" in str(report)
        assert step.predicted > 0 and step.measured >= delay   # every step waits for the late rank
        assert 0 <= exposed.measured <= step.measured
        assert 0 < exposed.predicted <= step.predicted
    assert waiting.row("exposed comm time on dp").measured >= 0.75 * delay
    assert late.row("exposed comm time on dp").measured < 0.5 * delay
