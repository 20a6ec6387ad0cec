"""init_weights and load_hf's recompute of non-persistent buffers initialize a module alike: with the
nearest `_init_weights` of the module or a parent (runtime/initialization.py: module_initializers).

The model wraps a sub-model with an `_init_weights` of its own, as a LlamaForCausalLM wraps a LlamaModel
that is itself a PreTrainedModel: Transformers initializes that sub-model with its own, and so must both.
Had one of them taken the root's, the sub-model's weights or its rotary-like buffer would differ from the
single-device model's.

An `_init_weights` that sets only some modules (nanoGPT's: Linear and Embedding, no LayerNorm) is followed by
`reset_parameters` for the tensors it left (runtime/initialization.run_initializers), and only for those.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.testing import GPT, GPTConfig, run_threaded

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


# nanoGPT's _init_weights sets Linear and Embedding only: a LayerNorm keeps what its constructor gave it on one
# device (ones, zeros), and init_weights must give it that too (reset_parameters, after _init_weights left it)
class _NanoGPT(GPT):
    """autopar.testing's GPT with nanoGPT's `_init_weights`, applied in the constructor as nanoGPT does (a
    no-op on meta). It draws from a generator of its own, seeded with `seed` (ranks run as threads share
    torch's, and their draws would interleave), or from torch's with `seed=None`."""

    def __init__(self, config, seed=7):
        super().__init__(config)
        self.init_generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02, generator=self.init_generator)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02, generator=self.init_generator)


GPT_CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _nanogpt_rank(rank):
    with torch.device("meta"):
        model = _NanoGPT(GPT_CFG)
    pm = autopar.parallelize(model, init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)),
                             (torch.zeros(2, GPT_CFG.block_size, dtype=torch.long),), strategy="fsdp", hardware="cpu")
    pm.to_empty(device="cpu")
    pm.init_weights()
    return {n: t.clone() for n, t in pm.state_dict(full=True).items()}


def test_init_weights_falls_back_to_reset_parameters_for_what_init_weights_leaves():
    want = _NanoGPT(GPT_CFG).state_dict()    # built normally: its LayerNorms hold their constructor's ones, zeros
    assert torch.equal(want["ln_f.weight"], torch.ones(GPT_CFG.n_embd))
    for got in run_threaded(2, _nanogpt_rank):
        assert got.keys() == want.keys()
        # every Linear and Embedding holds _init_weights' draws, in order: a reset_parameters run after it
        # would overwrite them; every LayerNorm reset_parameters' ones and zeros (before: to_empty's garbage)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, atol=0, rtol=0, msg=name)


def test_init_weights_draws_no_more_than_one_device():
    """A module _init_weights sets whole runs nothing more: its reset_parameters (a Linear's) would draw
    from torch's generator again, and every later module's draws would differ from one device's."""
    from autopar.runtime.initialization import init_shards
    with torch.device("meta"):
        model = _NanoGPT(GPT_CFG, seed=None)
    shards = {n: torch.empty_like(t, device="cpu") for n, t in model.state_dict().items()}   # one rank, whole
    torch.manual_seed(0)
    init_shards(model, shards, {}, {}, (), ())
    want = _NanoGPT(GPT_CFG, seed=None)
    torch.manual_seed(0)
    with torch.no_grad():
        want.apply(want._init_weights)     # nanoGPT's draws, from seed 0
    for name, value in want.state_dict().items():
        torch.testing.assert_close(shards[name], value, atol=0, rtol=0, msg=name)


class _Scale(torch.nn.Module):
    """A parameter no initializer sets: no reset_parameters, and the model's _init_weights passes it by."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.weight


class _WeightOnly(torch.nn.Module):
    """An `_init_weights` that sets a Linear's weight and leaves its bias to the constructor's."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.scale = _Scale(8)

    def forward(self, x):
        return self.scale(self.proj(x))

    def _init_weights(self, module):
        if isinstance(module, torch.nn.Linear):
            module.weight.copy_(_ramp(module.weight, 0.5))


def test_init_weights_keeps_what_init_weights_set_and_names_what_nothing_sets():
    from autopar.runtime.initialization import init_shards
    with torch.device("meta"):
        model = _WeightOnly()
    shards = {n: torch.empty_like(t, device="cpu") for n, t in model.state_dict().items()}   # one rank, whole
    with pytest.warns(UserWarning, match=r"\['scale\.weight'\]"):
        init_shards(model, shards, {}, {}, (), ())
    # the bias from reset_parameters, which left the weight _init_weights set
    torch.testing.assert_close(shards["proj.weight"], _ramp(shards["proj.weight"], 0.5), atol=0, rtol=0)
    assert shards["proj.bias"].abs().max() <= 8 ** -0.5
    assert shards["scale.weight"].isnan().all()    # marked, not to_empty's garbage
