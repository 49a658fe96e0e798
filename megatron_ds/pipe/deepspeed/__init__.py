"""DeepSpeed's private members this package touches, each kind in one audited place, checked against the
installed DeepSpeed by tests/pipe/deepspeed/.

Read order: ds_internals.py (the pipeline classes: the template methods we override, the privates we call,
read or set) -> zero_internals.py (the ZeRO optimizer's). Importing this package imports no DeepSpeed."""
