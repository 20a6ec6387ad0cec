"""The README's demo and the examples run, and the demo's losses agree with one device."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args, timeout=300):
    # this checkout's autopar, whatever the environment has installed
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
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


@pytest.mark.gloo
def test_finetune_hf_example_loads_its_shards_and_trains(tmp_path):
    pytest.importorskip("transformers")
    model = str(tmp_path / "tiny-llama")
    made = _run([sys.executable, "examples/finetune_hf.py", "--make-tiny", model])
    assert made.returncode == 0, made.stderr[-3000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = _run(torchrun + ["examples/finetune_hf.py", "--model", model, "--steps", "2"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reads share 0 of 2" in proc.stdout   # fsdp on 2 ranks: each reads half of every batch
    losses = [float(x) for x in re.findall(r"step \d: loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 2 and all(5.0 < x < 6.0 for x in losses)   # a random model over 256 tokens: ~ln 256
