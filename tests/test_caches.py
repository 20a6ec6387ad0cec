"""A Hugging Face model captured without its KV cache (capture/caches.py) gives the numbers it gives as shipped.

HF's packed-sequence mask (`position_ids` restarting per document, no attention_mask: each document
attends to itself only) applies only where no cache is built. A Llama whose config has use_cache=True, called
as its authors call it on a packed batch, builds a cache and attends across the documents; the capture, which
turns the cache off, must do the same -- and mask per document where the call itself says use_cache=False.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.capture.caches import caches_left_out
from autopar.capture.export import capture
from autopar.testing import run_threaded, shipped_causal_lm


def _packed_batch(batch: int = 4, seq: int = 16, vocab: int = 64) -> dict:
    """Documents packed into rows, as HF's DataCollatorWithFlattening gives them: position_ids restart at
    each document (rows split differently), no attention_mask, labels -100 on each document's first token."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    lengths = [(6, 10), (3, 5, 8), (16,), (9, 7)]
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in lengths[row % 4]]) for row in range(batch)])
    labels = input_ids.masked_fill(position_ids == 0, -100)
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


@functools.cache
def _llama():
    torch.manual_seed(0)
    return shipped_causal_lm("llama")


def _one_device(model, batch) -> tuple:
    m = copy.deepcopy(model)
    loss = m(**batch).loss
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in m.named_parameters()}


@pytest.mark.parametrize("use_cache, checkpointing", [(None, False), (True, False), (False, False), (None, True)],
                         ids=["config", "on", "off", "checkpointed"])
def test_packed_batch_without_the_cache_gives_the_shipped_loss(use_cache, checkpointing):
    """Called eagerly under the capture's hooks. With a cache (the config's use_cache=True, or the call's)
    the documents attend across; without one (use_cache=False, or HF's gradient checkpointing turning it
    off) HF masks per document. Both as the model itself does."""
    model, batch = copy.deepcopy(_llama()), _packed_batch()
    if checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    call = batch if use_cache is None else dict(batch, use_cache=use_cache)
    want, _ = _one_device(model, call)
    with caches_left_out(model):
        got = model(**call).loss
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    across = use_cache is not False and not checkpointing
    other, _ = _one_device(_llama(), dict(batch, use_cache=not across))
    assert (want - other).abs() > 1e-4   # the two behaviours differ on this batch


def test_packed_batch_captured_gives_the_shipped_loss_with_sdpa_causal():
    """As shipped: the captured graph's attention is SDPA's is_causal with no mask, as the model's own."""
    model, batch = _llama(), _packed_batch()
    want, _ = _one_device(model, batch)
    cap = capture(model, (), example_kwargs=batch)
    torch.testing.assert_close(cap.exported.module()(**batch)["loss"], want, rtol=0, atol=1e-6)
    sdpa = [n for n in cap.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(sdpa) == 2 and all(len(n.args) > 5 and n.args[3] is None and n.args[5] for n in sdpa)


def test_packed_batch_under_ddp_equals_one_device():
    model, batch = _llama(), _packed_batch()
    want, want_grads = _one_device(model, batch)

    def run(rank):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        pm = autopar.parallelize(copy.deepcopy(model), mesh, example_kwargs=batch, strategy="ddp")
        loss = pm(**pm.plan.local_kwargs(**batch)).loss
        loss.backward()
        return loss.detach(), {k: p.grad for k, p in pm.named_parameters()}

    for loss, grads in run_threaded(2, run):
        torch.testing.assert_close(loss, want, rtol=0, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], rtol=0, atol=1e-6, msg=name)
