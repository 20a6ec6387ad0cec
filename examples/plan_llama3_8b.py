"""Plan Llama-3-8B (Hugging Face LlamaForCausalLM) for 64 H100s, on a laptop, with no weights allocated.

    python examples/plan_llama3_8b.py                     # 32 layers, dp=8 x tp=8, batch 16 x seq 4096
    python examples/plan_llama3_8b.py --layers 4 --mesh dp=4,tp=16 --memory-limit 40GiB

The model is built on the meta device from the published Llama-3-8B shape
(hidden 4096, 32 heads, 8 key/value heads, MLP 14336, vocab 128256), so
nothing is allocated and nothing is downloaded; torch.export traces it with
meta tensors and autopar plans it for a mesh given as a mapping. It prints the
plan, the predicted memory per GPU broken down, the communication per mesh
axis and the time each planning stage took.

The 32 layers are the same computation on different weights, so they share
the search's variables: the ILP is the size of one layer's, and the plan
takes a few seconds (most of it torch.export).
"""
import argparse
import time
import warnings

import torch

import autopar

try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:  # transformers is a test/example dependency, not a runtime one
    raise SystemExit("this example needs Hugging Face transformers: python -m pip install transformers")

from cost_models import format_bytes


class Logits(torch.nn.Module):
    """HF returns a ModelOutput; autopar plans the logits (the loss is computed outside)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def parse_mesh(text: str) -> dict:
    return {name: int(size) for name, size in (part.split("=") for part in text.split(","))}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32, help="decoder layers (default: 32, as Llama-3-8B)")
    p.add_argument("--mesh", default="dp=8,tp=8", help="mesh axes and sizes (default: dp=8,tp=8)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--memory-limit", default="80GB", help="per GPU (default: 80GB, an H100's)")
    p.add_argument("--hardware", default="h100")
    p.add_argument("--strategy", default="auto", help="auto, or a classic: ddp, fsdp, tp, tp+sp, fsdp+tp")
    args = p.parse_args()

    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=8192, rope_theta=500000.0, use_cache=False,
                         attn_implementation="sdpa")
    with torch.device("meta"):
        model = Logits(LlamaForCausalLM(config))
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="meta")
    num_params = sum(t.numel() for t in model.parameters())
    print(f"Llama-3-8B shape with {args.layers} layers: {num_params / 1e9:.2f}B parameters (on meta, "
          f"nothing allocated); batch {args.batch} x seq {args.seq}")

    start = time.perf_counter()
    with warnings.catch_warnings():
        # HF builds its causal mask and rotary tables with ops autopar has no rule for yet;
        # they run replicated (cheap here), and the plan is still correct
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        plan = autopar.plan(model, (tokens,), parse_mesh(args.mesh), hardware=args.hardware,
                            memory_limit=args.memory_limit, strategy=args.strategy, time_limit=600)
    elapsed = time.perf_counter() - start

    print(plan)
    m = plan.predicted.memory
    print("\nper GPU: " + ", ".join(f"{k} {format_bytes(getattr(m, k))}"
                                     for k in ("params", "grads", "optimizer", "activations", "transient", "total")))
    print("per step: " + ", ".join(f"{a} {format_bytes(b)}" for a, b in plan.predicted.comm_bytes.items())
          + f"; step {plan.predicted.step_time:.3f} s")
    s = plan.stats
    print(f"planned in {elapsed:.1f} s (capture {s['capture_seconds']:.1f} s, rules {s['rules_seconds']:.1f} s, "
          f"ILP {s['solve_seconds']:.1f} s over {s['num_variables']} variables)")


if __name__ == "__main__":
    main()
