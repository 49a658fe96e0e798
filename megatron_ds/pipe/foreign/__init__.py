"""A user's own DeepSpeed PipelineModule on our schedules (megatron_ds.initialize): above the engine core,
and nothing else in pipe/ imports it.

Read order: foreign.py (the module's layers cut into the schedule's chunks) -> foreign_engine.py (its
ScheduleEngine) -> learned_p2p.py (messages of shapes learned from the first micro-batch) ->
autograd_split.py (any layer's backward split into B and W through autograd); foreign_context.py (context
parallelism) and foreign_moe.py (MoE layers with expert parallelism) beside them."""
