"""Qwen2 and GPT-2 as shipped (default configs, use_cache=True, GPT-2's tied embeddings and Conv1D),
trained with keywords on a padded batch, equal to one device with SGD and with AdamW: the layouts that
split most, on a 2 x 2 mesh. tests/test_hf_as_shipped.py runs Llama under every strategy and says why
each part is there."""
from __future__ import annotations

import functools

import pytest
import torch

from autopar.testing import padded_batch, shipped_causal_lm
from autopar.testing.harness import check_keyword_training, keyword_reference

RUNS = {"sgd": (torch.optim.SGD, 0.5), "adamw": (torch.optim.AdamW, 1e-3)}
ATOL = {"sgd": 1e-5, "adamw": 2e-4}
# the layouts that move most (sequence and tensor splits, vocab-parallel loss) and the search; Llama runs the
# rest, which differ from these in how gradients are reduced, not in what the model's ops see
CASES = [("qwen2", s) for s in ("tp+sp", "fsdp+tp", "auto")] + [("gpt2", s) for s in ("tp+sp", "fsdp+tp", "ddp")]


@functools.cache
def _model(family: str):
    torch.manual_seed(0)
    model = shipped_causal_lm(family)
    batch = padded_batch(vocab=model.config.vocab_size)
    return model, batch, {name: keyword_reference(model, batch, opt, lr) for name, (opt, lr) in RUNS.items()}


@pytest.mark.parametrize("family,strategy", CASES)
def test_family_as_shipped(family, strategy):
    model, batch, refs = _model(family)
    for rec in check_keyword_training(model, batch, strategy, RUNS, ATOL, references=refs):
        assert rec["past_key_values"] is None
