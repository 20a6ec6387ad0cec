"""The `autopar` command: lay a Hugging Face model out on a mesh from the terminal, before any launch.

    autopar plan MODEL --mesh dp=8,tp=8 [--hardware h100] [--memory 80GB] [--batch 8] [--seq 4096]
                 [--precision bf16-mixed] [--strategy auto] [--pipeline AXIS|auto] [--json plan.json]
    autopar compare MODEL --mesh dp=8,tp=8 [...]     every named strategy side by side
    autopar show plan.json                            a saved plan, printed again

MODEL is a config.json, a directory holding one (what `save_pretrained` writes), or a Hugging Face
model id found in the local cache; nothing is downloaded. The model is built on the meta device with
transformers' AutoModelForCausalLM.from_config, so no weight is read or allocated, and planned as shipped:
called with keywords, `model(input_ids=...)`, its config's use_cache as it is (capture/caches.py).

Exit status: 0 done; 1 no plan fits (the message says what would); 2 bad input (one line on stderr).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import warnings

import torch

import cost_models as cm

from .api import compare, plan
from .errors import AutoparError, InfeasiblePlanError, UnsupportedOpWarning
from .planning.result import Plan
from .planning.progress import say, shown
from .search.classics import CONTEXT_WEIGHTS, STRATEGIES
from .whatif import max_batch


class CliError(Exception):
    """Bad input: printed as one line, exit status 2."""


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except CliError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2
    except InfeasiblePlanError as e:
        print(f"autopar: {e}", file=sys.stderr)
        return 1
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(required=True, metavar="{plan,compare,show}")
    for name, run, what in (("plan", _plan, "the best plan for MODEL on the mesh"),
                            ("compare", _compare, "every named strategy for MODEL side by side")):
        s = sub.add_parser(name, help=what, description=what)
        s.set_defaults(run=run)
        s.add_argument("model", metavar="MODEL", help="config.json, a directory with one, or a cached HF model id")
        s.add_argument("--mesh", required=True, type=_mesh, help="axis sizes, e.g. dp=8,tp=8")
        s.add_argument("--hardware", default="h100", help=f"a preset ({', '.join(sorted(cm.PRESETS))}) or the "
                       "JSON spec autopar.calibrate wrote (default: h100)")
        s.add_argument("--memory", default=None, help="memory per device, e.g. 80GB (default: no limit)")
        s.add_argument("--batch", type=int, default=8, help="global batch in sequences (default: 8)")
        s.add_argument("--seq", type=int, default=4096, help="sequence length in tokens (default: 4096)")
        s.add_argument("--precision", default="bf16-mixed",
                       help="bf16-mixed (default: what large models train with) or fp32")
        s.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd or sgd-momentum")
        s.add_argument("--bucket-mb", type=float, default=None, metavar="MIB",
                       help="gradient bucket size in MiB (default: DDP's 25): the data-parallel all-reduces a "
                            "step, and the bytes each holds, which the plan's communication and memory count")
        s.add_argument("--reshard-after-forward", default=None, choices=("true", "false", "auto"),
                       help="FSDP weights: true gathers each again in backward, false keeps it whole from "
                            "forward to backward (one all-gather fewer a layer, its bytes more), auto lets the "
                            "search pick (default: true for a named strategy, auto under --strategy auto)")
        s.add_argument("--context-weights", default=None, choices=CONTEXT_WEIGHTS,
                       help="how cp axes store weights: split (FSDP over them) or whole (as ddp) (default: split "
                            "under fsdp+cp and fsdp+tp+cp, whole under cp, the search's choice under auto)")
        if name == "plan":
            s.add_argument("--strategy", default="auto", choices=STRATEGIES, help="default: auto")
            s.add_argument("--pipeline", default=None, metavar="AXIS|auto",
                           help="pipeline over this mesh axis, or let the search decide (default: none)")
            s.add_argument("--json", default=None, metavar="FILE", help="also write the plan as JSON")
        s.add_argument("--plot", default=None, metavar="FILE.png",
                       help="also draw memory per device (and a pipeline's schedule, to FILE-schedule.png); "
                            "needs matplotlib")
    s = sub.add_parser("show", help="print a plan saved with --json", description="print a plan saved with --json")
    s.set_defaults(run=_show)
    s.add_argument("path", metavar="PLAN_JSON")
    return p


def _mesh(text: str) -> dict:
    try:
        mesh = {name.strip(): int(size) for name, size in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give axis=size pairs, e.g. dp=8,tp=8") from None
    if not mesh or any(n < 1 for n in mesh.values()):
        raise argparse.ArgumentTypeError(f"{text!r}: every axis needs a positive size")
    return mesh


# ---------------------------------------------------------------- the model

def load_config(model: str):
    """The model's transformers config: from a config.json, a directory with one, or the local HF cache."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise CliError("reading a model config needs Hugging Face transformers: pip install transformers") from None
    path = pathlib.Path(model)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise CliError(f"directory {model} has no config.json")
    if path.is_file() or model.endswith(".json"):
        if not path.is_file():
            raise CliError(f"no file {path}")
        with open(path) as f:
            d = json.load(f)
        if "model_type" not in d:
            raise CliError(f"{path} has no model_type: not a Hugging Face config.json")
        return AutoConfig.for_model(**d)
    try:
        return AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError):
        raise CliError(f"{model!r} is not a file, a directory with a config.json, or a model in the local Hugging "
                       "Face cache (nothing is downloaded: fetch its config.json first, e.g. "
                       f"`huggingface-cli download {model} config.json`)") from None


def build(config) -> torch.nn.Module:
    """The causal LM of `config` on the meta device, as shipped (called with input_ids=, logits out; the
    loss is the training loop's)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _inputs(config, args) -> dict:
    """The keyword inputs the model is planned with: a batch of token ids."""
    if args.batch < 1 or args.seq < 1:
        raise CliError(f"--batch {args.batch} --seq {args.seq}: both must be positive")
    return {"input_ids": torch.randint(0, config.vocab_size, (args.batch, args.seq), device="meta")}


def _options(args) -> dict:
    options = {"hardware": args.hardware, "memory_limit": args.memory, "optimizer": args.optimizer,
               "precision": None if args.precision in ("fp32", "float32", "none") else args.precision}
    if args.bucket_mb is not None:
        if not args.bucket_mb > 0:
            raise CliError(f"--bucket-mb {args.bucket_mb}: must be a positive number of MiB")
        options["bucket_bytes"] = max(1, int(args.bucket_mb * 2**20))
    if args.reshard_after_forward is not None:
        options["reshard_after_forward"] = {"true": True, "false": False, "auto": "auto"}[args.reshard_after_forward]
    if args.context_weights is not None:
        options["context_weights"] = args.context_weights
    return options


def _planned(fn, *args, **kwargs):
    """fn(*args, **kwargs), its warnings summed up on stderr: an op without a sharding rule (it runs
    replicated) warns once per op, and a big model has dozens."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args, **kwargs)
    replicated = sorted({str(w.message).split(" for ", 1)[-1].split(" ", 1)[0] for w in caught
                         if issubclass(w.category, UnsupportedOpWarning)})
    if replicated:
        print(f"note: {len(replicated)} op kind(s) without a sharding rule run replicated: "
              f"{', '.join(replicated[:8])}{' ...' if len(replicated) > 8 else ''}", file=sys.stderr)
    for message in dict.fromkeys(str(w.message) for w in caught if not issubclass(w.category, UnsupportedOpWarning)):
        print(f"warning: {message}", file=sys.stderr)
    return out


# ---------------------------------------------------------------- commands

def _model(args, what: str) -> tuple:
    """(the model on meta, its example keyword inputs, the start time), with a line saying what is planned."""
    start = time.perf_counter()
    config = load_config(args.model)
    model = build(config)
    say(f"{_describe(config, model)}; planning {what} for batch {args.batch} x seq {args.seq} on "
        f"{_mesh_text(args.mesh)} ({args.hardware})", start)
    return model, _inputs(config, args), start


def _plan(args) -> int:
    model, inputs, start = _model(args, f"strategy {args.strategy}")
    with shown(True, start=start):   # from the start, terminal or log: the command is run to watch it plan
        p = _planned(plan, model, (), args.mesh, example_kwargs=inputs, strategy=args.strategy,
                     pipeline_axis=args.pipeline, **_options(args))
    say("planned", start)
    print(p)
    tokens = args.batch * args.seq
    print(f"\ntokens/s: {tokens / p.predicted.step_time:,.0f} predicted ({tokens} tokens a step, "
          f"{p.predicted.step_time:.3f} s)")
    if args.memory is not None:
        print(f"largest batch that fits {args.memory} per device: {_largest_batch(p, args.memory)}")
    if args.json:
        pathlib.Path(args.json).write_text(p.to_json())
        print(f"plan written to {args.json} (autopar show {args.json})")
    if args.plot:
        _plot(p, args.plot, args.memory)
    return 0


def _plot(plans, path: str, memory) -> None:
    from .planning.plots import memory_figure, schedule_figure
    memory_figure(plans, memory).savefig(path)
    print(f"memory per device drawn to {path}")
    if isinstance(plans, Plan) and plans.pipeline is not None:
        out = pathlib.Path(path)
        schedule = out.with_name(f"{out.stem}-schedule{out.suffix}")
        try:
            schedule_figure(plans).savefig(schedule)
            print(f"pipeline schedule drawn to {schedule}")
        except AutoparError as e:
            print(f"note: {e}", file=sys.stderr)


def _largest_batch(p: Plan, memory) -> str:
    try:   # the model's input is traced with dynamic batch and sequence dims: the batch is dim 0's symbol
        return str(max_batch(p, memory, symbol="batch" if "batch" in p.symbols else None))
    except AutoparError as e:
        return f"unknown ({str(e).splitlines()[0]})"


def _compare(args) -> int:
    model, inputs, start = _model(args, "every strategy")
    with shown(True, start=start):   # from the start, terminal or log: the command is run to watch it plan
        plans = _planned(compare, model, (), args.mesh, example_kwargs=inputs, **_options(args))
    say("planned", start)
    print(compare_table(plans, args.batch * args.seq, args.memory))
    if args.plot:
        _plot(plans, args.plot, args.memory)
    return 0


def compare_table(plans: dict, tokens: int, memory) -> str:
    """One row per strategy: memory per device, communication per step, step time, tokens/s, fits."""
    limit = cm.parse_bytes(memory) if memory is not None else None
    head = f"{'strategy':<9} {'memory/device':>14} {'comm/step':>12} {'step':>10} {'tokens/s':>12}  fits"
    lines = [head, "-" * len(head)]
    for name, p in plans.items():
        if isinstance(p, AutoparError):
            lines.append(f"{name:<9} {'-':>14} {'-':>12} {'-':>10} {'-':>12}  no: {str(p).splitlines()[0][:100]}")
            continue
        pred = p.predicted
        fits = "yes" if limit is None or pred.memory.total <= limit else "no"
        lines.append(f"{name:<9} {cm.format_bytes(pred.memory.total):>14} "
                     f"{cm.format_bytes(sum(pred.comm_bytes.values())):>12} {pred.step_time * 1e3:>8.1f} ms "
                     f"{tokens / pred.step_time:>12,.0f}  {fits}")
    return "\n".join(lines)


def _show(args) -> int:
    path = pathlib.Path(args.path)
    if not path.is_file():
        raise CliError(f"no plan file at {path}")
    try:
        print(Plan.from_json(path.read_text()))
    except (json.JSONDecodeError, KeyError) as e:
        raise CliError(f"{path} is not a plan autopar wrote ({type(e).__name__}: {e})") from None
    return 0


def _describe(config, model) -> str:
    n = sum(t.numel() for t in model.parameters())
    return f"{type(model).__name__} ({config.model_type}, {n / 1e9:.2f}B parameters, on meta)"


def _mesh_text(mesh: dict) -> str:
    return " x ".join(f"{k}={v}" for k, v in mesh.items())


if __name__ == "__main__":
    sys.exit(main())
