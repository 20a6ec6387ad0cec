"""init_weights and load_hf's recompute of non-persistent buffers initialize a module alike: with the
nearest `_init_weights` of the module or a parent (runtime/initialization.py: module_initializers).

The model wraps a sub-model with an `_init_weights` of its own, as a LlamaForCausalLM wraps a LlamaModel
that is itself a PreTrainedModel: Transformers initializes that sub-model with its own, and so must both.
Had one of them taken the root's, the sub-model's weights or its rotary-like buffer would differ from the
single-device model's.
"""
from __future__ import annotations

import torch
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.testing import run_threaded

EXAMPLE = torch.empty(4, 8, device="meta")   # a meta-built model captures on meta inputs


# Both initializations are deterministic (no random draws): ranks run as threads share one generator
def _ramp(t: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.linspace(-scale, scale, t.numel()).view_as(t)


class _Rotary(torch.nn.Module):
    """A non-persistent buffer that no checkpoint holds and only an `_init_weights` computes."""

    def __init__(self, n):
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(n), persistent=False)

    def forward(self, x):
        return x * self.inv_freq


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.rotary = _Rotary(8)

    def forward(self, x):
        return self.rotary(self.proj(x))

    def _init_weights(self, module):
        if isinstance(module, torch.nn.Linear):
            module.weight.copy_(_ramp(module.weight, 0.5))
            module.bias.copy_(_ramp(module.bias, 0.1))
        if isinstance(module, _Rotary):
            module.inv_freq.copy_(1.0 / 10000 ** (torch.arange(8) / 8))


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.inner(x))

    def _init_weights(self, module):
        if isinstance(module, torch.nn.Linear):
            module.weight.copy_(_ramp(module.weight, 2.0))
            module.bias.zero_()
        if isinstance(module, _Rotary):
            module.inv_freq.fill_(3.0)


def _initialized_on_one_device() -> _Outer:
    """As Transformers' post_init does: the root's `_init_weights` for its modules, the sub-model's own for its."""
    model = _Outer()
    with torch.no_grad():
        model.apply(model._init_weights)
        model.inner.apply(model.inner._init_weights)
    return model


def _rank(rank, path):
    with torch.device("meta"):
        model = _Outer()    # one per rank: threads sharing a meta tree would make its modules real together
    pm = autopar.parallelize(model, init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), (EXAMPLE,),
                             strategy="fsdp", hardware="cpu")
    pm.to_empty(device="cpu")
    pm.init_weights()
    initialized = {n: t.clone() for n, t in [*pm.state_dict(full=True).items(), *pm.store.named_buffers()]}
    pm.to_empty(device="cpu")    # garbage again, for load_hf to fill
    autopar.checkpoint.load_hf(pm, path)
    return initialized, {n: b.clone() for n, b in pm.store.named_buffers()}


def test_init_weights_and_load_hf_both_use_the_nearest_init_weights(tmp_path):
    want = _initialized_on_one_device()
    save_file(want.state_dict(), str(tmp_path / "model.safetensors"))
    expected = {**want.state_dict(), "inner.rotary.inv_freq": want.inner.rotary.inv_freq}
    assert not torch.equal(want.inner.proj.weight, _ramp(want.inner.proj.weight, 2.0))   # the root's differs
    for initialized, loaded in run_threaded(2, _rank, str(tmp_path)):
        assert initialized.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(initialized[name], value, atol=0, rtol=0, msg=name)
        torch.testing.assert_close(loaded["inner.rotary.inv_freq"], expected["inner.rotary.inv_freq"],
                                   atol=0, rtol=0)
