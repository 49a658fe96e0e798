"""The parallel axes inside a pipeline stage that the engine adds to what the layers do.

Read order: context_parallel.py (the CP groups, each rank's token shard, the batch count) ->
sequence_parallel.py (Megatron's sequence parallelism: the gradient sum over the TP group once per step)."""
