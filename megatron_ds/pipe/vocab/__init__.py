"""Vocabulary parallelism in ScheduleEngine (docs/SCHEDULES.md: Vocabulary parallelism); its messages are
part of the plan (plan/vocab_messages.py).

Read order: vocab_passes.py (one rank's EF, S, T and EW ops and what they change in the stages' ops) ->
vocab_checkpoint.py (the layer files hold the whole matrices, as the run without it writes them)."""
