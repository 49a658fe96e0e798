"""The training layer. The run's own modules sit here: the loop (loop.py), what it builds (model_setup.py),
"auto"'s training side (auto_schedule.py), process groups (initialize.py), the lr schedule, the batch-size
ramp-up and logging. Three subpackages hold the rest by concern:
- config/: the flags and the ds_config, checked at parse time (arguments.py first);
- checkpoint/: saving and loading (save_load.py first);
- faults/: what a run does when something goes wrong (disk full, a signal, NaN, out of memory, a timeout).

Kept free of imports so that `pretrain_gpt.py --help` loads no torch."""
