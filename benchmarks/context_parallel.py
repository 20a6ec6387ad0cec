"""What context parallelism buys, predicted: Llama-3-8B on 8 x 8 H100s at long sequences (issue 39).

    python benchmarks/context_parallel.py                         # 32k, 64k, 128k tokens, batch 8
    python benchmarks/context_parallel.py --seqs 131072 --layers 4

For each sequence length it plans, on the meta device (nothing is allocated), in bf16-mixed with AdamW (as
`autopar plan` does by default), under an 80 GB limit:
- fsdp+cp: the sequence over the other axis (8), the weights split over both (fsdp over dp x cp, as
  torchtitan's dp_shard_cp; the note's table predates that: context_weights="whole" kept them whole on cp);
- fsdp+tp with every block recomputed, tp+sp with every block recomputed: the hand-written baselines;
- auto (which searches a context axis where no plan of its own fits, and says so where it recomputes).
It prints predicted memory per device, step time and tokens/s, or why a strategy has no plan. Predictions
only: no GPU has run these plans (docs/design/context-parallel.md).
"""
import argparse
import time
import warnings

import torch

import autopar

SHAPE_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
MESH = {"dp": 8, "tp": 8}
CASES = [("fsdp+cp", "auto"), ("fsdp+tp", "full"), ("tp+sp", "full"), ("auto", "auto")]


def _model(layers: int, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from autopar.testing.models import LogitsOnly
    cfg = LlamaConfig(vocab_size=128256, num_hidden_layers=layers, max_position_embeddings=seq,
                      rope_theta=500000.0, use_cache=False, attn_implementation="sdpa", **SHAPE_8B)
    with torch.device("meta"):
        return LogitsOnly(LlamaForCausalLM(cfg)).train()


def _attention(plan) -> str:
    """How the plan runs attention on the context axis, per distinct choice: "ring" (keys split along the
    sequence), "heads" (Ulysses: keys split by head), "gathered" (keys whole), or "-" without a context axis."""
    roles = dict(r.split("=") for r in plan.stats["axis_roles"].split(","))
    if "context" not in roles.values():
        return "-"
    axis = list(roles).index(next(a for a, r in roles.items() if r == "context"))
    keys = {s.inputs[1][axis] for n, s in plan.node_strategies.items() if n.startswith("scaled_dot_product_attention")}
    return ",".join(sorted({"S(2)": "ring", "S(1)": "heads"}.get(k, "gathered") for k in keys)) or "-"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", default="32768,65536,131072", help="sequence lengths, comma-separated")
    p.add_argument("--layers", type=int, default=32, help="decoder layers (32: the 8B model)")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    p.add_argument("--memory", default="80GB")
    args = p.parse_args()
    print(f"Llama-3-8B shape, {args.layers} layers, batch {args.batch}, mesh dp=8 x tp=8, h100, bf16-mixed, "
          f"limit {args.memory}")
    print(f"{'seq':>7}  {'strategy':<9} {'recompute':<10} {'attention':<9} {'memory/device':>13} {'step':>10} "
          f"{'tokens/s':>10}  {'plan s':>6}  note")
    for seq in (int(s) for s in args.seqs.split(",")):
        model = _model(args.layers, seq)
        x = torch.randint(0, 128256, (args.batch, seq), device="meta")
        for strategy, checkpointing in CASES:
            t0 = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    plan = autopar.plan(model, (x,), MESH, strategy=strategy, hardware="h100",
                                        memory_limit=args.memory, checkpointing=checkpointing,
                                        precision="bf16-mixed")
            except autopar.AutoparError as e:
                print(f"{seq:>7}  {strategy:<9} {checkpointing:<10} {'-':<9} {'-':>13} {'-':>10} {'-':>10}  "
                      f"{time.perf_counter() - t0:6.1f}  no plan: {str(e)[:110]}")
                continue
            pr = plan.predicted
            kinds = ",".join(sorted(set(plan.checkpointed.values()))) or "none"
            note = plan.stats.get("context", "") if strategy == "auto" else ""
            note = note or f"roles {plan.stats['axis_roles']}"
            print(f"{seq:>7}  {strategy:<9} {kinds:<10} {_attention(plan):<9} {pr.memory.total / 2**30:>9.2f} GiB "
                  f"{pr.step_time * 1e3:>7.0f} ms {args.batch * seq / pr.step_time:>10,.0f}  "
                  f"{time.perf_counter() - t0:6.1f}  {note}")


if __name__ == "__main__":
    main()
