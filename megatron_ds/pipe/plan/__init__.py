"""The run's plan, pure data made at parse time: no torch, no DeepSpeed (training/config/ reads only this).

Read order: plan.py (PipelinePlan: schedule, placement, shapes, segments; make_plan) -> config.py (the ds_config
"pipeline" section and its checks; ds_keys.py, the top-level keys DeepSpeed knows) -> partition.py and
layout.py (the layer cuts: by cost, or as Megatron-core's written layout) -> segments.py (Seq1F1B's segments,
sequence and context parallelism's shards) -> recompute.py (Megatron's recompute groups per chunk) ->
messages.py (the point-to-point plan; vocab_messages.py, vocabulary parallelism's part of it) ->
auto_start.py ("auto"'s start: the budget, the start schedule, the AutoPlan)."""
