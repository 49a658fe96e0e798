"""pyproject.toml: the wheel installs into a fresh venv, `import megatron_ds` works from any folder,
and the console entry points run.

The venv gets this interpreter's packages through a .pth file (torch and DeepSpeed are not
installed twice) and megatron_ds only from the wheel: --no-deps, --no-index, --no-build-isolation.
"""
import os
import shutil
import site
import subprocess
import sys
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("megatron-ds-pretrain", "megatron-ds-preprocess", "megatron-ds-preprocess-many-cores",
           "megatron-ds-merge", "megatron-ds-default-corpus", "megatron-ds-schedules")


def _run(*cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.timeout(900)
def test_wheel_installs_and_imports_from_another_folder(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"  # a copy: setuptools writes build/ and *.egg-info next to the sources
    shutil.copytree(os.path.join(ROOT, "megatron_ds"), src / "megatron_ds",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    _run(sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w",
         str(tmp_path / "dist"), cwd=src)
    wheel, = (tmp_path / "dist").glob("megatron_ds-*.whl")

    python, purelib = _venv_with_our_dependencies(tmp_path)
    _run(sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
         str(wheel), cwd=tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run(str(python), "-c", "import megatron_ds.training.checkpoint.save_load as c; print(c.__file__)",
                 cwd=elsewhere)
    assert where.splitlines()[-1].startswith(purelib), where  # (DeepSpeed prints a warning first)
    for script in SCRIPTS:
        assert (python.parent / script).exists(), script
    assert "zbv" in _run(str(python.parent / "megatron-ds-schedules"), "compare", "--pp", "4", "--micro-batches", "8",
                         cwd=elsewhere)
    assert "--pipeline-model-parallel-size" in _run(str(python.parent / "megatron-ds-pretrain"), "--help",
                                                    cwd=elsewhere)
    assert "--output-prefix" in _run(str(python.parent / "megatron-ds-preprocess"), "--help", cwd=elsewhere)


@pytest.mark.timeout(900)
def test_editable_install_imports_from_the_folder_that_holds_the_clone(tmp_path):
    """`import megatron_ds` works from any folder after the README's set-up (`-e .`), the one that holds the
    clone too: there a folder named megatron_ds (the clone; no __init__.py) with a data/ folder (the quick
    start's corpus) is on sys.path first. With setuptools' import finder, asked after every path entry,
    Python took the clone for a namespace package megatron_ds and data/ for megatron_ds.data."""
    pytest.importorskip("setuptools")
    clone = tmp_path / "megatron_ds"
    shutil.copytree(os.path.join(ROOT, "megatron_ds"), clone / "megatron_ds",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), clone / name)
    (clone / "data").mkdir()
    python, purelib = _venv_with_our_dependencies(tmp_path)
    _run(sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
         "--no-build-isolation", "-q", "-e", str(clone), cwd=tmp_path)
    where = _run(str(python), "-c", "from megatron_ds.data.tokenizer import default_gpt2_files; import megatron_ds; "
                 "print(megatron_ds.__file__)", cwd=tmp_path)
    assert where.splitlines()[-1] == str(clone / "megatron_ds" / "__init__.py"), where


def _venv_with_our_dependencies(tmp_path):
    """A new venv without pip that sees this one's site-packages (torch, DeepSpeed, ...): (its python, its
    site-packages folder)."""
    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    purelib = _run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path)
    with open(os.path.join(purelib.strip(), "deps.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    return python, purelib.strip()


def _parsed(*folders):
    """(path relative to the root, AST) of every .py file under `folders` and of pretrain_gpt.py."""
    import ast
    import glob
    paths = [os.path.join(ROOT, "pretrain_gpt.py")]
    for folder in folders:
        paths += glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True)
    for path in paths:
        with open(path) as f:
            yield os.path.relpath(path, ROOT), ast.parse(f.read(), path)


def test_no_script_edits_sys_path():
    """The package is imported as installed, or from the clone's root (`python -m`, pytest's
    pythonpath, PYTHONPATH=.): no module, tool, benchmark or test changes sys.path itself."""
    import ast
    edits = []
    for path, tree in _parsed("megatron_ds", "tools", "bench", "tests", "scripts"):
        for node in ast.walk(tree):
            # sys.path.insert(...) / .append / ..., and sys.path = ... / sys.path[...] = ...
            target = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else (
                node.targets[0] if isinstance(node, ast.Assign) else None)
            if isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Attribute) and target.attr == "path" and \
                    isinstance(target.value, ast.Name) and target.value.id == "sys":
                edits.append(f"{path}:{node.lineno}")
    assert sorted(set(edits)) == []


def test_nothing_outside_tests_imports_tests():
    """tests/ is not installed (a wheel holds megatron_ds alone): the package, tools and benchmarks take what
    they share with the tests from megatron_ds.testing."""
    import ast
    imports = []
    for path, tree in _parsed("megatron_ds", "tools", "bench", "scripts"):
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if any(name == "tests" or name.startswith("tests.") for name in names):
                imports.append(f"{path}:{node.lineno}")
    assert imports == []
