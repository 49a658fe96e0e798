"""The ds_config's sections of model flags ("moe": moe_args.py, "rope_scaling": rope_args.py). Each key is one of
the section's flags named with underscores (its dest), its value what the flag takes; a flag given too must
agree. Read once at parse time, before the flags are checked (ArgumentsError, exit 2, before anything starts);
DeepSpeed never sees them (arguments.merge_ds_config takes them out)."""
import argparse

from megatron_ds.pipe.plan.ds_keys import unknown_keys_line

from ..errors import ArgumentsError


def flag_section(args, ds_config, section, add_args, src, what, convert=None, same=None) -> dict:
    """ds_config[section] as flag values ({flag dest: value}; {} without one). `add_args(parser)` adds the
    section's flags; `what` names them in a message ("MoE"). `convert(action, value)` gives (value, ok) for a
    flag its owner reads its own way, else None; `same(dest, given, value)` whether a flag given agrees (==)."""
    body = ds_config.get(section)
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ArgumentsError(f'ds_config "{section}" in {src} must be an object of {what} settings, got {body!r}')
    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    actions = {a.dest: a for a in parser._actions}
    unknown = unknown_keys_line(body, actions, f'ds_config "{section}" in {src}')
    if unknown:
        first = next(iter(actions.values()))
        raise ArgumentsError(f"{unknown}: its keys are the {what} flags' names with underscores "
                             f"({first.option_strings[0]}: {first.dest})")
    values = {}
    for key, raw in body.items():
        action = actions[key]
        value = ds_value(action, raw, f'ds_config "{section}.{key}" in {src}', convert)
        given = getattr(args, key, None)
        if given is not None and not (same(key, given, value) if same else given == value):
            shown = " ".join(map(str, given)) if isinstance(given, list) else given
            raise ArgumentsError(f'{action.option_strings[0]} {shown} disagrees with ds_config "{section}.{key}" = '
                                 f"{raw} in {src}; give one of them, or make them equal")
        values[key] = value
    return values


def ds_value(action, value, where, convert=None):
    """A ds_config value as the flag's parse gives it; ArgumentsError naming `where` otherwise."""
    read = convert(action, value) if convert else None
    if read is not None:
        value, ok = read
    elif action.nargs == 0:  # store_true
        ok = isinstance(value, bool)
    elif action.nargs == "+":  # a list flag given one value
        value = value if isinstance(value, list) else [value]
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    else:
        kind = action.type or str
        ok = isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)
        value = kind(value) if ok else value
        ok = ok and (action.choices is None or value in action.choices)
    if not ok:
        raise ArgumentsError(f"{where}: {value!r} is not a value {action.option_strings[0]} takes")
    return value
