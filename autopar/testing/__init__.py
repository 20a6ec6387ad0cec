"""autopar.testing: the harness that proves a parallel module computes what one device does, and the models tests use.

Two ways to run N ranks on a CPU:
- run_threaded (threaded.py): N threads of this process on torch's threaded
  process group. Starts in milliseconds; the workhorse of the test suite.
- run_gloo (harness.py): N real processes talking gloo over localhost TCP.
  Slow to start (each process imports torch) but nothing is simulated; for
  end-to-end checks.

single_device_reference records the numbers a parallel run must reproduce,
parallel_record what a rank of the parallel run did (harness.py); the toy
models (MLP, GPT, tiny_llama, ...) are in models.py. The library never imports
this package (tests/test_layering.py checks it).
"""

from .harness import gpt_loss, parallel_record, run_gloo, single_device_reference
from .models import (GPT, MLP, Block, CausalSelfAttention, GPTConfig, GPTWithLoss, LogitsOnly, MegatronLayer,
                     MegatronStack, WithLabels, padded_batch, pipeline_batch, pipeline_gpt, shipped_causal_lm,
                     tiny_llama)
from .threaded import RankError, run_threaded

__all__ = ["run_threaded", "run_gloo", "RankError",
           "single_device_reference", "parallel_record", "gpt_loss",
           "MLP", "GPTConfig", "CausalSelfAttention", "Block", "GPT", "GPTWithLoss", "WithLabels", "LogitsOnly",
           "MegatronLayer", "MegatronStack", "tiny_llama", "shipped_causal_lm", "padded_batch",
           "pipeline_gpt", "pipeline_batch"]
