"""A causal mask a traced model builds from shapes becomes `is_causal=True` (capture/causal_masks.py), so a
GPU runs flash attention as the untraced model does; any other mask is kept, numbers unchanged."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.capture.causal_masks import SDPA
from autopar.capture.export import capture
from autopar.testing import padded_batch, shipped_causal_lm


def _sdpa_calls(cap):
    return [n for n in cap.graph.nodes if n.op == "call_function" and n.target is SDPA]


def _mask_and_flag(node):
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    return mask, causal


class MaskedAttention(nn.Module):
    """Attention over x with a mask made from its length by `make_mask(length)`."""

    def __init__(self, make_mask):
        super().__init__()
        self.proj = nn.Linear(8, 24)
        self.make_mask = make_mask

    def forward(self, x):
        q, k, v = self.proj(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        n = x.shape[1]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.make_mask(n, x.device)).sum()


def _bool_causal(n, device):
    i = torch.arange(n, device=device)
    return i[None, :] <= i[:, None]


def _float_causal(n, device):
    return torch.zeros(n, n, device=device).masked_fill(~_bool_causal(n, device), float("-inf"))


def _sliding_window(n, device):   # causal, and only the last 2 keys: not is_causal
    i = torch.arange(n, device=device)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 2)


def _anti_causal(n, device):
    i = torch.arange(n, device=device)
    return i[None, :] >= i[:, None]


def test_hf_llama_without_padding_runs_sdpa_as_causal_with_no_mask_left():
    model = shipped_causal_lm("llama")
    ids = torch.randint(0, 64, (2, 8))
    cap = capture(model, (), example_kwargs={"input_ids": ids, "labels": ids})
    calls = _sdpa_calls(cap)
    assert len(calls) == 2
    assert all(_mask_and_flag(n) == (None, True) for n in calls)
    # the mask's subgraph is gone: no s x s comparison is left in the graph
    assert not [n for n in cap.graph.nodes if n.target in (torch.ops.aten.le.Tensor, torch.ops.aten.diff.default)]


def test_hf_llama_with_a_padded_batch_keeps_its_mask():
    model = shipped_causal_lm("llama")
    batch = padded_batch(seq=8)
    cap = capture(model, (), example_kwargs=batch)
    assert all(isinstance(_mask_and_flag(n)[0], torch.fx.Node) and not _mask_and_flag(n)[1]
               for n in _sdpa_calls(cap))


@pytest.mark.parametrize("make_mask, rewritten", [(_bool_causal, True), (_float_causal, True),
                                                  (_sliding_window, False), (_anti_causal, False)])
def test_only_a_causal_mask_is_rewritten_and_the_numbers_stay(make_mask, rewritten):
    torch.manual_seed(0)
    model = MaskedAttention(make_mask)
    x = torch.randn(2, 6, 8)
    cap = capture(model, (x,))
    (call,) = _sdpa_calls(cap)
    mask, causal = _mask_and_flag(call)
    assert (mask is None and causal) == rewritten
    y = torch.randn(2, 5, 8)   # another length: the rewrite holds for every length, not only the example's
    assert torch.allclose(cap.exported.module()(y), model(y), atol=1e-6)


def _long_sliding_window(n, device):   # Mistral's: causal at every length up to its window of 4096 keys
    i = torch.arange(n, device=device)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 4096)


def test_a_window_longer_than_every_size_tried_is_not_taken_for_causal():
    """At the sizes capture evaluates, this mask equals the causal one; past 4096 keys it does not."""
    model = MaskedAttention(_long_sliding_window)
    cap = capture(model, (torch.randn(2, 6, 8),))
    (call,) = _sdpa_calls(cap)
    assert isinstance(_mask_and_flag(call)[0], torch.fx.Node)


def test_a_mask_of_a_static_shape_is_checked_at_that_shape():
    model = MaskedAttention(_bool_causal)
    cap = capture(model, (torch.randn(2, 6, 8),), dynamic_shapes=None)
    (call,) = _sdpa_calls(cap)
    assert _mask_and_flag(call) == (None, True)


# ---------------------------------------------------------------- masks causal at some lengths, not at all
# Issue 51: each of these was rewritten to is_causal=True, captured at length 16; called at 12 and 20 the
# module then attended to keys the model masks out (max |difference| 0.3 to 1.5).

def _triu_window(n, device):   # how HF Mistral first wrote its sliding window: the last 8 keys
    return torch.ones(n, n, dtype=torch.bool, device=device).tril().triu(-7)


def _chunks(n, device):   # causal inside chunks of 8 (Llama 4's chunked attention, scaled down)
    i = torch.arange(n, device=device)
    return ((i[:, None] >> 3) == (i[None, :] >> 3)) & (i[None, :] <= i[:, None])


def _window_from_a_tensor(n, device):
    i, window = torch.arange(n, device=device), torch.full((), 8, device=device)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)


def _prefix_lm(n, device):   # the first quarter sees itself whole
    i = torch.arange(n, device=device)
    return (i[None, :] <= i[:, None]) | (i[None, :] < n // 4)


def _static_table(n, device):
    return torch.ones(64, 64, dtype=torch.bool, device=device).tril().triu(-7)[:n, :n]


@pytest.mark.parametrize("make_mask", [_triu_window, _chunks, _window_from_a_tensor, _prefix_lm, _static_table])
def test_a_mask_causal_only_up_to_some_length_is_kept(make_mask):
    torch.manual_seed(0)
    model = MaskedAttention(make_mask)
    cap = capture(model, (torch.randn(2, 16, 8),))
    (call,) = _sdpa_calls(cap)
    assert isinstance(_mask_and_flag(call)[0], torch.fx.Node)
    for length in (6, 12, 20):
        y = torch.randn(2, length, 8)
        assert torch.allclose(cap.exported.module()(y), model(y), atol=1e-6), length


def test_a_sliding_window_trains_under_ddp_as_the_model_does():
    """The issue's first run: ddp on 2 ranks at length 16, where the module differed from the model by 0.3
    on the example batch itself."""
    import autopar
    from autopar.testing import run_threaded
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model, x = MaskedAttention(_triu_window), torch.randn(4, 16, 8)
    want = model(x)
    want.backward()
    want_grads = {k: p.grad.clone() for k, p in model.named_parameters()}

    def rank(r):
        import copy
        mine = copy.deepcopy(model)
        mine.zero_grad()
        pm = autopar.parallelize(mine, init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), (x,),
                                 strategy="ddp", hardware="cpu")
        out = pm(*pm.plan.local_inputs(x))
        out.backward()
        return float(out), {k: p.grad.clone() for k, p in pm.named_parameters()}

    for out, grads in run_threaded(2, rank):
        assert abs(out - float(want)) < 1e-4   # the module returns the model's loss, summed over the batch
        for k, g in grads.items():
            assert torch.allclose(g, want_grads[k], atol=1e-5), k


# ---------------------------------------------------------------- the hypothesis net
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _drawn_mask(family: str, k: int):
    """A mask of the families above with its number `k` drawn (a window, a chunk, a diagonal, a divisor)."""
    def make(n, device):
        i = torch.arange(n, device=device)
        causal = i[None, :] <= i[:, None]
        if family == "window":
            return causal & (i[:, None] - i[None, :] < k)
        if family == "triu":
            return torch.ones(n, n, dtype=torch.bool, device=device).tril().triu(-k)
        if family == "chunks":
            return causal & ((i[:, None] // k) == (i[None, :] // k))
        if family == "prefix":
            return causal | (i[None, :] < n // k)
        if family == "static":
            return torch.ones(k, k, dtype=torch.bool, device=device).tril()[:n, :n]
        return causal
    return make


@settings(max_examples=6)
@given(family=st.sampled_from(["causal", "window", "triu", "chunks", "prefix", "static"]), k=st.integers(2, 24),
       example=st.integers(4, 16), others=st.lists(st.integers(2, 24), min_size=2, max_size=2))
def test_drawn_masks_give_the_model_s_numbers_at_drawn_lengths(family, k, example, others):
    if family == "static":
        k = max(k, example, *others) + 1   # the table covers every length called with (export pins one equal to it)
    torch.manual_seed(0)
    model = MaskedAttention(_drawn_mask(family, k))
    cap = capture(model, (torch.randn(2, example, 8),))
    (call,) = _sdpa_calls(cap)
    if family == "causal":
        assert _mask_and_flag(call) == (None, True)
    for length in (example, *others):
        y = torch.randn(2, length, 8)
        assert torch.allclose(cap.exported.module()(y), model(y), atol=1e-6), length


def test_a_static_length_mask_that_reads_another_dynamic_size_is_kept():
    """From a review: with the length static, the numbers rule was skipped, but this mask reads another input's
    dynamic length n: causal at every n tried (n - 8 <= 0 for small n), a prefix of n - 8 keys past them."""
    class PrefixFromAnotherInput(nn.Module):
        def forward(self, x, p):
            i = torch.arange(x.shape[1])
            mask = (i[None, :] <= i[:, None]) | (i[None, :] < p.shape[0] - 8)
            return F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], attn_mask=mask)

    from torch.export import Dim
    model, x = PrefixFromAnotherInput(), torch.randn(2, 16, 8)
    cap = capture(model, (x, torch.zeros(4)), dynamic_shapes=({0: Dim("b")}, {0: Dim("n", min=2, max=64)}))
    (call,) = _sdpa_calls(cap)
    assert isinstance(_mask_and_flag(call)[0], torch.fx.Node)
    assert torch.allclose(cap.exported.module()(x, torch.zeros(20)), model(x, torch.zeros(20)), atol=1e-6)
