#!/usr/bin/env bash
# The checks that need a GPU, in one run (CI has none): the CUDA equivalence tests and the one-GPU step
# benchmark (benchmarks/gpu_step.py; benchmarks/runtime_overhead.py --model 1b runs across GPUs where there are several).
# Uses the machine's own torch (no install: a GPU box brings its CUDA build); logs go to $OUT or ./gpu_check/.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check}"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count(), 'GPUs')"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/test_cuda.py -n 4 -p no:cacheprovider -rA 2>&1 \
    | tee "$out/test_cuda.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -40
# issue 38's table: one step of a 0.886B HF Llama (labels=, bf16-mixed, AdamW), eager / FSDP2 / autopar, eager and
# compiled, rounds alternating (benchmarks/gpu_step.py)
timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/gpu_step.py --sides "${SIDES:-eager,fsdp2,autopar-ddp,autopar-fsdp,autopar-auto}" \
    --steps "${STEPS:-5}" --rounds "${ROUNDS:-2}" 2>&1 | tee "$out/gpu_step.log" | grep -v "Warning\|warn" | tail -30
