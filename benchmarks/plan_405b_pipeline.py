"""Planning a 405B Llama as it ran in production, pipelined: the time to plan it and what the plan predicts.

    python benchmarks/plan_405b_pipeline.py            # checkpointing="auto"
    python benchmarks/plan_405b_pipeline.py full       # or another checkpointing mode

Issue 52's configuration: Llama 3.1 405B's shape (126 layers) on the meta device, 8192 H100s as
dp 64 x pp 16 x tp 8, strategy "fsdp+tp", interleaved 1F1B with 32 microbatches of 1 x 8192 tokens, bf16-mixed,
80 GB. Cold: the capture and solve caches are off, so the figure is a first plan's. Prints the wall and CPU
seconds and the plan's summary lines (memory, the pipeline, communication, step).
"""
import os
import sys
import time
import warnings

os.environ["AUTOPAR_SOLVE_CACHE"] = "0"
os.environ["AUTOPAR_CAPTURE_CACHE"] = "0"

import autopar  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from search_time import PIPELINE_405B, _model  # noqa: E402   (search_time.py --targets times it too)


def main():
    case = PIPELINE_405B
    options = dict(case["options"], checkpointing=sys.argv[1] if len(sys.argv) > 1 else "auto")
    model, tokens = _model(case["model"], case["layers"], case["batch"], case["seq"])
    wall, cpu = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        plan = autopar.plan(model, (tokens,), case["mesh"], hardware=case["hardware"],
                            memory_limit=case["memory_limit"], pipeline_axis=case["pipeline_axis"], time_limit=1800,
                            **options)
    print(f"planned in {time.perf_counter() - wall:.1f} s wall, {time.process_time() - cpu:.1f} s CPU")
    for line in str(plan).splitlines():
        if line.startswith(("predicted per device", "pipeline over", "communication per step", "compute ")):
            print(line)
    print(f"stages per device {plan.pipeline.stages_per_device}, reshard_after_forward "
          f"{plan.reshard_after_forward}, checkpointed {plan.checkpointed}")


if __name__ == "__main__":
    main()
