"""The README's demo and the offline example run, and the demo's losses agree with one device."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.gloo
def test_train_gpt_demo_matches_single_device():
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    proc = _run(torchrun + ["examples/train_gpt.py", "--steps", "3"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "autopar plan" in proc.stdout
    diff = float(re.search(r"max abs loss difference over 3 steps: ([0-9.e+-]+)", proc.stdout).group(1))
    assert diff < 1e-5


def test_train_gpt_without_torchrun_says_how_to_run_it():
    proc = _run([sys.executable, "examples/train_gpt.py"])
    assert proc.returncode != 0
    assert "torchrun --nproc-per-node 4" in proc.stdout + proc.stderr


def test_plan_offline_example_runs():
    proc = _run([sys.executable, "examples/plan_offline.py"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "autopar plan" in proc.stdout and "batch" in proc.stdout


def test_plan_llama3_8b_example_runs_on_a_few_layers():
    proc = _run([sys.executable, "examples/plan_llama3_8b.py", "--layers", "1", "--batch", "8", "--seq", "512"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "autopar plan" in proc.stdout and "per GPU:" in proc.stdout
