"""The plans of a few fixed planning requests, written to tests/data/plan_golden.json for
tests/test_plan_golden.py to hold the planner to.

Planning got faster by sharing and caching work (issue 36); none of that may change a plan. The
test plans these requests again and compares every chosen layout and every prediction (numbers to
1e-9, symbolic ones to 1e-9 at every size of a grid) with the file. Rewrite the file only for a change meant to change
plans, and say so in the commit:

    python scripts/plan_golden.py --write
"""
from __future__ import annotations

import argparse
import json
import pathlib
import warnings

import torch

import autopar

GOLDEN = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "plan_golden.json"
# what a plan's JSON holds that is not the plan: timings, and counts of the search's own work
NOT_THE_PLAN = ("stats",)


def _gpt():
    from autopar.testing.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32))
    return model, (torch.randint(0, 64, (8, 16)),)


def _tiny_llama():
    from autopar.testing.models import tiny_llama
    torch.manual_seed(0)
    return tiny_llama(num_layers=6), (torch.randint(0, 64, (4, 16)),)


def _llama_8b_shape():
    """Llama-3-8B's widths, 4 layers, on the meta device: the shape the planning-time targets use."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from autopar.testing.models import LogitsOnly
    cfg = LlamaConfig(vocab_size=128256, num_hidden_layers=4, max_position_embeddings=8192, rope_theta=500000.0,
                      hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LogitsOnly(LlamaForCausalLM(cfg)).train()
    return model, (torch.randint(0, 128256, (16, 4096), device="meta"),)


# name -> (model maker, mesh, plan options), each with no time limit: under one, HiGHS's pick among
# equally cheap plans varies with the machine's load (autopar.plan's docstring); a memory limit tight enough that the search weighs
# recomputation, re-gathering and resharding; a 3-axis mesh (one search per role assignment, the
# first tier infeasible for a batch of 4); a pipeline
CASES = {
    "gpt_2x2_tight": (_gpt, {"dp": 2, "tp": 2}, dict(memory_limit="1.2MB", hardware="h100", time_limit=None)),
    "gpt_pipeline": (_gpt, {"pp": 2, "dp": 2}, dict(pipeline_axis="pp", hardware="h100", time_limit=None)),
    "llama_3_axes": (_tiny_llama, {"a": 2, "b": 2, "c": 2}, dict(memory_limit="2MB", hardware="h100", time_limit=None)),
    "llama8b_8x8": (_llama_8b_shape, {"dp": 8, "tp": 8}, dict(memory_limit="80GB", hardware="h100", time_limit=None)),
}


def plan_case(name: str) -> dict:
    make, mesh, options = CASES[name]
    model, inputs = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        plan = autopar.plan(model, inputs, mesh, **options)
    d = json.loads(plan.to_json())
    for key in NOT_THE_PLAN:
        d.pop(key, None)
    return d


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help=f"write {GOLDEN.relative_to(GOLDEN.parents[2])}")
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args()
    out = {name: plan_case(name) for name in args.cases.split(",")}
    for name, d in out.items():
        print(f"{name}: step {d['predicted']['step_time']:.6g} s, memory {d['predicted']['memory']['total']:.6g} B, "
              f"checkpointed {d['checkpointed']}, regather {d['regather_activations']}, "
              f"reshard {d['reshard_after_forward']}, pipeline {bool(d['pipeline'])}")
    if args.write:
        # --cases rewrites only the cases named; the others stay as they were
        kept = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        GOLDEN.write_text(json.dumps({**kept, **out}, indent=0, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
