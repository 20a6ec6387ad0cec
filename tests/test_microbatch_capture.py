"""A microbatch's capture derived from the whole batch's (capture/microbatch.py) for planning: equal to
a capture of the microbatch in all planning reads, the same pipelined plan, and refused where a capture at
that size may differ (a static batch, a microbatch of one, a size export does not allow)."""
import json
import warnings

import pytest
import torch

import autopar
from autopar import api
from autopar.api import microbatch_inputs
from autopar.capture.export import capture
from autopar.capture.microbatch import at_batch, microbatch_of
from autopar.capture.repeat import capture_repeated
from autopar.cost.activations import requires_grad, storage_owners
from autopar.testing import pipeline_batch, pipeline_gpt
from autopar.testing.models import seeded_llama


def _gpt():
    return pipeline_gpt(), pipeline_batch()[0]   # a batch of 8


def _llama():
    model, x, _ = seeded_llama()   # a batch of 4
    return model, x


def _dims(cap):
    """Per node, the number of dims of its traced value (the sharding rules read it)."""
    return {n.name: n.meta["val"].dim() for n in cap.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}


def _assert_same_for_planning(derived, real):
    assert [n.name for n in derived.graph.nodes] == [n.name for n in real.graph.nodes]
    for d, r in zip(derived.graph.nodes, real.graph.nodes):
        assert (d.op, d.target) == (r.op, r.target), r.name
        assert derived.info[d.name] == real.info[r.name], r.name
    assert (derived.symbols, derived.hints, derived.ranges) == (real.symbols, real.hints, real.ranges)
    assert (derived.input_names, derived.input_keys, derived.constant_inputs) == (
        real.input_names, real.input_keys, real.constant_inputs)
    assert (derived.aliases, derived.compute_dtype, derived.param_dtypes) == (
        real.aliases, real.compute_dtype, real.param_dtypes)
    # what planning reads off the traced tensors and the program: views, dims, which parameters train
    assert storage_owners(derived) == storage_owners(real)
    assert _dims(derived) == _dims(real)
    assert requires_grad(derived) == requires_grad(real)


@pytest.mark.parametrize("build, m", [(_gpt, 4), (_llama, 2)])
def test_derived_equals_a_capture_of_the_microbatch(build, m):
    model, x = build()
    whole = capture_repeated(model, (x,))
    derived = microbatch_of(whole, m)
    assert derived is not None and derived.graph is whole.graph   # no second trace
    _assert_same_for_planning(derived, capture_repeated(model, microbatch_inputs((x,), m)))


def _plan_json(plan) -> dict:
    """A plan's JSON less its timings."""
    out = json.loads(plan.to_json())
    out["stats"] = {k: v for k, v in out["stats"].items() if not k.endswith("_seconds")}
    return out


# (HF Llama's pipelined plan is left out to keep the suite short: its derived capture is checked above)
@pytest.mark.parametrize("build, options", [
    (_gpt, dict(strategy="ddp", microbatches=4, schedule="interleaved-1f1b"))])
def test_pipelined_plan_is_the_same_as_from_a_capture(build, options, monkeypatch):
    """(No time limit: under one, HiGHS's pick among equally cheap plans varies with the machine's load.)"""
    model, x = build()
    kwargs = dict(hardware="cpu", pipeline_axis="pp", time_limit=None, **options)
    calls = []
    real_capture = capture_repeated

    def counted(*args, **kw):
        calls.append(args[1][0].shape[0])
        return real_capture(*args, **kw)
    monkeypatch.setattr(api, "capture_repeated", counted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        derived = autopar.plan(model, (x,), {"pp": 2, "dp": 2}, **kwargs)
        assert calls == [x.shape[0]]   # the whole batch's capture only
        monkeypatch.setattr(api, "microbatch_of", lambda cap, m: None)   # every microbatch captured
        captured = autopar.plan(model, (x,), {"pp": 2, "dp": 2}, **kwargs)
    assert calls == [x.shape[0]] * 2 + [x.shape[0] // options["microbatches"]]
    assert derived.pipeline is not None
    assert _plan_json(derived) == _plan_json(captured)


def test_refused_where_a_capture_may_differ():
    model, x = _gpt()
    whole = capture(model, (x,))
    batch = whole.symbols["batch"]
    assert microbatch_of(whole, 8) is None   # a microbatch of one: export specializes it, static
    assert at_batch(whole, batch, 1) is None
    assert at_batch(whole, whole.symbols["seq"], 4) is None   # not the inputs' dim 0
    least, _ = whole.ranges[batch]
    assert at_batch(whole, batch, least - 1) is None
    static = capture(model, (x,), dynamic_shapes=None)
    assert not static.hints and microbatch_of(static, 2) is None


def test_a_refused_microbatch_is_captured():
    """Planning falls back to a capture at the microbatch's size, which is what it then plans."""
    model, x = _gpt()
    sizes = []

    def counted(model, inputs, dynamic_shapes, kwargs):
        sizes.append(inputs[0].shape[0])
        return capture(model, inputs, dynamic_shapes, kwargs)
    recapture = api._recapture(counted, model, (x,), {}, None)
    planning = api._for_planning(recapture)
    assert planning(2) is recapture(2) and sizes == [8, 4]   # static: the whole batch, then the microbatch
    assert planning(2) is planning(2) and sizes == [8, 4]
