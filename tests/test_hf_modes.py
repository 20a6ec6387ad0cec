"""Hugging Face models switch modes after parallelize as they do on one device (capture/modes.py).

- Parallelized in eval mode (`from_pretrained`'s mode), then trained with `pm.train()`: HF Llama's attention
  passes SDPA `dropout_p=0.0 if not self.training`, so its eval graph shows no dropout, and the train graph
  was never made (train losses of two seeds were equal, and equal to eval's). The module's
  `attention_dropout` says the model acts by mode, so both graphs are made: train losses differ by seed
  and from eval's. They cannot equal one device's: autopar draws one mask per shard (runtime/rng.py;
  tests/test_dropout_rng.py checks the masks).
- GPT-2 as shipped (dropout 0.1), parallelized in train mode: its train graph has more `aten.contiguous`
  than its eval graph (CPU SDPA returns another layout with dropout), which refused `pm.eval()`; it runs
  now, equal to one device.
- Under a cp ring, an attention with dropout (which the ring does not apply) in the other mode's graph is
  refused in words, not run without its dropout.
Threaded ranks; one layer, as the second capture doubles what each test takes.
"""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
import cost_models as cm
from autopar.testing import padded_batch, run_threaded, shipped_causal_lm
from torch.distributed.device_mesh import init_device_mesh

transformers = pytest.importorskip("transformers")


def _mesh(name: str):
    return init_device_mesh("cpu", (2,), mesh_dim_names=(name,))


def _llama_with_attention_dropout():
    """The shipped Llama config shrunk (shipped_causal_lm), one layer, attention_dropout=0.5, in eval mode."""
    config = shipped_causal_lm("llama").config
    config.num_hidden_layers, config.attention_dropout = 1, 0.5
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _eval_then_train(rank, model, batch):
    pm = autopar.parallelize(copy.deepcopy(model), _mesh("dp"), example_kwargs=batch, strategy="ddp")
    local = pm.plan.local_kwargs(**batch)
    with torch.no_grad():
        evaluated = pm(**local)
    pm.train()
    trained = []
    for seed in (1, 2, 1):
        pm.manual_seed(seed)
        out = pm(**local)
        out.loss.backward()   # the train graph's backward runs too
        trained.append((out.loss.item(), out.logits.detach()))
    pm.eval()
    with torch.no_grad():
        again = pm(**local)
    return evaluated.loss.item(), evaluated.logits, trained, again.loss.item()


def test_llama_parallelized_in_eval_mode_drops_out_in_train_mode():
    model = _llama_with_attention_dropout()
    batch = padded_batch(vocab=model.config.vocab_size)
    with torch.no_grad():
        want = copy.deepcopy(model)(**batch).loss.item()
    for loss, _, trained, again in run_threaded(2, _eval_then_train, model, batch):
        (first, first_logits), (second, second_logits), (repeat, repeat_logits) = trained
        assert loss == pytest.approx(want, abs=1e-5) and again == pytest.approx(want, abs=1e-5)
        # float noise is ~1e-6 (threaded ranks share one intra-op pool); masks of p=0.5 move logits by ~1e-2
        assert (first_logits - second_logits).abs().max() > 1e-3, "one mask for two seeds: dropout is off"
        assert abs(first - loss) > 1e-4 and abs(second - loss) > 1e-4, "train mode gave eval's loss"
        torch.testing.assert_close(repeat_logits, first_logits, atol=1e-5, rtol=0)   # a seed draws its masks again


def _train_then_eval(rank, model, batch, want_logits):
    pm = autopar.parallelize(copy.deepcopy(model), _mesh("dp"), example_kwargs=batch, strategy="ddp")
    local = pm.plan.local_kwargs(**batch)
    with torch.no_grad():
        trained = [pm(**local).logits for _ in range(2)]
        pm.eval()
        out = pm(**local)
    (want,) = pm.plan.local_targets(want_logits)
    return out.loss.item(), (out.logits - want).abs().max().item(), trained


def test_gpt2_as_shipped_parallelized_in_train_mode_evaluates_as_one_device():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=4)
    assert config.attn_pdrop == config.resid_pdrop == 0.1   # as shipped
    model = transformers.GPT2LMHeadModel(config).train()
    batch = padded_batch(vocab=64)
    with torch.no_grad():
        want = copy.deepcopy(model).eval()(**batch)
    for loss, err, trained in run_threaded(2, _train_then_eval, model, batch, want.logits):
        assert loss == pytest.approx(want.loss.item(), abs=1e-5) and err < 1e-5
        assert (trained[0] - trained[1]).abs().max() > 1e-3   # dropout on in train mode


def _ring_then_train(rank, model, batch):
    pm = autopar.parallelize(copy.deepcopy(model), _mesh("cp"), example_kwargs=batch, strategy="cp",
                             links={"cp": cm.Link(bandwidth=1e12, latency=1e-12)})
    local = pm.plan.local_kwargs(**batch)
    rings = [name for name, _ in pm.graph_module.named_modules() if name.startswith("ring_attention")]
    with torch.no_grad():
        loss = pm(**local).loss.item()
    pm.train()
    with pytest.raises(autopar.PlanError, match="ring attention.*applies no dropout.*dropout_p=0.1"):
        pm(**local)
    return rings, loss


def test_gpt2_ring_planned_in_eval_mode_refuses_train_mode_dropout():
    """GPT-2 with attention dropout only (its eval graph has no dropout op), 3 heads on 2 ranks (no Ulysses)
    on free links: a ring, which the rules plan only for attention without dropout."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=24, n_layer=1, n_head=3,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.1)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 12))
    batch = {"input_ids": ids, "labels": ids}
    with torch.no_grad():
        want = copy.deepcopy(model)(**batch).loss.item()
    for rings, loss in run_threaded(2, _ring_then_train, model, batch):
        assert rings, "the premise: attention runs as a ring"
        assert loss == pytest.approx(want, abs=1e-5)
