"""Vocab-parallel embedding: each rank holds a slice of the table and looks up only its own rows."""
import copy
import json

import torch

import autopar
from autopar.testing import GPT, GPTConfig, gpt_loss, parallel_record, run_threaded, single_device_reference


def _force_vocab_split(plan: autopar.Plan) -> autopar.Plan:
    """The same plan, but with the token embedding's table split along the vocab on the tp axis."""
    d = json.loads(plan.to_json())
    d["node_strategies"]["p_wte_weight"]["output"] = ["S(0)"]
    d["param_placements"]["wte.weight"] = ["S(0)"]
    d["node_strategies"]["embedding"] = {"inputs": [["S(0)"], ["R"]], "output": ["P"]}
    return autopar.Plan.from_json(json.dumps(d))


def test_vocab_parallel_embedding_trains_like_single_device():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_embd=16, n_head=2))
    idx, tgt = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    plan = _force_vocab_split(autopar.plan(model, (idx,), {"tp": 2}, strategy="tp", hardware="cpu"))
    ref = single_device_reference(lambda: copy.deepcopy(model), idx, tgt, gpt_loss, lr=1e-4)
    records = run_threaded(2, parallel_record, model, (2,), ("tp",), idx, tgt, gpt_loss, 3, 1e-4, {"plan": plan})
    for rec in records:
        assert rec["plan"].param_placements["wte.weight"] == ("S(0)",)
        torch.testing.assert_close(rec["outputs"], ref["outputs"], atol=1e-5, rtol=0)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(rec["grads"][name], g, atol=1e-5, rtol=0, msg=name)
        for name, p in ref["params"].items():
            torch.testing.assert_close(rec["params"][name], p, atol=1e-5, rtol=0, msg=name)
        # the embedding's partial sums are reduced once, in forward, on the tp axis
        assert ("all_reduce", 0, 4 * 16 * 16 * 4, "forward") in rec["comm"]
