"""The `dist` marker: every test that launches processes gets it at collection, so that
`pytest -m "not dist"` is the quick inner loop (one process, no ranks, no subprocesses).

A test launches processes when its function, a fixture it uses, or a parametrized value reaches, through the
functions it names, `run_ranks` (megatron_ds/testing/launcher.py), `subprocess` or `multiprocessing`. Names are
followed into the clone's test helpers (tests/, megatron_ds/testing/, bench/, tools/), not into the package
itself, whose own use of a subprocess (a compiler, a hostname) does not make a test multi-process. A test may
also say `@pytest.mark.dist` itself. The whole suite (`.ci/run`, plain `pytest`) still runs every test.
"""
import ast
import builtins
import importlib
import inspect
import pathlib
import textwrap
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HELPERS = tuple(str(ROOT / d) + "/" for d in ("tests", "megatron_ds/testing", "bench", "tools"))
LAUNCHERS = ("subprocess", "multiprocessing", "torch.multiprocessing")
HELPER_MODULES = ("tests", "megatron_ds.testing", "bench", "tools")


def _is_launcher(obj):
    """A module, function or class of subprocess / multiprocessing (run_ranks is reached through them)."""
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    return isinstance(name, str) and any(name == m or name.startswith(m + ".") for m in LAUNCHERS)


def _helper_file(obj):
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:
        return None
    return path if path and path.startswith(HELPERS) else None


def _resolve(node, scope):
    """The object a Name or a dotted Attribute of one stands for in `scope`, or None."""
    if isinstance(node, ast.Name):
        return scope.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, scope)
        if isinstance(base, (types.ModuleType, type)):
            return inspect.getattr_static(base, node.attr, None)
    return None


def _imported(node):
    """What a function-local `import X` / `from X import y` brings in, where it is a launcher or a helper."""
    found = []
    for alias in node.names:
        module = node.module if isinstance(node, ast.ImportFrom) else alias.name
        if not module or getattr(node, "level", 0):
            continue
        if any(module == m or module.startswith(m + ".") for m in LAUNCHERS):
            return [importlib.import_module(LAUNCHERS[0])]  # any launcher will do: the answer is yes
        if not module.startswith(HELPER_MODULES):
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        found.append(getattr(mod, alias.name, None) if isinstance(node, ast.ImportFrom) else mod)
    return found


class Launches:
    """launches(obj): whether calling obj (a function, a class of helpers, a value) may start a process."""

    def __init__(self):
        self.memo = {}

    def __call__(self, obj):
        obj = inspect.unwrap(getattr(obj, "__func__", obj))
        if _is_launcher(obj):
            return True
        key = id(obj)
        if key in self.memo:
            return self.memo[key]
        self.memo[key] = False  # a cycle answers no until the walk says otherwise
        self.memo[key] = answer = self._walk(obj)
        return answer

    def _walk(self, obj):
        if isinstance(obj, type):
            return _helper_file(obj) is not None and any(
                self(member) for member in vars(obj).values() if inspect.isfunction(member))
        if not inspect.isfunction(obj) or _helper_file(obj) is None:
            return False
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
        except (OSError, SyntaxError):
            return False
        scope = {**vars(builtins), **obj.__globals__}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = _imported(node)
            elif isinstance(node, (ast.Name, ast.Attribute)):
                targets = [_resolve(node, scope)]
            else:
                continue
            if any(t is not None and t is not obj and self(t) for t in targets):
                return True
        return False


_launches = Launches()


def _launching(item):
    if _launches(item.obj):
        return True
    for name in item.fixturenames:
        for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
            if _launches(fixturedef.func):
                return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(callable(value) and _launches(value) for value in params.values())


def pytest_collection_modifyitems(config, items):
    for item in items:
        if isinstance(item, pytest.Function) and not item.get_closest_marker("dist") and _launching(item):
            item.add_marker(pytest.mark.dist)
