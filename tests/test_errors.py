"""Bad input gets a specific AutoparError naming what is wrong (or a warning, for an op without a rule)."""
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.testing import GPT, MLP, GPTConfig


def test_memory_limit_no_plan_meets_says_the_smallest():
    torch.manual_seed(0)
    model, x = MLP([8, 16, 8]), torch.randn(4, 8)
    with pytest.raises(autopar.InfeasiblePlanError) as info:
        autopar.plan(model, (x,), {"a": 2}, memory_limit="1KiB")
    least = info.value.min_memory_bytes
    assert least > 1024
    assert "smallest any such plan needs" in str(info.value)
    # the bound is tight: a limit at it is met, and the plan's prediction fits under it
    plan = autopar.plan(model, (x,), {"a": 2}, memory_limit=int(least) + 1)
    assert plan.predicted.memory.total <= least + 1


def test_batch_the_mesh_axis_does_not_divide():
    with pytest.raises(autopar.ShardingError, match=r"input 'x' has batch size 3.*a=2"):
        autopar.plan(MLP([8, 16, 8]), (torch.randn(3, 8),), {"a": 2}, strategy="ddp")


def test_tensor_parallel_degree_that_divides_no_dim_of_a_weight():
    with pytest.raises(autopar.ShardingError, match=r"layers.0.weight.*\(6, 6\).*'tp' of size 4"):
        autopar.plan(MLP([6, 6, 6]), (torch.randn(4, 6),), {"tp": 4}, strategy="tp")


def test_op_without_rule_is_replicated_with_a_warning_naming_op_and_module():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(8, 8)

        def forward(self, x):
            return torch.special.erfcx(self.inner(x))

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.odd = Odd()

        def forward(self, x):
            return self.odd(x)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(Outer(), (torch.randn(4, 8),), {"a": 2}, strategy="ddp")
    msgs = [str(w.message) for w in caught if issubclass(w.category, autopar.UnsupportedOpWarning)]
    assert len(msgs) == 1
    assert "aten.special_erfcx.default" in msgs[0] and "odd" in msgs[0]
    erfcx = [n for n in plan.node_strategies if "erfcx" in n]
    assert erfcx and all(p == "R" for p in plan.node_strategies[erfcx[0]].output)


def test_model_torch_export_rejects_names_cause_and_place():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            y = self.proj(x)
            if y.sum() > 0:
                return y
            return -y

    with pytest.raises(autopar.CaptureError) as info:
        autopar.plan(DataDependent(), (torch.randn(4, 8),), {"a": 2})
    msg = str(info.value)
    assert "DataDependent" in msg
    assert "data-dependent" in msg
    assert "if y.sum() > 0" in msg and "test_errors.py" in msg


@pytest.mark.parametrize("mesh, match", [
    ({}, "no axes"),
    ({"a": 0}, "sizes must be positive"),
    ([2, 2], "DeviceMesh or a mapping"),
])
def test_bad_mesh(mesh, match):
    with pytest.raises(autopar.MeshError, match=match):
        autopar.plan(MLP([8, 8]), (torch.randn(4, 8),), mesh)


def test_unknown_strategy_hardware_and_memory_string():
    model, x = MLP([8, 8]), torch.randn(4, 8)
    with pytest.raises(autopar.AutoparError, match="unknown strategy 'zero9'"):
        autopar.plan(model, (x,), {"a": 2}, strategy="zero9")
    with pytest.raises(autopar.AutoparError, match="tpu9000"):
        autopar.plan(model, (x,), {"a": 2}, hardware="tpu9000")
    with pytest.raises(autopar.AutoparError, match="memory_limit"):
        autopar.plan(model, (x,), {"a": 2}, memory_limit="lots")
    with pytest.raises(autopar.AutoparError, match="fsdp\\+tp.*at least 2 axes"):
        autopar.plan(model, (x,), {"a": 2}, strategy="fsdp+tp")
    with pytest.raises(autopar.MeshError, match="'nope'"):
        import cost_models
        autopar.plan(model, (x,), {"a": 2}, links={"nope": cost_models.Link(1e9, 1e-6)})


def test_parallelize_needs_a_device_mesh():
    with pytest.raises(autopar.MeshError, match="DeviceMesh"):
        autopar.parallelize(MLP([8, 8]), {"a": 2}, (torch.randn(4, 8),))


def test_local_inputs_checks_count_and_divisibility():
    plan = autopar.plan(MLP([8, 8]), (torch.randn(4, 8),), {"a": 2}, strategy="ddp")
    with pytest.raises(autopar.PlanError, match="1 inputs, got 2"):
        plan.local_inputs(torch.randn(4, 8), torch.randn(4, 8))
    with pytest.raises(autopar.PlanError, match="does not divide"):
        plan.local_inputs(torch.randn(5, 8), rank=0)


def test_tp_degree_that_does_not_divide_the_vocab_is_named():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=62))
    with pytest.warns(autopar.DivisibilityWarning, match=r"does not divide the vocabulary \(62\).*'wte'"):
        autopar.plan(model, (torch.randint(0, 62, (4, 16)),), {"tp": 4}, strategy="tp")
