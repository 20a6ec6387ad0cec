"""Precision policy and optimizer: the bytes per parameter the plan charges."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cost.precision import param_bytes, precision_of, optimizer_spec
from autopar.testing import MLP, GPT, GPTConfig


def _model():
    torch.manual_seed(0)
    return MLP([16, 32, 16]), torch.randn(8, 16)


def _per_param(plan, model):
    m = plan.predicted.memory
    return (m.params + m.master + m.grads + m.optimizer) / sum(p.numel() for p in model.parameters())


def test_fp32_adam_and_bf16_mixed_both_cost_16_bytes():
    model, x = _model()
    fp32 = autopar.plan(model, (x,), {"dp": 2}, strategy="ddp")
    assert _per_param(fp32, model) == 16          # 4 weight + 4 grad + 2 x 4 AdamW moments
    mixed = autopar.plan(model, (x,), {"dp": 2}, strategy="ddp", precision=autopar.BF16_MIXED)
    # the weight is kept once, as the fp32 master, and cast to bf16 where it is used (as FSDP2 does)
    assert _per_param(mixed, model) == 16         # 4 fp32 master + 4 grad + 8 moments
    n = sum(p.numel() for p in model.parameters())
    assert (mixed.predicted.memory.params, mixed.predicted.memory.master) == (4 * n, 0)
    # what bf16 halves: the activations autograd keeps
    assert mixed.predicted.memory.activations * 2 == fp32.predicted.memory.activations


@pytest.mark.parametrize("optimizer, expect", [("sgd", 8), ("sgd-momentum", 12), ("adam", 16), ("adamw", 16)])
def test_optimizer_sets_state_bytes(optimizer, expect):
    model, x = _model()
    plan = autopar.plan(model, (x,), {"dp": 2}, strategy="ddp", optimizer=optimizer)
    assert _per_param(plan, model) == expect
    assert plan.optimizer["name"] == optimizer


def test_optimizer_instances_are_read():
    model, _ = _model()
    assert optimizer_spec(torch.optim.SGD(model.parameters(), lr=0.1)).states_per_param == 0
    assert optimizer_spec(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)).states_per_param == 1
    assert optimizer_spec(torch.optim.AdamW(model.parameters(), amsgrad=True)).states_per_param == 3
    assert optimizer_spec(torch.optim.Adam).states_per_param == 2
    with pytest.raises(autopar.AutoparError, match="OptimizerSpec"):
        optimizer_spec(torch.optim.Adagrad(model.parameters()))


def test_bytes_per_element_follow_each_dtype():
    pb = param_bytes(autopar.Precision(compute="bf16", master="fp32", grad_accum="fp32", reduce="bf16",
                                       optimizer_state="bf16"), optimizer_spec("adamw"), torch.float32)
    assert (pb.weight, pb.master, pb.grad, pb.reduce, pb.optimizer, pb.cast) == (4, 0, 4, 2, 4, True)
    plain = param_bytes(precision_of(None), optimizer_spec("adamw"), torch.bfloat16)
    assert (plain.weight, plain.master, plain.grad, plain.optimizer, plain.total) == (2, 0, 2, 4, 8)


def test_communication_follows_compute_and_reduce_dtypes():
    """FSDP gathers weights in the compute dtype and reduce-scatters gradients in the reduce dtype."""
    model, x = _model()
    fp32 = autopar.plan(model, (x,), {"dp": 2}, strategy="fsdp")
    mixed = autopar.plan(model, (x,), {"dp": 2}, strategy="fsdp", precision=autopar.BF16_MIXED)
    low_reduce = autopar.plan(model, (x,), {"dp": 2}, strategy="fsdp",
                              precision=autopar.Precision(compute="bf16", master="fp32", reduce="bf16"))

    def by_kind(plan):
        return plan.predicted.comm_bytes_by_kind
    assert by_kind(mixed)["all_gather"] == by_kind(fp32)["all_gather"] / 2
    assert by_kind(mixed)["reduce_scatter"] == by_kind(fp32)["reduce_scatter"]
    assert by_kind(low_reduce)["reduce_scatter"] == by_kind(fp32)["reduce_scatter"] / 2


def test_bf16_compute_halves_activations_and_uses_the_bf16_peak():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=16)
    model, x = GPT(cfg), torch.randint(0, 64, (4, 16))
    fp32 = autopar.plan(model, (x,), {"dp": 2}, strategy="ddp")
    mixed = autopar.plan(model, (x,), {"dp": 2}, strategy="ddp", precision="bf16-mixed")
    assert mixed.predicted.memory.activations < 0.6 * fp32.predicted.memory.activations
    assert mixed.predicted.compute_time < fp32.predicted.compute_time   # h100: 989 vs 494.5 TFLOP/s


def test_precision_round_trips_through_json():
    model, x = _model()
    plan = autopar.plan(model, (x,), {"dp": 2}, strategy="fsdp", precision=autopar.BF16_MIXED)
    back = autopar.Plan.from_json(plan.to_json())
    assert back.precision == plan.precision == autopar.BF16_MIXED.to_dict()
    assert back.param_placements == plan.param_placements and back.optimizer == plan.optimizer
    assert back.predicted.memory == plan.predicted.memory


def test_bad_precision_and_optimizer_are_named():
    model, x = _model()
    with pytest.raises(autopar.AutoparError, match="unknown dtype"):
        autopar.plan(model, (x,), {"dp": 2}, precision=autopar.Precision(compute="bf17"))
    with pytest.raises(autopar.AutoparError, match="precision="):
        autopar.plan(model, (x,), {"dp": 2}, precision=3)
    with pytest.raises(autopar.AutoparError, match="unknown name"):
        autopar.plan(model, (x,), {"dp": 2}, optimizer="lion")


def _parallelize_with(rank, model, x, precision):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    try:   # a copy per rank: the capture swaps the weights for compute-dtype stand-ins while it traces
        autopar.parallelize(copy.deepcopy(model), mesh, (x,), strategy="ddp", precision=precision)
    except autopar.PlanError as e:
        return str(e)
    return None


def test_runtime_refuses_a_policy_it_would_not_follow():
    """A torch optimizer keeps gradients and state in its parameter's dtype: a plan priced with bf16
    gradients beside fp32 masters would not run as priced, so parallelize says so."""
    from autopar.testing import run_threaded
    model, x = _model()
    policy = autopar.Precision(compute="bf16", master="fp32", grad_accum="bf16")
    for message in run_threaded(2, _parallelize_with, model, x, policy):
        assert message is not None and "grad_accum=torch.bfloat16 differs from the master dtype" in message


def test_runtime_refuses_a_reduce_dtype_no_weight_cast_carries():
    """The gradient is cast for its reduction where the weight is cast for its use: with compute and master
    both float32 nothing is cast, and a bf16 reduce priced as such would run in float32."""
    from autopar.testing import run_threaded
    model, x = _model()
    policy = autopar.Precision(reduce="bf16")
    for message in run_threaded(2, _parallelize_with, model, x, policy):
        assert message is not None and "reduce=torch.bfloat16 with compute and master both torch.float32" in message
