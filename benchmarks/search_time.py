"""How long autopar.plan takes, by stage, against depth and mesh size (Llama-3 shapes, meta device).

    python benchmarks/search_time.py                                   # 8B shape, 8/32 layers, 8x8 mesh
    python benchmarks/search_time.py --layers 8,80                     # growth with depth
    python benchmarks/search_time.py --model 70b --layers 8,80 --mesh a=16,b=8,c=8 --batch 128
    python benchmarks/search_time.py --targets    # the issue's cases: 8B 8/32/80 on 8x8, 70B 8/80 on 16x8x8

Prints one row per (model, layers, mesh): graph nodes, ILP variables, the
number of searches (auto on 3+ axes tries one per role assignment), and
seconds for capture, rule expansion, building the ILP (edge costs, rows),
HiGHS, and the numeric + symbolic predictions. Repeated layers
share the ILP's variables, so only capture and the predictions grow with
depth. Timings, so a benchmark, not a test.
"""
import argparse
import time
import warnings

import torch

import autopar

SHAPES = {  # published Llama-3 shapes
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8),
}


def plan_once(model_name: str, layers: int, mesh: dict, batch: int, seq: int, hardware: str, memory_limit=None,
              dynamic_shapes="auto"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, num_hidden_layers=layers, max_position_embeddings=8192,
                      rope_theta=500000.0, use_cache=False, attn_implementation="sdpa", **SHAPES[model_name])
    with torch.device("meta"):
        hf = LlamaForCausalLM(cfg)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = hf

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), device="meta")
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        plan = autopar.plan(Logits(), (tokens,), mesh, hardware=hardware, memory_limit=memory_limit,
                            time_limit=1800, dynamic_shapes=dynamic_shapes)
    return plan, time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="8b", choices=sorted(SHAPES))
    p.add_argument("--layers", default="8,32", help="comma-separated depths (default: 8,32)")
    p.add_argument("--mesh", default="dp=8,tp=8", help="axes and sizes (default: dp=8,tp=8)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--hardware", default="h100")
    p.add_argument("--memory-limit", default=None, help="per device, e.g. 80GB (default: none)")
    p.add_argument("--static", action="store_true",
                   help="capture with every dim as in the example (dynamic_shapes=None); the default lets "
                        "batch and sequence vary, which export takes longer to trace")
    p.add_argument("--targets", action="store_true",
                   help="run the cases the planning-time targets name, and print the growth with depth")
    args = p.parse_args()
    if args.targets:
        cases = [("8b", 8, "dp=8,tp=8"), ("8b", 32, "dp=8,tp=8"), ("8b", 80, "dp=8,tp=8"),
                 ("70b", 8, "a=16,b=8,c=8"), ("70b", 80, "a=16,b=8,c=8")]
    else:
        cases = [(args.model, int(x), args.mesh) for x in args.layers.split(",")]

    header = f"{'model':>5} {'layers':>6} {'mesh':>16} {'nodes':>6} {'ILP vars':>9} {'searches':>8} " \
             f"{'capture':>8} {'rules':>6} {'build':>6} {'HiGHS':>7} {'predict':>8} {'total s':>8}  roles"
    print(header)
    print("-" * len(header))
    totals = {}
    for model, layers, mesh_text in cases:
        mesh = {k: int(v) for k, v in (part.split("=") for part in mesh_text.split(","))}
        plan, total = plan_once(model, layers, mesh, args.batch, args.seq, args.hardware, args.memory_limit,
                                None if args.static else "auto")
        totals[(model, layers, mesh_text)] = total
        s = plan.stats
        print(f"{model:>5} {layers:>6} {mesh_text:>16} {s['num_nodes']:>6} {s['num_variables']:>9} "
              f"{s['searches']:>8} {s['capture_seconds']:>8.1f} {s['rules_seconds']:>6.1f} {s['build_seconds']:>6.1f} "
              f"{s['solve_seconds']:>7.1f} {s['predict_seconds']:>8.1f} {total:>8.1f}  {s['axis_roles']}"
              + (f"  checkpointed: {','.join(plan.checkpointed)}" if plan.checkpointed else ""), flush=True)
    by_model: dict = {}
    for (model, layers, mesh_text), total in totals.items():
        by_model.setdefault((model, mesh_text), []).append((layers, total))
    for (model, mesh_text), rows in by_model.items():
        (lo, t_lo), (hi, t_hi) = min(rows), max(rows)
        if hi > lo:
            print(f"{model} on {mesh_text}: {hi} layers take {t_hi / t_lo:.2f}x the time of {lo}")


if __name__ == "__main__":
    main()
