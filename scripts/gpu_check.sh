#!/usr/bin/env bash
# The checks that need a GPU, in one run (CI has none). Uses the machine's own torch (no install: a GPU box
# brings its CUDA build); each log goes to $OUT or ./gpu_check/. Sections, each under its own timeout:
#   kernels   benchmarks/gpu_kernels.py: the rates this GPU reaches on the benchmark model's kernels
#   step      benchmarks/gpu_step.py: issue 38's table, one step of a 0.886B HF Llama (labels=, bf16-mixed,
#             AdamW), eager / FSDP2 / autopar, eager and compiled, rounds alternating, with a profile
#   tests     tests/test_cuda.py: the whole-model equivalence tests on CUDA tensors
#   shape2    the step benchmark at another shape (2 x 4096 tokens: attention's share doubles), eager and
#             autopar eager, autopar compiled: the presets' efficiencies were fitted at 4 x 2048, checked here
#   published benchmarks/gpu_published_shape.py: torchtitan's Llama 3 8B per-GPU job (2 x 8192 tokens, FSDP2 bf16
#             mixed precision on one rank, per-op selective AC) cut to PUBLISHED_LAYERS layers (default 4: ~53 GiB
#             predicted), per-op eager and compiled, full AC: measured step, max allocated and max reserved against
#             autopar's prediction (docs/published-runs.md's three open gaps)
#   float8    issue 55: benchmarks/gpu_step.py's model in float8, compiled: torchao's own float8 training
#             (fsdp2 + convert_to_float8_training) against autopar's fp8-mixed (fsdp and auto), rounds
#             alternating, with the prediction's error; then benchmarks/float8_loss.py, 200 steps of
#             fp8-mixed beside bf16-mixed. torchao comes from a wheel carried in .gpu_wheels/ (the machine has
#             no network): `pip download torchao==0.18.0 --no-deps -d .gpu_wheels`, then run with
#             carry=[".gpu_wheels"]
# SECTIONS picks some (default all); SIDES, COMPILE_SIDES, STEPS, ROUNDS shape the step benchmark.
# (benchmarks/runtime_overhead.py --model 1b runs across GPUs where a machine has several.)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check}"; mkdir -p "$out"
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
sections="${SECTIONS:-kernels step tests shape2 published float8}"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name(0), torch.cuda.device_count(), 'GPUs')"
quiet() { grep -v -E "Warning|warn\(|^  warnings|USDT|^$" ; }
if [[ " $sections " == *" kernels "* ]]; then
    timeout "${KERNELS_TIMEOUT:-90}" python3 benchmarks/gpu_kernels.py 2>&1 | tee "$out/kernels.log" | quiet
fi
if [[ " $sections " == *" step "* ]]; then
    timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/gpu_step.py --profile \
        --sides "${SIDES:-eager,fsdp2,autopar-ddp,autopar-fsdp,autopar-auto}" \
        --compile-sides "${COMPILE_SIDES:-eager,fsdp2,autopar-fsdp,autopar-auto}" \
        --steps "${STEPS:-5}" --rounds "${ROUNDS:-2}" 2>&1 | tee "$out/gpu_step.log" | quiet | grep "^|\|^[0-9a-zA-Z]" | grep -v "^\[rank"
fi
if [[ " $sections " == *" tests "* ]]; then
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/test_cuda.py -n 4 -p no:cacheprovider -rA 2>&1 \
        | tee "$out/test_cuda.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -40
fi
if [[ " $sections " == *" shape2 "* ]]; then
    timeout "${SHAPE2_TIMEOUT:-120}" python3 benchmarks/gpu_step.py --batch 2 --seq 4096 --sides eager,autopar-auto \
        --compile-sides autopar-auto --steps 5 --rounds 2 2>&1 | tee "$out/gpu_step_2x4096.log" | quiet \
        | grep "^|\|^[0-9a-zA-Z]" | grep -v "^\[rank"
fi
if [[ " $sections " == *" published "* ]]; then
    timeout "${PUBLISHED_TIMEOUT:-240}" python3 benchmarks/gpu_published_shape.py --layers "${PUBLISHED_LAYERS:-4}" \
        2>&1 | tee "$out/gpu_published_shape.log" | quiet | grep -v "^\[rank\|^[WI][0-9]\{4\} "
fi
if [[ " $sections " == *" float8 "* ]]; then
    python3 -c "import torchao" 2>/dev/null || python3 -m pip install --quiet --no-deps .gpu_wheels/torchao-*.whl
    timeout "${FLOAT8_TIMEOUT:-240}" python3 benchmarks/gpu_step.py --sides torchao-fp8,autopar-fsdp-fp8,autopar-auto-fp8 \
        --compile-sides torchao-fp8,autopar-fsdp-fp8,autopar-auto-fp8 --steps 5 --rounds 2 2>&1 \
        | tee "$out/gpu_step_float8.log" | quiet | grep "^|\|^[0-9a-zA-Z]" | grep -v "^\[rank"
    timeout "${FLOAT8_LOSS_TIMEOUT:-240}" python3 benchmarks/float8_loss.py --steps 200 2>&1 \
        | tee "$out/float8_loss.log" | quiet | grep "^|\|^[0-9a-zA-Z]" | grep -v "^\[rank"
fi
