"""Indexing by a count of rows is rewritten as a slice (capture/iota_index.py) only where the count and the
indexed dim are one size at every call the module takes -- compared as symbols, not as the example's sizes.

A learned (n, n) table read as `table[i[:, None], i[None, :]]` with `i = arange(seq)` (a relative-position
bias) must keep its gather: at an example seq equal to n the count matches the table, but at any shorter
seq the original reads a seq x seq corner, while `table[:, i]` would read all n rows. HF's padding mask,
the case the rewrite was made for, is still rewritten: its count and its rows are two inputs' batch dims
(input_ids' and attention_mask's), which export gives two symbols and the module checks equal per call.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.capture.export import capture
from autopar.testing import padded_batch, run_threaded, shipped_causal_lm

INDEX = torch.ops.aten.index.Tensor


class BiasTable(nn.Module):
    """x (batch, seq, 8) -> table[:seq, :seq] @ proj(x), the corner read by an index of arange(seq)."""

    def __init__(self, size: int = 16):
        super().__init__()
        self.table = nn.Parameter(torch.randn(size, size))
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        i = torch.arange(x.shape[1], device=x.device)
        return self.table[i[:, None], i[None, :]] @ self.proj(x)


def _whole_leading_dims(cap) -> list:
    """Per aten.index node, whether it takes its first dim whole (None: the rewritten form)."""
    return [n.args[1][0] is None for n in cap.graph.nodes if n.op == "call_function" and n.target is INDEX]


def _eager(model, x):
    m = copy.deepcopy(model)
    out = m(x)
    out.pow(2).mean().backward()
    return out.detach(), {k: p.grad for k, p in m.named_parameters()}


def test_a_table_as_long_as_the_example_keeps_its_gather_and_takes_a_shorter_sequence():
    torch.manual_seed(0)
    model = BiasTable(16)
    example, shorter = torch.randn(4, 16, 8), torch.randn(4, 12, 8)
    cap = capture(model, (example,))
    want, want_grads = _eager(model, shorter)
    torch.testing.assert_close(cap.exported.module()(shorter), want, rtol=0, atol=1e-6)
    assert _whole_leading_dims(cap) == [False]

    def run(rank):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("a",))
        pm = autopar.parallelize(copy.deepcopy(model), mesh, (example,), strategy="ddp")
        (local,) = pm.plan.local_inputs(shorter)
        out = pm(local)
        out.pow(2).mean().backward()
        return out.detach(), {k: p.grad for k, p in pm.named_parameters()}

    outs = run_threaded(2, run)
    torch.testing.assert_close(torch.cat([o for o, _ in outs]), want, rtol=0, atol=1e-6)
    for _, grads in outs:
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], rtol=0, atol=1e-6, msg=name)


def test_hf_padding_mask_is_still_rewritten():
    """Its count is arange(input_ids' batch), its rows attention_mask's: export's two symbols, one batch."""
    torch.manual_seed(0)
    cap = capture(shipped_causal_lm("llama"), (), example_kwargs=padded_batch())
    assert _whole_leading_dims(cap) == [True]


@settings(max_examples=8, deadline=None)
@given(size=st.integers(3, 8), dynamic=st.booleans(), data=st.data())
def test_drawn_table_and_lengths_equal_eager(size, dynamic, data):
    """A table of `size`, an example length at or just below it (at it, the sizes meet), a call of any length
    the table holds (the example's where seq is static): the exported module equals eager. The gather is kept
    wherever seq is dynamic, and made a slice where seq is fixed at the table's size."""
    example_len = data.draw(st.integers(max(2, size - 1), size), label="example_len")
    call_len = data.draw(st.integers(2, size), label="call_len") if dynamic else example_len
    torch.manual_seed(size)
    model = BiasTable(size)
    cap = capture(model, (torch.randn(2, example_len, 8),), dynamic_shapes="auto" if dynamic else None)
    assert _whole_leading_dims(cap) == [not dynamic and example_len == size]
    x = torch.randn(2 if not dynamic else 3, call_len, 8)
    torch.testing.assert_close(cap.exported.module()(x), model(x), rtol=0, atol=1e-6)
