#!/usr/bin/env bash
# The checks that need a GPU, in one run (CI has none): the CUDA equivalence tests and the runtime
# benchmark on a ~1B GPT, on as many GPUs as the machine has (one GPU: --dp 1, the runtime alone).
# Uses the machine's own torch (no install: a GPU box brings its CUDA build); logs go to $OUT or ./gpu_check/.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check}"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count(), 'GPUs')"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/test_cuda.py -n 4 -p no:cacheprovider -rA 2>&1 \
    | tee "$out/test_cuda.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -40
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
dp=$(( gpus >= 2 ? 2 : 1 ))
timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/runtime_overhead.py --device cuda --model 1b --batch 4 \
    --strategies "${STRATEGIES:-ddp,fsdp}" --dp "$dp" --rounds "${ROUNDS:-3}" --steps 4 --threads 4 2>&1 \
    | tee "$out/bench.log"
