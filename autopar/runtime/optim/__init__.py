"""The optimizer side: sharded.py (ShardedOptimizer: ZeRO-split parameters step on this rank's slice),
state.py (its state_dict by parameter name, loadable under any plan), clip_grad.py (clip_grad_norm_ for
any plan)."""
