"""The import drawing of megatron_ds/: no circle, and no hidden function-local import.

Drawn from the source (ast), not by importing: an edge for every import of a package module,
at module level and inside functions alike (an import inside a function still closes a circle,
it only hides it until the call). A function-local import of a package module must be declared:
`# lazy: REASON` on its line, or on a comment line just above its block of imports. The only
reason the house accepts is a heavy import kept off a fast path (torch and DeepSpeed after the
flags are checked, the tools' --help). Imports of other packages (torch, transformers,
matplotlib) are not checked here: schedules/test_purity.py and the modules' docstrings keep them.
"""
import ast
import pathlib

from megatron_ds.testing.import_graph import MARK, statement_blocks, circles, draw, modules

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_megatron_ds_has_no_import_circle():
    edges, _ = draw(ROOT)
    assert len(edges) > 100 and edges["megatron_ds.training.loop"]  # the drawing is of the real tree
    assert circles(edges) == []


def test_every_function_local_import_of_the_package_is_declared():
    _, undeclared = draw(ROOT)
    assert undeclared == [], "\n".join(f"{m}:{line}: {stmt} (move it to the top, or say why: {MARK} ...)"
                                       for m, line, stmt in undeclared)


def test_the_drawing_finds_a_hidden_circle_and_an_undeclared_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n\n\n"
                                      "def g():\n    # lazy: heavy\n    import pkg.a\n    from .. import a\n")
    (pkg / "sub" / "c.py").write_text("def h():\n    import os\n    from pkg import a  # lazy: heavy\n")
    edges, undeclared = draw(tmp_path, "pkg")
    assert circles(edges) == [["pkg.a", "pkg.sub.b"]]
    assert undeclared == [("pkg.sub.b", 2, "from ..a import x")]


# The layers of pipe/ (docs/DESIGN.md "Layers"), bottom to top: a module imports pipe/ modules of its own
# subpackage or of a lower layer only. "" is the engine core, pipe/'s own modules.
PIPE = "megatron_ds.pipe"
PIPE_LAYERS = [("plan", "deepspeed"), ("parallel",), ("moe", "vocab"), ("",), ("foreign",), ("hf",)]
PURE = ("torch", "deepspeed", "transformers")
PIPE_PACKAGES = {p.parent.name for p in (ROOT / "megatron_ds" / "pipe").glob("*/__init__.py")}


def pipe_folder(module, pipe=PIPE):
    """The subpackage of pipe/ a module is in ("" for the core), or None outside pipe/."""
    if module != pipe and not module.startswith(pipe + "."):
        return None
    rest = module[len(pipe) + 1:].split(".")
    return rest[0] if len(rest) > 1 or rest[0] in PIPE_PACKAGES else ""  # a subpackage's __init__ is in it


def layer_breaks(edges, known, layers=PIPE_LAYERS, pipe=PIPE):
    """[(importer, imported)] of every import inside pipe/ that goes to a higher or an unrelated layer."""
    rank = {folder: i for i, group in enumerate(layers) for folder in group}
    breaks = []
    for name, targets in sorted(edges.items()):
        here = pipe_folder(name, pipe)
        if here is None or name == pipe:
            continue
        for target in sorted(targets):
            there = pipe_folder(target, pipe)
            if there is None or target == pipe or there == here:
                continue
            if there not in rank or here not in rank or rank[there] >= rank[here]:
                breaks.append((name, target))
    return breaks


def test_every_pipe_subpackage_has_a_layer():
    folders = {p.parent.name for p in (ROOT / "megatron_ds" / "pipe").glob("*/__init__.py")}
    placed = {f for group in PIPE_LAYERS for f in group if f}
    assert folders == placed, f"pipe/ subpackages without a layer: {sorted(folders - placed)}, " \
                              f"gone: {sorted(placed - folders)}"


def test_pipe_imports_only_downwards():
    edges, _ = draw(ROOT)
    assert edges["megatron_ds.pipe.engine"] and edges["megatron_ds.pipe.foreign.foreign_engine"]
    breaks = layer_breaks(edges, set(edges))
    assert breaks == [], "\n".join(f"{a} imports {b}: pipe/'s layers, bottom to top, are {PIPE_LAYERS}"
                                   for a, b in breaks)


def _imports_heavy(path):
    """The torch/DeepSpeed/transformers imports a module runs when it is imported (a function's own imports,
    `# lazy:` ones, run at their call and are not counted)."""
    found = []

    def visit(block):
        for node in block:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.Import):
                found.extend(a.name for a in node.names if a.name.split(".")[0] in PURE)
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in PURE:
                found.append(node.module)
            for inner in statement_blocks(node):
                visit(inner)

    visit(ast.parse(path.read_text()).body)
    return found


def test_pipe_plan_is_pure_data_and_training_config_reads_only_it():
    """pipe/plan/, and every package module it reaches, imports no torch, DeepSpeed or transformers at module
    level; training/config/ (parse time, torch-free) imports nothing of pipe/ but pipe/plan/."""
    edges, _ = draw(ROOT)
    known = modules(ROOT)
    seen, todo = set(), [m for m in edges if pipe_folder(m) == "plan"]
    assert "megatron_ds.pipe.plan.plan" in todo
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(edges[m])
    heavy = {m: found for m in sorted(seen) if (found := _imports_heavy(known[m][0]))}
    assert heavy == {}, f"pipe/plan/ reaches modules that import {heavy}"
    config = [(m, t) for m in edges if m.startswith("megatron_ds.training.config") for t in edges[m]
              if pipe_folder(t) is not None and pipe_folder(t) != "plan"]
    assert config == [], config


def test_the_layer_rule_finds_an_upward_import():
    edges = {"p": set(), "p.engine": {"p.plan.config", "p.moe.moe"}, "p.plan.config": {"p.engine"},
             "p.moe.moe": {"p.plan.config", "p.vocab.passes", "p.moe.other"}, "p.foreign.f": {"p.engine"},
             "p.vocab.passes": set(), "p.moe.other": set(), "q.x": {"p.foreign.f"}}
    assert layer_breaks(edges, set(edges), pipe="p") == [("p.moe.moe", "p.vocab.passes"),
                                                        ("p.plan.config", "p.engine")]
