"""Keyword inputs, as Hugging Face models are called: `example_kwargs=` on plan, compare and parallelize,
`plan.local_kwargs`, and `pm(**batch)` -- with the errors a wrong call gets.

The model here is small and written like an HF model (keyword arguments, a loss inside forward when
`labels=` is given, a dict out, a Python flag), so these tests run in seconds; tests/test_hf_as_shipped.py
trains the real HF models this way."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.errors import CaptureError, InputShapeError
from autopar.testing import run_threaded

VOCAB, WIDTH = 32, 16


class KeywordLM(nn.Module):
    """input_ids, attention_mask, labels by keyword; returns {"loss", "logits"} (no loss without labels)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None, scale_by_mask: bool = True):
        h = torch.tanh(self.mix(self.embed(input_ids)))
        if scale_by_mask:
            h = h * attention_mask[..., None]
        logits = self.head(h)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return out


def _batch(n=8, seq=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, seq), generator=g)
    mask = torch.ones(n, seq, dtype=torch.long)
    mask[0, 4:] = 0
    mask[-1, :2] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Exploding(nn.Module):
    """A model whose capture fails: an option must be refused before it is tried."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 4)

    def forward(self, x=None):
        raise RuntimeError("captured")


def test_plan_takes_keyword_inputs_and_shards_them():
    torch.manual_seed(0)
    batch = _batch()
    plan = autopar.plan(KeywordLM(), (), {"dp": 2}, example_kwargs=batch, strategy="ddp")
    assert plan.input_keys == ("input_ids", "attention_mask", "labels")
    # keyword tensors' dims are dynamic by default, as positional ones; the inputs' alike dims are one symbol
    # each (export traces them as batch, batch2, batch3: max_batch would then scale input_ids' terms alone)
    assert set(plan.symbols) == {"batch", "seq"}
    assert autopar.max_batch(plan, "1GiB", symbol="batch") > 8
    for rank in range(2):
        local = plan.local_kwargs(rank=rank, **batch)
        assert set(local) == set(batch)
        for k, v in batch.items():
            torch.testing.assert_close(local[k], v.chunk(2)[rank])
        index, count = plan.data_shard(rank=rank)
        assert (index, count) == (rank, 2)
    assert plan.local_inputs() == ()
    again = autopar.Plan.from_json(plan.to_json())
    assert again.input_keys == plan.input_keys
    torch.testing.assert_close(again.local_kwargs(rank=1, **batch)["labels"], batch["labels"].chunk(2)[1])


def test_positional_and_keyword_inputs_together():
    torch.manual_seed(0)
    batch = _batch()
    plan = autopar.plan(KeywordLM(), (batch["input_ids"],), {"dp": 2}, strategy="ddp",
                        example_kwargs={"attention_mask": batch["attention_mask"]})
    assert plan.input_keys == (0, "attention_mask")
    (ids,) = plan.local_inputs(batch["input_ids"], rank=1)
    torch.testing.assert_close(ids, batch["input_ids"].chunk(2)[1])
    with pytest.raises(autopar.PlanError, match="made for 1 inputs, got 2; its other inputs are keywords"):
        plan.local_inputs(batch["input_ids"], batch["attention_mask"], rank=0)


def test_compare_takes_keyword_inputs():
    torch.manual_seed(0)
    plans = autopar.compare(KeywordLM(), (), {"dp": 2}, example_kwargs=_batch(), strategies=["ddp", "fsdp"])
    assert all(isinstance(p, autopar.Plan) and p.input_keys[0] == "input_ids" for p in plans.values())


@pytest.mark.parametrize("entry", ["plan", "compare"])
def test_unknown_option_is_refused_before_the_capture(entry):
    fn = getattr(autopar, entry)
    with pytest.raises(autopar.AutoparError, match="unknown option") as info:
        fn(Exploding(), (), {"dp": 2}, example_kwargs={"x": torch.ones(2, 4)}, bogus=1)
    assert not isinstance(info.value, CaptureError)


def test_example_kwargs_must_be_a_dict():
    with pytest.raises(autopar.AutoparError, match="example_kwargs must be a dict"):
        autopar.plan(KeywordLM(), (), {"dp": 2}, example_kwargs=[torch.ones(2, 4)])


def test_a_list_input_is_refused_by_name():
    with pytest.raises(CaptureError, match="keyword input 'input_ids' is a list"):
        autopar.plan(KeywordLM(), (), {"dp": 2}, example_kwargs={"input_ids": [torch.zeros(2, 3, dtype=torch.long)]})


def _parallelize_with_bogus_option(rank):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    try:
        autopar.parallelize(Exploding(), mesh, example_kwargs={"x": torch.ones(2, 4)}, bogus=1)
    except autopar.AutoparError as e:
        return type(e).__name__, str(e)
    return None


def test_parallelize_refuses_an_unknown_option_before_the_capture():
    for name, message in run_threaded(2, _parallelize_with_bogus_option):
        assert name == "AutoparError" and "unknown option" in message and "example_kwargs=" in message


def _train_with_keywords(rank, model, batch, small, strategy, optimizer, lr):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, example_kwargs=batch, strategy=strategy)
    opt = autopar.ShardedOptimizer(pm, optimizer, lr=lr)
    losses = []
    for b in (batch, batch, small):   # the last batch of an epoch is smaller: the batch dim is dynamic
        opt.zero_grad(set_to_none=True)
        out = pm(**pm.plan.local_kwargs(**b))
        out["loss"].backward()
        opt.step()
        losses.append(out["loss"].item())
    local = pm.plan.local_kwargs(**batch)
    errors = {}
    calls = {"missing labels": {k: v for k, v in local.items() if k != "labels"},
             "an unknown keyword": {**local, "token_type_ids": local["input_ids"]},
             "another flag": {**local, "scale_by_mask": False},
             "a mask of another batch": {**local, "attention_mask": local["attention_mask"][:1]},
             "positional": None}
    for what, kwargs in calls.items():
        try:
            pm(local["input_ids"]) if kwargs is None else pm(**kwargs)
        except InputShapeError as e:
            errors[what] = str(e)
    return losses, pm.state_dict(full=True), errors


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("optimizer,lr", [(torch.optim.SGD, 0.5), (torch.optim.AdamW, 1e-2)])
def test_module_called_with_keywords_trains_like_one_device(strategy, optimizer, lr):
    torch.manual_seed(0)
    model, batch, small = KeywordLM(), _batch(), _batch(n=4, seed=1)
    ref = copy.deepcopy(model)
    opt = optimizer(ref.parameters(), lr=lr)
    want = []
    for b in (batch, batch, small):
        opt.zero_grad(set_to_none=True)
        loss = ref(**b)["loss"]
        loss.backward()
        opt.step()
        want.append(loss.item())
    for losses, params, errors in run_threaded(2, _train_with_keywords, model, batch, small, strategy, optimizer, lr):
        assert losses == pytest.approx(want, abs=1e-6)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), atol=1e-5, rtol=0)
        assert "['labels'] missing" in errors["missing labels"]
        assert "'token_type_ids' was not among the example inputs" in errors["an unknown keyword"]
        # a flag left at its default when captured is baked in as that default: another value is refused
        assert "'scale_by_mask' was not among the example inputs" in errors["another flag"]
        assert "takes 0 positional inputs" in errors["positional"]
        assert "attention_mask" in errors["a mask of another batch"] and "equal" in errors["a mask of another batch"]


def test_a_constant_the_graph_baked_in_must_be_given_again():
    from autopar.runtime.lowering.input_shapes import ordered_inputs
    x = torch.ones(2)
    assert ordered_inputs(["x"], {"flag": True, "mask": None}, (), {"x": x, "flag": True})[0] is x
    with pytest.raises(InputShapeError, match="'flag' is False, but the model was captured with True"):
        ordered_inputs(["x"], {"flag": True}, (), {"x": x, "flag": False})
    with pytest.raises(InputShapeError, match="'mask' is a tensor of shape \\(2,\\), but the model was captured with None"):
        ordered_inputs(["x"], {"mask": None}, (), {"x": x, "mask": x})
    with pytest.raises(InputShapeError, match=r"\['flag'\] missing"):
        ordered_inputs(["x"], {"flag": True}, (), {"x": x})
