"""capture_repeated: a deep stack traced three layers deep and repeated equals the whole model's capture."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.cost.activations import requires_grad, storage_owners
from autopar.capture.blocks import block_of
from autopar.capture.export import capture
from autopar.capture.repeat import RepeatedProgram, capture_repeated, find_stacks
from autopar.capture.traced_layers import TRACED
from autopar.testing import GPT, MLP, GPTConfig, tiny_llama


def _gpt(n_layer=5):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, vocab_size=32, block_size=8)), \
        torch.randint(0, 32, (4, 8))


def _llama(n_layer=5):
    torch.manual_seed(0)
    return tiny_llama(num_layers=n_layer), torch.randint(0, 64, (2, 8))


class Layer(nn.Module):
    """A residual linear; `gelu` is an attribute, not a module, so the layers look alike either way."""

    def __init__(self, gelu=True, buffer=False):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gelu = gelu
        if buffer:
            self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        y = self.lin(x)
        if hasattr(self, "scale"):
            y = y * self.scale
        return x + (F.gelu(y) if self.gelu else F.relu(y))


class TwoStacks(nn.Module):
    """An encoder list and a decoder Sequential around a linear, with a buffer per layer."""

    def __init__(self, n_enc=5, n_dec=6):
        super().__init__()
        self.enc = nn.ModuleList([Layer(buffer=True) for _ in range(n_enc)])
        self.mid = nn.Linear(8, 8)
        self.dec = nn.Sequential(*[Layer(buffer=True) for _ in range(n_dec)])

    def forward(self, x):
        for layer in self.enc:
            x = layer(x)
        return self.dec(self.mid(x))


class Alternating(nn.Module):
    """Layers of one class and shape whose code differs (gelu, relu, gelu, ...)."""

    def __init__(self, n=6):
        super().__init__()
        self.layers = nn.ModuleList([Layer(gelu=i % 2 == 0) for i in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class NeedsEveryLayer(Alternating):
    """A forward that fails on a shortened stack: traced whole, and left whole."""

    def __init__(self, n=6):
        super().__init__(n)
        for layer in self.layers:
            layer.gelu = True
        self.n = n

    def forward(self, x):
        if len(self.layers) != self.n:
            raise ValueError("a layer is missing")
        return super().forward(x)


def _names(a):
    return fx.node.map_arg(a, lambda n: n.name)


def assert_same_capture(repeated, whole):
    assert [n.name for n in repeated.graph.nodes] == [n.name for n in whole.graph.nodes]
    for r, w in zip(repeated.graph.nodes, whole.graph.nodes):
        assert (r.op, r.target, _names(r.args), _names(r.kwargs)) == (w.op, w.target, _names(w.args),
                                                                      _names(w.kwargs)), w.name
        assert repeated.info[r.name] == whole.info[w.name], w.name
    assert repeated.input_names == whole.input_names
    assert repeated.aliases == whole.aliases
    assert repeated.symbols == whole.symbols and repeated.hints == whole.hints
    # what planning reads off the traced tensors and the program: views, and which parameters train
    assert storage_owners(repeated) == storage_owners(whole)
    assert requires_grad(repeated) == requires_grad(whole)


@pytest.mark.parametrize("build", [_gpt, _llama])
def test_repeated_capture_equals_whole(build):
    model, x = build()
    whole = capture(model, (x,))
    repeated = capture_repeated(model, (x,))
    assert isinstance(repeated.exported, RepeatedProgram)   # copied, not traced whole
    assert_same_capture(repeated, whole)


@pytest.mark.parametrize("build", [_gpt, _llama])
def test_copies_hold_meta_tensors_of_the_example_sizes(build):
    """A copied layer's traced values are plain meta tensors of the example's sizes, its views on its own
    storages: a fake tensor of symbolic sizes costs milliseconds per view (seconds for an 80-layer model),
    and planning reads of a copy's value only that it is a tensor and what shares its storage."""
    model, x = build()
    repeated = capture_repeated(model, (x,))   # dynamic_shapes="auto": the batch at least is a symbol
    assert "batch" in repeated.symbols
    (stack, _), = find_stacks(model).items()
    owners = storage_owners(repeated)
    num_copied = num_views = 0
    for node in repeated.graph.nodes:
        info = repeated.info[node.name]
        where = block_of((info.target_name if node.op == "placeholder" else info.module_path) or "")
        if node.op == "output" or where is None or where[0] != stack or where[1] < TRACED:
            continue
        val = node.meta.get("val")
        items = [(None, val, info.meta)] if isinstance(val, torch.Tensor) else [
            (k, v, info.meta[k]) for k, v in enumerate(val) if isinstance(v, torch.Tensor)] if isinstance(
            val, (list, tuple)) else []
        for k, v, meta in items:
            owner, _ = owners[(node.name, k)]
            owner_info = repeated.info[owner]
            owner_where = block_of(owner_info.module_path or owner_info.target_name or "")
            if owner_where != where:   # made outside the stack, or the layer before's output (a no-op cast)
                assert owner_where in (None, (stack, where[1] - 1)), node.name
                continue
            assert type(v) is torch.Tensor and v.device.type == "meta", node.name
            assert tuple(v.shape) == meta.hint and v.dtype == meta.dtype, node.name
            num_copied += 1
            num_views += owner != node.name
    assert num_copied and num_views   # the copies and their views were checked


def test_frozen_parameters_of_copied_layers_stay_frozen():
    model, x = _gpt()
    for block in model.h:
        block.ln_1.weight.requires_grad_(False)
    repeated = capture_repeated(model, (x,))
    assert isinstance(repeated.exported, RepeatedProgram)
    assert "p_h_4_ln_1_weight" not in requires_grad(repeated)
    assert_same_capture(repeated, capture(model, (x,)))


def test_dynamic_batch():
    model, x = _gpt()
    dynamic = {"idx": {0: torch.export.Dim("batch")}}
    repeated = capture_repeated(model, (x,), dynamic)
    assert isinstance(repeated.exported, RepeatedProgram)
    assert "batch" in repeated.symbols
    assert_same_capture(repeated, capture(model, (x,), dynamic))


def test_two_stacks_with_buffers():
    torch.manual_seed(0)
    model, x = TwoStacks(), torch.randn(4, 8)
    assert find_stacks(model) == {"enc": 5, "dec": 6}
    repeated = capture_repeated(model, (x,))
    assert isinstance(repeated.exported, RepeatedProgram)
    assert_same_capture(repeated, capture(model, (x,)))
    assert len(model.enc) == 5 and len(model.dec) == 6   # the model is left as it was


@pytest.mark.parametrize("model", [
    Alternating(),                           # alike layers that run different code
    TwoStacks(n_enc=3, n_dec=2),             # stacks too short to gain from copying
    MLP([8, 16, 16, 16, 16, 16, 8]),         # linears and activations alternate in one list
    NeedsEveryLayer(),                       # the shortened model does not trace
], ids=["alternating-code", "short", "alternating-classes", "needs-every-layer"])
def test_other_models_are_traced_whole(model):
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    stacks = {path: len(model.get_submodule(path)) for path in find_stacks(model)}
    repeated = capture_repeated(model, (x,))
    assert not isinstance(repeated.exported, RepeatedProgram)
    assert_same_capture(repeated, capture(model, (x,)))
    assert {path: len(model.get_submodule(path)) for path in stacks} == stacks


def _plan_json(plan) -> dict:
    """A plan's JSON less its timings."""
    out = json.loads(plan.to_json())
    out["stats"] = {k: v for k, v in out["stats"].items() if not k.endswith("_seconds")}
    return out


@pytest.mark.parametrize("build, strategy", [(_gpt, "fsdp+tp"), (_llama, "auto")])
def test_plan_is_the_same_as_from_every_layer(build, strategy):
    """The same plan, so one made by autopar.plan names the nodes parallelize's capture has. (No time
    limit: under one, HiGHS's pick among equally cheap plans varies with the machine's load.)"""
    model, x = build()
    mesh = {"dp": 2, "tp": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        fast = autopar.plan(model, (x,), mesh, hardware="cpu", strategy=strategy, time_limit=None)
        slow = autopar.plan(model, (x,), mesh, hardware="cpu", strategy=strategy, trace_every_layer=True,
                            time_limit=None)
    assert _plan_json(fast) == _plan_json(slow)
