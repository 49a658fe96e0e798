"""Checkpoints in DeepSpeed's pipeline layout with Megatron-DeepSpeed's client state.

Read order: save_load.py (save, load, and plan_load: the one policy of what loads) -> manifest.py (every
file's size and CRC-32) -> safe_load.py (weights-only loading) -> engine.py (DeepSpeed's checkpoint engine,
ours) -> relayout.py (ZeRO-1 state re-cut under another layout) -> universal.py (another TP x PP x DP through
DeepSpeed's universal checkpoint); rank_share.py shares the checks out over the ranks, recovery_script.py
writes SAVE/zero_to_fp32.py."""
