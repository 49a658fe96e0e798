"""Which top-level ds_config keys DeepSpeed knows, read from its own config modules' source.

DeepSpeed ignores a key it does not know, so a misspelt section (`"pipline"`) would run the stock
engine without a word. The known keys are the string constants of the modules DeepSpeedConfig reads
them through (runtime/config.py, the config modules it imports and their constants), taken with
`ast` instead of an import: parse_args stays torch-free and fast (~0.2 s, once), and a DeepSpeed
release that adds a key is followed without an edit here. The set holds the sections' inner keys
too, so it errs on the side of accepting.
"""
import ast
import difflib
import functools
import importlib.util
import os
import re

_KEY = re.compile(r"[a-z][a-z0-9_]*\Z")


def _source_of(root: str, package: str, node: ast.ImportFrom):
    """The file a `from X import ...` inside deepspeed names, when it is a deepspeed module."""
    parts = [p for p in (node.module or "").split(".") if p]
    if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1] + parts
    if not parts or parts[0] != "deepspeed":
        return None
    path = os.path.join(os.path.dirname(root), *parts)
    return next((f for f in (path + ".py", os.path.join(path, "__init__.py")) if os.path.exists(f)), None)


@functools.lru_cache(maxsize=None)
def deepspeed_keys() -> frozenset:
    spec = importlib.util.find_spec("deepspeed")  # finds the package without running it (no torch import)
    root = os.path.dirname(spec.origin)
    start = os.path.join(root, "runtime", "config.py")
    keys, seen, todo = set(), set(), [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        with open(path) as fh:
            tree = ast.parse(fh.read())
        folder = os.path.relpath(os.path.dirname(path), root)
        package = "deepspeed" if folder == "." else "deepspeed." + folder.replace(os.sep, ".")
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _KEY.match(node.value):
                keys.add(node.value)
            elif isinstance(node, ast.ImportFrom):
                source = _source_of(root, package, node)
                # what runtime/config.py imports (not the whole package), then config and constants modules
                if source and source != spec.origin and (path == start or re.search(r"config|constants", os.path.basename(source))):
                    todo.append(source)
    return frozenset(keys)


def unknown_keys_line(section: dict, known, where: str) -> str | None:
    """One line naming each key of `section` not in `known` with the closest known one, or None."""
    unknown = [key for key in section if key not in known]
    if not unknown:
        return None
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
        parts.append(f'"{key}"' + (f' (did you mean "{close[0]}"?)' if close else ""))
    return f"{where} has unknown key{'s' if len(unknown) > 1 else ''} {', '.join(parts)}"
