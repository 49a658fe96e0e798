"""The ds_config's "context_parallel" section: its keys, the attention's comm types, and the one check of its shape
(torch-free).

Both readers of the section take it from here: the flags at parse time (training/config/parallel_args.py, which
merges it with --context-parallel-size and --cp-comm-type) and megatron_ds.initialize for a user's own
PipelineModule (pipe/foreign/foreign_context.py). Each raises its own UserError with the line `section_problem`
gives, so a bad section reads alike on both paths; a key or a comm type is added here once (and the comm type's
attention in model/context_parallel/attend.py).
"""
SECTION = "context_parallel"
COMM_TYPES = ("p2p", "allgather", "a2a", "a2a+p2p")  # --cp-comm-type's choices, and the section's
HIERARCHICAL = "hierarchical_context_parallel_sizes"  # a2a+p2p's [A, P]
# the section's keys (the flags' dests) and the value each takes when neither the flag nor the section gives it
DEFAULTS = {"context_parallel_size": 1, "cp_comm_type": "p2p", HIERARCHICAL: None}
KEYS_TEXT = ", ".join(list(DEFAULTS)[:-1]) + " and " + list(DEFAULTS)[-1]


def flags_problem(size, comm) -> str:
    """Why --context-parallel-size `size` and --cp-comm-type `comm` cannot work, in one line ('' when they can):
    the flags' values as GPTConfig and the schedules' cost model check them (argparse has checked given flags)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return f"--context-parallel-size must be a whole number >= 1, got {size!r}"
    if comm not in COMM_TYPES:
        return f"--cp-comm-type {comm!r}: choose one of {', '.join(COMM_TYPES)}"
    return ""


def section_of(ds_config: dict):
    """The section as the ds_config gives it ({} when absent or null); check it with `section_problem` first."""
    section = ds_config.get(SECTION)
    return {} if section is None else section


def section_problem(ds_config: dict) -> str:
    """Why the ds_config's "context_parallel" section cannot work, in one line ('' when it can): an object of the
    known keys, the size a whole number >= 1, the comm type one of COMM_TYPES, a2a+p2p's sizes two whole numbers
    (whether they fit the size and comm type: parallel_layout.hierarchical_problem, once both are merged)."""
    section = section_of(ds_config)
    if not isinstance(section, dict):
        return f'ds_config "{SECTION}" must be an object of {KEYS_TEXT}, got {section!r}'
    unknown = sorted(set(section) - set(DEFAULTS))
    if unknown:
        return (f'ds_config "{SECTION}" has unknown key{"s" if len(unknown) > 1 else ""} '
                f'{", ".join(map(repr, unknown))}: its keys are {KEYS_TEXT}')
    size, comm = section.get("context_parallel_size"), section.get("cp_comm_type")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        return f'ds_config "{SECTION}.context_parallel_size" = {size!r}: a whole number of ranks, 1 or more'
    if comm is not None and comm not in COMM_TYPES:
        return f'ds_config "{SECTION}.cp_comm_type" = {comm!r}: one of {", ".join(COMM_TYPES)}'
    sizes = section.get(HIERARCHICAL)
    if sizes is not None and not (isinstance(sizes, list) and len(sizes) == 2
                                  and all(isinstance(n, int) and not isinstance(n, bool) for n in sizes)):
        return (f'ds_config "{SECTION}.{HIERARCHICAL}" = {sizes!r}: two whole numbers [A, P], as '
                "--hierarchical-context-parallel-sizes A P")
    return ""
