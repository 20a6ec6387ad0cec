"""How long autopar.plan takes and how much memory it holds, stage by stage (Llama-3 shapes, meta device).

    python benchmarks/search_time.py                                   # 8B shape, 8/32 layers, 8x8 mesh
    python benchmarks/search_time.py --layers 8,80                     # growth with depth
    python benchmarks/search_time.py --model 70b --layers 80 --mesh a=16,b=8,c=8 --batch 64
    python benchmarks/search_time.py --compare                         # autopar compare: every strategy
    python benchmarks/search_time.py --demo                            # the README's demo (examples/train_gpt.py)
    python benchmarks/search_time.py --targets    # issue 53's rows: 8B on 8x8; 70B on 16x8x8; 405B as
                                                  # dp64 x pp16 x tp8 interleaved; 405B on 4 axes pipeline
                                                  # auto; compare on 8B; the demo; 8B at 80/126 layers

Each case runs twice, each time in a child process of its own, so its peak resident memory (ru_maxrss) is
its own: cold, then warm. Cold: the capture cache (autopar/capture/cache.py) and the solve cache
(autopar/search/solve_cache.py) are on but empty, in a temporary directory, so nothing comes from them and
the run fills them, as a user's first plan does. Warm: the same request again over the caches it filled,
as a plan made again (a script run twice, a changed print) is. It prints one summary row per case (seconds
end to end, capture included, and peak memory, cold and warm), then the stages of each run: capture,
problem build (rules, edges, activation model), every ILP solved (the role assignment, checkpointing kind,
re-gather / reshard variant, its size, build and HiGHS seconds), the pipeline cuts, and the predictions.
Timings, so a benchmark, not a test (tests/test_plan_time.py holds loose bounds on the demo); on a shared
machine, compare figures from one run only.
"""
import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings

import torch

import autopar

SHAPES = {  # published Llama-3 shapes
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8),
    "405b": dict(hidden_size=16384, intermediate_size=53248, num_attention_heads=128, num_key_value_heads=8),
}

# the README's demo, as examples/train_gpt.py plans it: a 2-layer GPT (vocab 64, 16 tokens, 4 heads, width 32),
# batch 32, on a 2 x 2 CPU mesh under a 1 MiB limit that makes "auto" split the batch and the weights
DEMO = dict(model="demo", layers=2, mesh={"x": 2, "y": 2}, batch=32, seq=16, hardware="cpu", memory_limit="1MiB",
            dynamic_shapes="auto")

# issue 52's configuration: Llama 3.1 405B as it ran in production, 8192 H100s as dp 64 x pp 16 x tp 8,
# interleaved 1F1B with 32 microbatches of 1 x 8192 tokens, bf16-mixed, 80 GB (benchmarks/plan_405b_pipeline.py
# plans it alone and prints its summary)
PIPELINE_405B = dict(model="405b", layers=126, mesh={"dp": 64, "pp": 16, "tp": 8}, batch=2048, seq=8192,
                     hardware="h100", memory_limit="80GB", dynamic_shapes="auto", pipeline_axis="pp",
                     options=dict(strategy="fsdp+tp", schedule="interleaved-1f1b", microbatches=32,
                                  precision="bf16-mixed", checkpointing="auto"))


class _Stages(logging.Handler):
    """Collects the figures autopar logs per stage at DEBUG (`record.stage`: search/ilp.py, planning/planner.py)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        if isinstance(getattr(record, "stage", None), dict):
            self.records.append(record.stage)


def _model(model_name: str, layers: int, batch: int, seq: int):
    if model_name == "demo":
        from autopar.testing import GPT, GPTConfig

        torch.manual_seed(0)
        config = GPTConfig(vocab_size=64, block_size=seq, n_layer=layers, n_head=4, n_embd=32)
        return GPT(config), torch.randint(0, config.vocab_size, (batch, seq))
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

    return Logits(), torch.randint(0, cfg.vocab_size, (batch, seq), device="meta")


def _options(case: dict) -> dict:
    """autopar.plan's options for a case: no time limit worth the name (the point is to time the search)
    unless the case gives its own."""
    return {"hardware": case["hardware"], "memory_limit": case["memory_limit"], "time_limit": 1800,
            "dynamic_shapes": case["dynamic_shapes"], **case.get("options", {})}


def run_case(case: dict) -> dict:
    """One case in this process: its figures, stages and peak resident memory."""
    handler = _Stages()
    logger = logging.getLogger("autopar")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    mesh = dict(case["mesh"])
    model, tokens = _model(case["model"], case["layers"], case["batch"], case["seq"])
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        if case.get("compare"):
            plans = autopar.compare(model, (tokens,), mesh, **_options(case))
        else:
            plan = autopar.plan(model, (tokens,), mesh, pipeline_axis=case.get("pipeline_axis"), **_options(case))
    total = time.perf_counter() - start
    if case.get("compare"):
        plan = next((p for p in plans.values() if isinstance(p, autopar.Plan)), None)
        summary = {"strategies": {k: (type(v).__name__ if isinstance(v, Exception) else
                                      round(v.predicted.step_time, 4)) for k, v in plans.items()}}
    else:
        summary = {"roles": plan.stats["axis_roles"], "checkpointed": dict(plan.checkpointed),
                   "pipeline": bool(plan.pipeline)}
    stats = plan.stats if plan is not None else {}
    return {**case, **summary, "total_seconds": total, "capture_seconds": stats.get("capture_seconds", 0.0),
            "nodes": stats.get("num_nodes"), "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "stages": handler.records, "rules_seconds": stats.get("rules_seconds", 0.0),
            "predict_seconds": stats.get("predict_seconds", 0.0)}


def _in_child(case: dict, timeout: float, env: dict) -> dict:
    try:
        out = subprocess.run([sys.executable, __file__, "--one", json.dumps(case)], capture_output=True, text=True,
                             timeout=timeout, env={**os.environ, **env})
    except subprocess.TimeoutExpired:
        return {**case, "error": f"not done after {timeout:.0f} s (stopped)"}
    if out.returncode:
        return {**case, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def cold_and_warm(case: dict, timeout: float) -> dict:
    """The case planned cold (both caches on, empty: the run fills them), then warm over what it filled."""
    with tempfile.TemporaryDirectory(prefix="autopar-search-time-") as where:
        env = {"AUTOPAR_CAPTURE_CACHE": "1", "AUTOPAR_CACHE_DIR": os.path.join(where, "captures"),
               "AUTOPAR_SOLVE_CACHE": "1", "AUTOPAR_SOLVE_CACHE_DIR": os.path.join(where, "solves")}
        cold = _in_child(case, timeout, env)
        warm = _in_child(case, timeout, env) if "error" not in cold else {**case, "error": "cold run failed"}
    return {"case": case, "cold": cold, "warm": warm}


def _label(case: dict) -> str:
    mesh = "x".join(str(n) for n in case["mesh"].values())
    what = "compare" if case.get("compare") else ("pipeline " + case["pipeline_axis"] if case.get("pipeline_axis")
                                                  else "plan")
    if case.get("options", {}).get("schedule"):
        what += f" {case['options']['schedule']}"
    return f"{case['model']} {case['layers']}L {mesh} {what}"


def _print_summary(results: list) -> None:
    header = (f"{'case':>40} {'nodes':>6} {'cold s':>8} {'cold GB':>8} {'warm s':>8} {'warm GB':>8} {'capture':>8}"
              "  result")
    print(header)
    print("-" * len(header))
    for r in results:
        cold, warm = r["cold"], r["warm"]
        if "error" in cold:
            print(f"{_label(r['case']):>40}  failed: {cold['error']}")
            continue
        result = cold.get("strategies") or f"{cold['roles']}" + (
            f" checkpointed {cold['checkpointed']}" if cold["checkpointed"] else "") + (
            " pipelined" if cold["pipeline"] else "")
        warm_text = (f"{warm['total_seconds']:>8.2f} {warm['peak_rss_bytes'] / 2**30:>8.2f}" if "error" not in warm
                     else f"{'failed':>17}")
        print(f"{_label(r['case']):>40} {cold['nodes'] or '':>6} {cold['total_seconds']:>8.2f} "
              f"{cold['peak_rss_bytes'] / 2**30:>8.2f} {warm_text} {cold['capture_seconds']:>8.2f}  {result}")
        if "error" in warm:
            print(f"{'':>40}  warm run failed: {warm['error']}")


def _print_stages(r: dict, run: str) -> None:
    if "error" in r:
        return
    ilps = [s for s in r["stages"] if s["stage"] == "ilp"]
    pipes = [s for s in r["stages"] if s["stage"] == "pipeline"]
    print(f"\n{_label(r)}, {run}: {r['total_seconds']:.2f} s, capture {r['capture_seconds']:.2f} s, problem build "
          f"{r['rules_seconds']:.2f} s, {len(ilps)} ILPs {sum(s['build_seconds'] for s in ilps):.2f} s built + "
          f"{sum(s['solve_seconds'] for s in ilps):.2f} s HiGHS, "
          + (f"{len(pipes)} pipeline cuts {sum(s['seconds'] for s in pipes):.2f} s, " if pipes else "")
          + f"predict {r['predict_seconds']:.2f} s (of the plan returned)")
    if ilps:
        print(f"  {'roles':>22} {'recompute':>10} {'regather':>8} {'reshard':>7} {'limit':>5} {'vars':>8} {'rows':>7} "
              f"{'build s':>7} {'HiGHS s':>7} status")
        for s in ilps:
            print(f"  {s['roles']:>22} {s['checkpointing']:>10} {str(s['regather']):>8} {str(s['reshard']):>7} "
                  f"{'yes' if s['limited'] else 'no':>5} {s['variables']:>8} {s['rows']:>7} {s['build_seconds']:>7.2f} "
                  f"{s['solve_seconds']:>7.2f} {s['status']}")
    for s in pipes:
        print(f"  pipeline over {s['axis']}, {s['microbatches']} microbatches, {s['schedule']}: {s['seconds']:.2f} s")


def _mesh(text: str) -> dict:
    return {k: int(v) for k, v in (part.split("=") for part in text.split(","))}


def targets(base: dict) -> list:
    """Issue 53's rows (and issue 36's 8B depths)."""
    cases = [dict(base, model="8b", layers=32, mesh=_mesh("dp=8,tp=8"), batch=16),
             dict(base, model="70b", layers=80, mesh=_mesh("a=16,b=8,c=8"), batch=64),
             PIPELINE_405B,
             dict(base, model="405b", layers=126, mesh=_mesh("a=16,b=16,c=8,d=8"), batch=256, pipeline_axis="auto"),
             dict(base, model="8b", layers=32, mesh=_mesh("dp=8,tp=8"), batch=16, compare=True),
             DEMO]
    return cases + [dict(base, model="8b", layers=n, mesh=_mesh("dp=8,tp=8"), batch=16) for n in (80, 126)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="8b", choices=sorted(SHAPES))
    p.add_argument("--layers", default="8,32", help="comma-separated depths (default: 8,32)")
    p.add_argument("--mesh", default="dp=8,tp=8", help="axes and sizes (default: dp=8,tp=8)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--hardware", default="h100")
    p.add_argument("--memory-limit", default="80GB", help="per device (default: 80GB)")
    p.add_argument("--pipeline-axis", default=None, help="e.g. auto")
    p.add_argument("--static", action="store_true",
                   help="capture with every dim as in the example (dynamic_shapes=None); the default lets "
                        "batch and sequence vary, which export takes longer to trace")
    p.add_argument("--compare", action="store_true", help="time autopar.compare (every strategy) instead")
    p.add_argument("--demo", action="store_true", help="time the README's demo plan (examples/train_gpt.py) only")
    p.add_argument("--targets", action="store_true", help="run the cases issue 53 sets targets for")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a run may take (default: 1800)")
    p.add_argument("--one", help=argparse.SUPPRESS)   # a case as JSON, run in this process (the child)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_case(json.loads(args.one))))
        return
    base = dict(seq=args.seq, hardware=args.hardware, memory_limit=args.memory_limit,
                dynamic_shapes=None if args.static else "auto")
    if args.targets:
        cases = targets(base)
    elif args.demo:
        cases = [DEMO]
    else:
        cases = [dict(base, model=args.model, layers=int(n), mesh=_mesh(args.mesh), batch=args.batch,
                      pipeline_axis=args.pipeline_axis, compare=args.compare) for n in args.layers.split(",")]
    results = []
    for case in cases:
        results.append(cold_and_warm(case, args.timeout))
        cold, warm = results[-1]["cold"], results[-1]["warm"]
        print(f"... {_label(case)}: cold {cold.get('total_seconds', float('nan')):.2f} s, "
              f"warm {warm.get('total_seconds', float('nan')):.2f} s", flush=True)
    print()
    _print_summary(results)
    for r in results:
        _print_stages(r["cold"], "cold")
        _print_stages(r["warm"], "warm")
    depth = [r["cold"] for r in results if "error" not in r["cold"] and not r["case"].get("compare")
             and r["case"]["model"] == "8b" and r["case"]["mesh"] == _mesh("dp=8,tp=8")
             and not r["case"].get("pipeline_axis")]
    if len({r["layers"] for r in depth}) > 1:
        lo, hi = min(depth, key=lambda r: r["layers"]), max(depth, key=lambda r: r["layers"])
        print(f"\n8b on 8x8, cold: {hi['layers']} layers take {hi['total_seconds'] / lo['total_seconds']:.2f}x the "
              f"time and {hi['peak_rss_bytes'] / lo['peak_rss_bytes']:.2f}x the memory of {lo['layers']}")


if __name__ == "__main__":
    main()
