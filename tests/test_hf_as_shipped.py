"""Hugging Face causal LMs as their authors ship them and call them train like one device.

Each model is built from its family's default config (shrunk: 2 layers, width 32; `use_cache=True` as
shipped) and trained the way every HF fine-tuning script does: `out = pm(**batch)`, `out.loss.backward()`,
with `batch` a collator's padded batch -- right and left padding spread unevenly over the batch shards,
`labels=-100` there. Under every named strategy and auto, on a 2 x 2 mesh, the losses and the parameters
after 3 steps of SGD (which sees a wrong gradient scale) and of AdamW (which sees a wrong direction) must
equal one device's. Llama runs every strategy here; Qwen2 and GPT-2 (tied embeddings, Conv1D) run the
layouts that split most in tests/test_hf_families.py, so that the two files share the suite's two workers.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

from autopar.testing import padded_batch, shipped_causal_lm
from autopar.testing.harness import check_keyword_training, keyword_reference

# SGD at a large lr: a gradient off by a factor moves the parameters by ~lr x gradient, far above atol.
# AdamW at a small lr: its normalised step turns float noise in near-zero gradients into differences of ~lr.
RUNS = {"sgd": (torch.optim.SGD, 0.5), "adamw": (torch.optim.AdamW, 1e-3)}
ATOL = {"sgd": 1e-5, "adamw": 2e-4}
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "tp", "tp+sp", "fsdp+tp", "auto")


@functools.cache
def _llama():
    torch.manual_seed(0)
    model = shipped_causal_lm("llama")
    batch = padded_batch(vocab=model.config.vocab_size)
    return model, batch, {name: keyword_reference(model, batch, opt, lr) for name, (opt, lr) in RUNS.items()}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_llama_as_shipped(strategy):
    model, batch, refs = _llama()
    assert model.config.use_cache   # as shipped
    records = check_keyword_training(model, batch, strategy, RUNS, ATOL, references=refs)
    for rec in records:
        assert rec["past_key_values"] is None   # the cache is left out of the captured outputs (capture/caches.py)
        mesh = rec["plan"].mesh   # the logits come back split along the batch only, over the axes that split it
        num_shards = math.prod(mesh.axis_sizes[mesh.axis_names.index(a)] for a in rec["plan"].batch_axes)
        assert rec["logits_shape"] == (batch["input_ids"].shape[0] // num_shards, 8, 64)


def test_padded_batch_is_uneven_over_shards():
    """The premise of the tests above: the two batch shards count different numbers of labels, so
    averaging the shards' mean losses would be wrong."""
    batch = padded_batch()
    counted = (batch["labels"][:, 1:] != -100).sum(dim=1)     # HF shifts the labels by one
    assert counted[:2].sum() != counted[2:].sum()
    assert batch["attention_mask"][0, -1] == 0 and batch["attention_mask"][2, 0] == 0   # right and left padding
