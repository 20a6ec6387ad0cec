"""Runtime: the plan applied on each rank, as a module that trains like the single-device one.

Takes the `Captured` graph and a `Plan`; hands on `ParallelModule` (module.py): this rank's
shards of the parameters and a local fx graph with every collective inserted, plus
`ShardedOptimizer` (optim/sharded.py) for ZeRO-1/2 and the pipeline's stages when the plan has them.

Reading order:
- collectives.py: collectives as autograd functions (each backward is the conjugate collective);
- lowering/: the plan turned into the local graph (rewrite.py first; regather.py, recompute.py,
  vocab_parallel.py, input_shapes.py);
- reduction/: gradients reduced while backward runs, FSDP weights gathered ahead: engine.py (the
  arrive -> launch -> finish cycle and the one place collectives are issued), used by grad_buckets.py,
  layer_groups.py and zero_buckets.py;
- module.py: the module users train (module_call.py: what one call runs); store.py (the shards it
  holds), state_dict.py and initialization.py (its state, and a meta-built model's shards initialized
  from scratch); rng.py (dropout's streams per shard); observe.py (the hook audit measures through);
- optim/: ShardedOptimizer, its state_dict, clip_grad_norm_;
- pipeline/: stages under torch's schedules (stages.py cuts them, runner.py runs a train_step);
- devices.py: the device this rank computes on.
Filling the shards from a checkpoint is autopar/checkpoint/'s job.
"""
