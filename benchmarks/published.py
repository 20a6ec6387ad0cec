"""torchtitan's published Llama 3 runs, planned as they ran: predicted against published tokens/s/GPU and memory.

    python benchmarks/published.py                      # every row, each plan in a child process
    python benchmarks/published.py --rows t1-8b-fsdp8,perf-405b-fsdp16-tp8
    python benchmarks/published.py --no-auto            # skip strategy="auto" on each row's mesh and memory

The rows are /work/shared/published/torchtitan-llama3.md's (copied from torchtitan's benchmark files; the
figures are measured on 8 to 512 GPUs). Each row is planned with the settings it ran with: the Llama 3
shape (built on the meta device, the loss in the graph as torchtitan computes it), the mesh (FSDP and TP
sizes as named axes, tp last so it sits inside a node), the global batch (torchtitan's local batch is per
data-parallel rank: local batch x FSDP degree sequences), the strategy, the activation checkpointing, the
hardware ("h100-hbm2e" for torchtitan's cluster, "a100" for the A100 rows), the precision (bf16-mixed, or
fp8-mixed for torchtitan's float8 rows: its tensorwise recipe on every linear but the output head, torchtitan's
filter_fqns ["output"], which autopar's default filter also holds as Hugging Face's `lm_head`), and the
device's memory as the limit. A pipelined row (PP > 1) is planned over a "pp" axis with the schedule it ran,
torchtitan's default microbatches (one per stage), and FSDP's weights kept gathered across microbatches
(torchtitan's reshard_after_forward=False under PP). A compiled row saves what torch.compile's fusion saves
in the parts torchtitan compiled (`predicted.fused_time` of Row.compiled_regions: the blocks; the loss too in
2025; a pipelined prediction claims no fusion). tokens/s/GPU is local batch x seq / (step x TP x PP x CP),
torchtitan's count.

A row whose settings autopar cannot say yet (a checkpointing mode not in autopar.cost.checkpointing.MODES) is
printed with the reason instead of a figure. A context-parallel row runs "fsdp+cp" ("fsdp+tp+cp" with TP): FSDP
over the data and context ranks together, as torchtitan's dp_shard_cp mesh (Row.strategy). Async-TP rows are
held against the vanilla-TP figure where one is published: autopar does not model async TP. Planning seconds
are per row, capture included, on this machine. Nothing here is fitted to a row: see docs/published-runs.md
for a reading.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass

GiB = 2**30
SOURCE = "/work/shared/published/torchtitan-llama3.md"
LAYERS = {"8b": 32, "70b": 80, "405b": 126}
SHAPES = {  # published Llama 3 shapes (as benchmarks/search_time.py)
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8),
    "405b": dict(hidden_size=16384, intermediate_size=53248, num_attention_heads=128, num_key_value_heads=8),
}
# torchtitan's AC names -> autopar's checkpointing modes (autopar.cost.checkpointing): per-op selective keeps
# matmul and attention outputs and recomputes the rest; layer selective checkpoints every other block
AC_MODES = {"full": "full", "per-op": "per-op", "per-layer": "per-layer"}
NUM_FLOAT8_ROWS = 16   # 14 in the December 2024 tables, 2 in the async-TP file: all in ROWS


@dataclass(frozen=True)
class Row:
    name: str
    source: str            # which published table
    model: str             # "8b", "70b", "405b"
    fsdp: int
    tp: int
    seq: int
    local_batch: int       # sequences per data-parallel rank
    ac: str                # "full", "per-op", "per-layer"
    compiled: bool
    hardware: str
    published_tps: float   # tokens/s/GPU
    published_gib: float | None   # max memory over GPUs, GiB; None where not published
    note: str = ""
    pp: int = 1
    cp: int = 1
    precision: str = "bf16-mixed"   # "fp8-mixed" for torchtitan's float8 rows
    # a pipelined row: torch's schedule as autopar names it, its microbatches (torchtitan's default: one per stage)
    # and, interleaved, the stages each device runs
    schedule: str | None = None
    microbatches: int | None = None
    stages_per_device: int | None = None
    # What `compile` compiled (autopar.cost.predict.COMPILE_REGIONS), as torchtitan did at the commit the row ran
    # at: each transformer block alone at 9dec370 (Dec 2024: `apply_compile` in parallelize_llama.py; train.py's
    # `torch.compile(loss_fn)` commented out, "compiling loss function causes CUDA errors"); the blocks and the
    # loss at 820504e (June 2025: components/loss.py compiles the loss under the same flag). The embedding, final
    # norm and output projection ran eager at both; "head" also holds the final norm and the output projection's
    # casts (a few ms on these shapes).
    compiled_regions: tuple = ("blocks",)

    @property
    def mesh(self) -> dict:
        """Named axes in torchtitan's order, pp outermost and tp last (the innermost: consecutive ranks, inside a
        node); size-1 axes left out."""
        return {k: v for k, v in (("pp", self.pp), ("dp", self.fsdp), ("cp", self.cp), ("tp", self.tp)) if v > 1}

    @property
    def strategy(self) -> str:
        """As torchtitan ran it: FSDP over the data axis, tp last; with CP the weights split over the data and
        context ranks together (its dp_shard_cp mesh), which "fsdp+cp" and "fsdp+tp+cp" do by default, also
        with no data axis (the cp8 rows: dp_shard 1)."""
        if self.cp > 1:
            return "fsdp+tp+cp" if self.tp > 1 else "fsdp+cp"
        return "fsdp+tp" if self.tp > 1 else "fsdp"

    @property
    def num_gpus(self) -> int:
        return self.fsdp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        """Sequences per step: local batch x FSDP degree (a context-parallel group shares its sequences)."""
        return self.local_batch * self.fsdp

    def tokens_per_gpu(self, step_seconds: float) -> float:
        return self.local_batch * self.seq / (step_seconds * self.tp * self.pp * self.cp)


_DEC24 = "llama3_h100_202412 table"
_JUNE25_COMPILED = ("blocks", "head")   # torchtitan 820504e compiled the loss too (Row.compiled_regions)
_ASYNC_ON = "async TP on, not modelled, and no vanilla-TP figure published"
_FP8 = "fp8-mixed"
# The float8 rows (issue 55), all compiled. Table 4's async-TP row is held against the same table's vanilla
# figure (829), the async-TP file's against theirs (809.8, 5,078.1), as the bf16 rows are.
FLOAT8_ROWS = (
    Row("t1-8b-fsdp8-float8", f"{_DEC24} 1", "8b", 8, 1, 8192, 2, "per-op", True, "h100-hbm2e", 8532, 76.8,
        precision=_FP8),
    Row("t2-8b-fsdp8-seq32k-float8", f"{_DEC24} 2", "8b", 8, 1, 32768, 1, "full", True, "h100-hbm2e", 3890, 83.9,
        precision=_FP8),
    Row("t2-8b-fsdp4-cp2-float8", f"{_DEC24} 2", "8b", 4, 1, 65536, 1, "full", True, "h100-hbm2e", 2540, 84.2,
        cp=2, precision=_FP8),
    Row("t2-8b-fsdp2-cp4-float8", f"{_DEC24} 2", "8b", 2, 1, 131072, 1, "full", True, "h100-hbm2e", 1071, 84.0,
        cp=4, precision=_FP8),
    Row("t2-8b-cp8-float8", f"{_DEC24} 2", "8b", 1, 1, 262144, 1, "full", True, "h100-hbm2e", 548, 84.5,
        cp=8, precision=_FP8),
    Row("t3-8b-fsdp128-float8", f"{_DEC24} 3", "8b", 128, 1, 8192, 2, "per-op", True, "h100-hbm2e", 8380, 61.8,
        precision=_FP8),
    Row("t4-70b-fsdp32-tp8-float8", f"{_DEC24} 4", "70b", 32, 8, 8192, 16, "full", True, "h100-hbm2e", 829, 71.9,
        precision=_FP8),
    Row("t4-70b-fsdp32-tp8-async-float8", f"{_DEC24} 4", "70b", 32, 8, 8192, 16, "full", True, "h100-hbm2e", 829,
        None, "vanilla TP figure (table 4's); async TP ran 876 (67.6 GiB), not modelled", precision=_FP8),
    Row("t5-405b-pp8-1f1b-float8", f"{_DEC24} 5", "405b", 8, 8, 8192, 32, "full", True, "h100-hbm2e", 100, 82.5,
        _ASYNC_ON, pp=8, precision=_FP8, schedule="1f1b", microbatches=8),
    # stages per device not published: microbatches = stages (torchtitan's default) of at most 32 per data-parallel
    # rank leaves 2 or 4; the smallest interleaving is taken (docs/published-runs.md gives both)
    Row("t5-405b-pp8-interleaved-float8", f"{_DEC24} 5", "405b", 8, 8, 8192, 32, "full", True, "h100-hbm2e", 128,
        72.7, f"{_ASYNC_ON}; 2 stages per device assumed (not published)", pp=8, precision=_FP8,
        schedule="interleaved-1f1b", microbatches=16, stages_per_device=2),
    Row("t6-405b-pp8-seq32k-float8", f"{_DEC24} 6", "405b", 8, 8, 32768, 8, "full", True, "h100-hbm2e", 76, 75.3,
        _ASYNC_ON, pp=8, precision=_FP8, schedule="1f1b", microbatches=8),
    Row("t6-405b-pp8-cp2-float8", f"{_DEC24} 6", "405b", 4, 8, 65536, 8, "full", True, "h100-hbm2e", 47, 75.9,
        _ASYNC_ON, pp=8, cp=2, precision=_FP8, schedule="1f1b", microbatches=8),
    Row("t6-405b-pp8-cp4-float8", f"{_DEC24} 6", "405b", 2, 8, 131072, 8, "full", True, "h100-hbm2e", 31, 77.1,
        _ASYNC_ON, pp=8, cp=4, precision=_FP8, schedule="1f1b", microbatches=8),
    Row("t6-405b-pp8-cp8-float8", f"{_DEC24} 6", "405b", 1, 8, 262144, 8, "full", True, "h100-hbm2e", 16, 84.9,
        _ASYNC_ON, pp=8, cp=8, precision=_FP8, schedule="1f1b", microbatches=8),
    Row("async-70b-fsdp32-tp8-float8", "asyncTP_llama3_h100_2025-06", "70b", 32, 8, 8192, 16, "full", True,
        "h100-hbm2e", 809.8, None, "vanilla TP figure; async TP ran 942.4, not modelled",
        compiled_regions=_JUNE25_COMPILED, precision=_FP8),
    Row("async-8b-fsdp8-tp8-float8", "asyncTP_llama3_h100_2025-06", "8b", 8, 8, 8192, 12, "per-op", True,
        "h100-hbm2e", 5078.1, None, "vanilla TP figure; async TP ran 5,570.1, not modelled",
        compiled_regions=_JUNE25_COMPILED, precision=_FP8),
)
ROWS = (
    Row("t1-8b-fsdp8", f"{_DEC24} 1", "8b", 8, 1, 8192, 2, "per-op", False, "h100-hbm2e", 5762, 82.4),
    Row("t1-8b-fsdp8-compiled", f"{_DEC24} 1", "8b", 8, 1, 8192, 2, "per-op", True, "h100-hbm2e", 6667, 77.0),
    Row("t3-8b-fsdp128", f"{_DEC24} 3", "8b", 128, 1, 8192, 2, "per-op", False, "h100-hbm2e", 5605, 67.0),
    Row("t3-8b-fsdp128-compiled", f"{_DEC24} 3", "8b", 128, 1, 8192, 2, "per-op", True, "h100-hbm2e", 6514, 62.0),
    Row("async-70b-fsdp32-tp8", "asyncTP_llama3_h100_2025-06", "70b", 32, 8, 8192, 16, "full", True, "h100-hbm2e",
        597.3, None, "vanilla TP figure; async TP ran 652.4, not modelled", compiled_regions=_JUNE25_COMPILED),
    Row("async-8b-fsdp8-tp8", "asyncTP_llama3_h100_2025-06", "8b", 8, 8, 8192, 12, "per-op", True, "h100-hbm2e",
        4378, None, "vanilla TP figure; async TP ran 4,809.4, not modelled", compiled_regions=_JUNE25_COMPILED),
    Row("perf-a100-8b-fsdp64-layer", "performance.md", "8b", 64, 1, 8192, 1, "per-layer", False, "a100", 2904, None,
        "compile not stated: planned eager"),
    Row("perf-a100-8b-fsdp64-op", "performance.md", "8b", 64, 1, 8192, 1, "per-op", False, "a100", 2973, None,
        "compile not stated: planned eager"),
    Row("perf-405b-fsdp16-tp8", "performance.md", "405b", 16, 8, 8192, 2, "full", False, "h100-hbm2e", 109, None,
        "compile not stated: planned eager"),
) + FLOAT8_ROWS
BY_NAME = {r.name: r for r in ROWS}
NAME_WIDTH = max(len(r.name) for r in ROWS)   # the printed table's first column


def not_plannable(row: Row) -> str:
    """Why autopar cannot plan the row as it ran yet; "" when it can."""
    from autopar.cost.checkpointing import MODES
    mode = AC_MODES[row.ac]
    if mode not in MODES:
        what = {"per-op": "per-op selective AC (issue 52 item 6)",
                "per-layer": "layer selective AC: every other block checkpointed"}[row.ac]
        return f"checkpointing {mode!r} (torchtitan's {what}) is not an autopar mode yet (modes: {', '.join(MODES)})"
    return ""


def llama(model: str, batch: int, seq: int):
    """(module, (tokens, labels)) on the meta device: Llama 3's shape with the loss in the graph, computed as
    torchtitan does (cross-entropy of the logits cast to float32), so its logits' memory is counted."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, num_hidden_layers=LAYERS[model], max_position_embeddings=8192,
                      rope_theta=500000.0, use_cache=False, attn_implementation="sdpa", **SHAPES[model])
    with torch.device("meta"):
        hf = LlamaForCausalLM(cfg).train()

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = hf

        def forward(self, input_ids, labels):
            logits = self.model(input_ids=input_ids, use_cache=False).logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), device="meta")
    return WithLoss(), (tokens, tokens.clone())


def plan_row(row: Row, auto: bool = False, time_limit: float | None = 600.0):
    """The Plan of `row` as it ran (auto=False) or strategy="auto" on its mesh and memory (auto=True), and the
    seconds planning took."""
    import autopar
    import cost_models as cm
    model, inputs = llama(row.model, row.global_batch, row.seq)
    options = dict(hardware=row.hardware, precision=row.precision, time_limit=time_limit,
                   memory_limit=cm.get_hardware(row.hardware).memory_bytes)
    if auto:
        options.update(strategy="auto", checkpointing="auto")
    else:
        options.update(strategy=row.strategy, checkpointing=AC_MODES[row.ac])
    if row.pp > 1:
        # torchtitan's pipeline: microbatches default to the number of stages, and FSDP keeps each weight gathered
        # from its first microbatch to the step's end ("zero-2": reshard_after_forward = not pp_enabled)
        options.update(pipeline_axis="pp", schedule=row.schedule, microbatches=row.microbatches,
                       stages_per_device=row.stages_per_device, reshard_after_forward=False)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        plan = autopar.plan(model, inputs, row.mesh, **options)
    return plan, time.perf_counter() - start


def figures(row: Row, plan, seconds: float) -> dict:
    """What the table prints of one plan: step (compiled where the row ran compiled), tokens/s/GPU, memory."""
    p = plan.predicted
    fused = sum(float(p.fused_time.get(region, 0)) for region in row.compiled_regions) if row.compiled else 0.0
    step = float(p.step_time) - fused
    return {"step_s": step, "tps": row.tokens_per_gpu(step), "gib": float(p.memory.total) / GiB,
            "seconds": seconds, "strategy": plan.strategy, "checkpointed": sorted(set(plan.checkpointed.values())),
            "roles": plan.stats.get("axis_roles", ""),
            # where the step and the memory go, for reading a row that is off
            "compute_s": float(p.compute_time), "optimizer_s": float(p.optimizer_time),
            "eager_s": float(p.step_time),
            "comm_s": {a: [float(t), float(p.exposed_comm_time.get(a, t))] for a, t in p.comm_time.items()},
            "memory_gib": {k: float(getattr(p.memory, k)) / GiB
                           for k in ("params", "master", "grads", "optimizer", "activations", "transient")}}


def one(name: str, auto: bool) -> dict:
    """One row's figures in this process, or the error that stopped it (type and message)."""
    row = BY_NAME[name]
    import autopar
    try:
        plan, seconds = plan_row(row, auto)
    except autopar.AutoparError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return figures(row, plan, seconds)


def in_child(name: str, auto: bool, timeout: float) -> dict:
    """one() in a child process of its own, so one plan's memory is not the next one's."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name] + (["--auto"] if auto else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"not planned within {timeout:.0f} s (stopped)"}
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def ratio(predicted, published) -> str:
    return f"{predicted / published:.2f}" if predicted is not None and published else "-"


def table(results: list) -> list:
    """The printed table's lines: per row, predicted against published tokens/s/GPU and memory, then auto's."""
    head = (f"{'row':<{NAME_WIDTH}} {'tok/s/GPU':>9} {'publ.':>7} {'ratio':>5}  {'GiB':>6} {'publ.':>5} {'ratio':>5}  "
            f"{'plan s':>6}  {'auto tok/s':>10} {'auto GiB':>8} {'vs row':>6}  notes")
    lines = [head, "-" * len(head)]
    for row, got, auto in results:
        if "skip" in got:
            lines.append(f"{row.name:<{NAME_WIDTH}} not plannable yet: {got['skip']}")
            continue
        if "error" in got:
            lines.append(f"{row.name:<{NAME_WIDTH}} failed: {got['error']}")
            continue
        pub_gib = f"{row.published_gib:.1f}" if row.published_gib else "-"
        auto_cols = (f"{auto['tps']:>10.0f} {auto['gib']:>8.1f} {ratio(auto['tps'], got['tps']):>6}"
                     if auto and "tps" in auto else f"{'-':>10} {'-':>8} {'-':>6}")
        notes = [row.note] if row.note else []
        if auto and "error" in auto:
            notes.append(f"auto: {auto['error'][:100]}")
        lines.append(f"{row.name:<{NAME_WIDTH}} {got['tps']:>9.0f} {row.published_tps:>7.0f} "
                     f"{ratio(got['tps'], row.published_tps):>5}"
                     f"  {got['gib']:>6.1f} {pub_gib:>5} {ratio(got['gib'], row.published_gib):>5}"
                     f"  {got['seconds']:>6.1f}  {auto_cols}  {'; '.join(notes)}")
    lines += ["", "where each row's predicted step and memory go (the row as it ran):"]
    lines += [detail(row, got) for row, got, _ in results if "tps" in got]
    lines.append("")
    lines.append(f"{NUM_FLOAT8_ROWS} float8 rows of {SOURCE}: fp8-mixed, priced as autopar's runtime runs them "
                 "(every amax all-reduced over the axes its tensor is split on; FSDP gathers in bf16).")
    lines.append("Async-TP rows are held against their vanilla-TP figure where one is published: autopar does not "
                 "model async TP.")
    return lines


def detail(row: Row, got: dict) -> str:
    """One row's breakdown: compute, optimizer and each axis's communication (exposed of total), and memory."""
    comm = ", ".join(f"{a} {t:.2f} s ({e:.2f} exposed)" for a, (t, e) in got["comm_s"].items())
    mem = ", ".join(f"{k} {v:.1f}" for k, v in got["memory_gib"].items() if v)
    compiled = f", compiled {got['step_s']:.2f} s" if row.compiled else ""
    return (f"  {row.name}: step {got['eager_s']:.2f} s eager{compiled} = compute {got['compute_s']:.2f} + "
            f"optimizer {got['optimizer_s']:.2f} + exposed comm; comm {comm}; GiB: {mem}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(BY_NAME), help="comma-separated row names")
    p.add_argument("--no-auto", action="store_true", help="skip strategy='auto' on each row's mesh and memory")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per plan")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--auto", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.auto)))
        return
    results = []
    for name in args.rows.split(","):
        row = BY_NAME[name]
        why = not_plannable(row)
        got = {"skip": why} if why else in_child(name, False, args.timeout)
        auto = None if why or args.no_auto else in_child(name, True, args.timeout)
        results.append((row, got, auto))
        print(f"# {name}: {json.dumps({'row': got, 'auto': auto})}", flush=True)
    print()
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
