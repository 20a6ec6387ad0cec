"""The capture cache (autopar/capture/cache.py): a planning capture from disk equals a fresh one, and
whatever changes the traced graph (the forward's code, a helper in another file, a config value) misses."""
from __future__ import annotations

import importlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from test_repeat import assert_same_capture

import autopar
from autopar.capture import repeat
from autopar.capture.cache import capture_key
from autopar.capture.compute_dtype import at_compute_dtype
from autopar.capture.repeat import RepeatedProgram, capture_repeated
from autopar.testing import tiny_llama


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The cache on, in a directory of this test's own (tests/conftest.py turns it off for the suite)."""
    where = tmp_path / "captures"
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(where))
    monkeypatch.setenv("AUTOPAR_CAPTURE_CACHE", "1")
    return where


@pytest.fixture
def traces(monkeypatch) -> list:
    """One entry per torch.export run of a shortened model: what a hit saves."""
    calls = []
    real = repeat.capture

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(repeat, "capture", counted)
    return calls


def _llama():
    torch.manual_seed(0)
    return tiny_llama(num_layers=5), torch.randint(0, 64, (2, 8))


def _entries(where) -> list:
    return sorted(where.glob("*.pkl"))


def test_warm_capture_equals_a_fresh_one(cache_dir, traces):
    model, x = _llama()
    cold = capture_repeated(model, (x,))
    assert len(traces) == 1 and len(_entries(cache_dir)) == 1
    warm = capture_repeated(model, (x,))
    assert len(traces) == 1   # not traced again
    assert isinstance(warm.exported, RepeatedProgram) and warm.exported.traced is None
    assert warm.exported.state_dict.keys() == cold.exported.state_dict.keys()
    assert_same_capture(warm, cold)   # nodes, NodeInfos, storage grouping, symbols, hints, trainable values
    assert (warm.ranges, warm.input_keys, warm.constant_inputs) == (cold.ranges, cold.input_keys,
                                                                    cold.constant_inputs)
    assert not list(cache_dir.glob("*.tmp"))   # written whole, then renamed into place


KEY_OF_TINY_LLAMA = """
import torch
from autopar.capture.cache import capture_key
from autopar.capture.compute_dtype import at_compute_dtype
from autopar.testing import tiny_llama
torch.manual_seed(0)
print(capture_key(tiny_llama(num_layers=5), (torch.randint(0, 64, (2, 8)),), "auto", None))
"""


def test_the_key_is_the_same_in_another_process():
    """Another process (another hash seed) computes the same key: otherwise no plan ever hits."""
    model, x = _llama()
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", KEY_OF_TINY_LLAMA], env=env, capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    assert out == capture_key(model, (x,), "auto", None)


def test_the_key_does_not_depend_on_what_else_was_imported():
    """Importing other models (as a test run or a notebook does) adds submodules, and lazily their classes,
    to transformers' package namespaces; the key must not read them (it did: CI's workers missed)."""
    import transformers
    model, x = _llama()
    before = capture_key(model, (x,), "auto", None)
    transformers.GPT2Config, transformers.Qwen2ForCausalLM   # (lazy attributes: importing them is the point)
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401
    assert capture_key(model, (x,), "auto", None) == before


def _plan_json(plan) -> dict:
    out = json.loads(plan.to_json())
    out["stats"] = {k: v for k, v in out["stats"].items() if not k.endswith("_seconds")}
    return out


def test_warm_plan_is_the_same_plan(cache_dir, traces):
    model, x = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        cold = autopar.plan(model, (x,), {"dp": 2, "tp": 2}, hardware="cpu", strategy="fsdp+tp")
        warm = autopar.plan(model, (x,), {"dp": 2, "tp": 2}, hardware="cpu", strategy="fsdp+tp")
    assert len(traces) == 1
    assert _plan_json(warm) == _plan_json(cold)


def test_a_model_without_a_stack_is_cached_too(cache_dir, traces):
    """The README's demo GPT has 2 layers, no stack to shorten: it is traced whole, and its capture kept all
    the same (it was traced on every plan, 1-2 s of a 4 s plan); the warm plan is the cold one."""
    from autopar.testing import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    x = torch.randint(0, 64, (8, 16))
    assert not repeat.find_stacks(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        cold = autopar.plan(model, (x,), {"x": 2, "y": 2}, hardware="cpu", memory_limit="1MiB")
        warm = autopar.plan(model, (x,), {"x": 2, "y": 2}, hardware="cpu", memory_limit="1MiB")
    assert len(traces) == 1 and len(_entries(cache_dir)) == 1
    assert _plan_json(warm) == _plan_json(cold)
    hit = capture_repeated(model, (x,))
    assert len(traces) == 1 and isinstance(hit.exported, RepeatedProgram) and hit.exported.traced is None
    assert hit.exported.state_dict.keys() == {n for n, _ in [*model.named_parameters(remove_duplicate=False),
                                                             *model.named_buffers(remove_duplicate=False)]}
    assert_same_capture(hit, repeat.capture(model, (x,)))   # against a trace made now


def test_a_config_value_no_shape_shows_misses(cache_dir, traces):
    """An epsilon is in no parameter's shape, yet in the graph: a model with another one is traced again."""
    model, x = _llama()
    capture_repeated(model, (x,))
    for module in model.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = 1e-3
    changed = capture_repeated(model, (x,))
    assert len(traces) == 2 and len(_entries(cache_dir)) == 2
    assert any(1e-3 in n.args for n in changed.graph.nodes if n.op == "call_function")


def test_a_private_attribute_is_in_the_key():
    """A forward may read `self._scale` as well as `self.scale`; only torch's own bookkeeping is left out."""
    model, x = _llama()
    before = capture_key(model, (x,), "auto", None)
    model.model.model.layers[1]._scale = 0.5
    assert capture_key(model, (x,), "auto", None) != before


def test_a_config_size_misses(cache_dir, traces):
    torch.manual_seed(0)
    x = torch.randint(0, 64, (2, 8))
    capture_repeated(tiny_llama(num_layers=5), (x,))
    wider = capture_repeated(tiny_llama(num_layers=5, hidden=64), (x,))
    assert len(traces) == 2
    assert wider.info["p_model_model_embed_tokens_weight"].meta.hint == (64, 64)


def test_another_compute_dtype_misses(cache_dir, traces):
    """Under a bf16 policy the model is traced with bf16 stand-ins (compute_dtype.py): not the float32 graph."""
    model, x = _llama()
    capture_repeated(model, (x,))
    bf16 = at_compute_dtype(capture_repeated, model, torch.bfloat16)(model, (x,), "auto")
    assert len(traces) == 2
    assert bf16.info["p_model_model_layers_4_mlp_up_proj_weight"].meta.dtype == torch.bfloat16


NET = '''
import torch
from torch import nn
from {helpers} import squash


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x + squash(torch.{act}(self.lin(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(5)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
'''

HELPERS = '''
import torch


def squash(x):
    return torch.{squash}(x)
'''


def _net(src, act: str, squash: str):
    """Net of a module written now (its forward calls torch.`act`, then a helper in another file)."""
    name = f"cache_case_{src.parent.name}"
    (src / f"{name}_helpers.py").write_text(textwrap.dedent(HELPERS.format(squash=squash)))
    (src / f"{name}.py").write_text(textwrap.dedent(NET.format(helpers=f"{name}_helpers", act=act)))
    importlib.invalidate_caches()
    for module in (f"{name}_helpers", name):   # the helper first: the net imports it by name
        if module in sys.modules:
            importlib.reload(sys.modules[module])
        else:
            importlib.import_module(module)
    torch.manual_seed(0)
    return sys.modules[name].Net()


def _ops(cap) -> set:
    return {str(n.target) for n in cap.graph.nodes if n.op == "call_function"}


def test_a_change_to_the_code_misses(cache_dir, traces, tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)   # a rewrite within a second must be read anew
    x = torch.randn(4, 8)
    first = capture_repeated(_net(src, "relu", "tanh"), (x,))
    capture_repeated(_net(src, "relu", "tanh"), (x,))
    assert len(traces) == 1   # the same code: a hit
    assert "aten.relu.default" in _ops(first) and "aten.tanh.default" in _ops(first)
    forward_changed = capture_repeated(_net(src, "sigmoid", "tanh"), (x,))
    assert len(traces) == 2
    assert "aten.sigmoid.default" in _ops(forward_changed) and "aten.relu.default" not in _ops(forward_changed)
    helper_changed = capture_repeated(_net(src, "sigmoid", "sin"), (x,))   # the model's own file as it was
    assert len(traces) == 3
    assert "aten.sin.default" in _ops(helper_changed) and "aten.tanh.default" not in _ops(helper_changed)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "another key"])
def test_a_damaged_entry_is_ignored_and_rewritten(cache_dir, traces, damage):
    model, x = _llama()
    cold = capture_repeated(model, (x,))
    entry, = _entries(cache_dir)
    data = entry.read_bytes()
    entry.write_bytes({"garbage": b"\x00not a pickle",
                       "truncated": data[: len(data) // 2],
                       "another key": pickle.dumps({**pickle.loads(data), "key": "another"})}[damage])
    again = capture_repeated(model, (x,))
    assert len(traces) == 2   # traced again, no error
    assert_same_capture(again, cold)
    capture_repeated(model, (x,))
    assert len(traces) == 2   # the entry was rewritten whole
    assert _entries(cache_dir) == [entry]


def test_switched_off(cache_dir, traces, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CAPTURE_CACHE", "0")
    model, x = _llama()
    capture_repeated(model, (x,))
    capture_repeated(model, (x,))
    assert len(traces) == 2 and not cache_dir.exists()
