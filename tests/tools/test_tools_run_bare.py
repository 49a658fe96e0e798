"""Every script in tools/ runs as `python tools/NAME.py` from any folder with no PYTHONPATH, after the
README's set-up alone (requirements.txt installs the clone in editable mode), as Megatron-DeepSpeed's
users run its tools."""
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BARE = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
TOOLS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tools", "**", "*.py"), recursive=True)
               if not p.endswith("__init__.py"))


def test_the_docs_name_tools_that_exist():
    text = ""
    for path in [os.path.join(ROOT, "README.md")] + glob.glob(os.path.join(ROOT, "docs", "*.md")):
        with open(path) as fh:
            text += fh.read()
    named = set(re.findall(r"(?<![\w/])tools/[a-z_/]+\.py", text))  # not the placeholder tools/NAME.py
    assert named and named <= set(TOOLS), named - set(TOOLS)


def _installed_clone(cwd):
    proc = subprocess.run([sys.executable, "-c", "import megatron_ds; print(megatron_ds.__file__)"], cwd=cwd,
                          env=BARE, capture_output=True, text=True, timeout=120)
    return os.path.dirname(os.path.dirname(proc.stdout.strip())) if proc.returncode == 0 else None


def test_every_tool_answers_help_from_another_folder(tmp_path):
    clone = _installed_clone(tmp_path)
    if clone is None:
        pytest.skip(f"megatron_ds is not installed in {sys.executable}: the README's set-up "
                    "(pip install -r requirements.txt, which holds `-e .`) installs it")
    if os.path.realpath(clone) != os.path.realpath(ROOT):
        pytest.skip(f"megatron_ds is installed from {clone}, not from this clone {ROOT}")
    procs = {tool: subprocess.Popen([sys.executable, os.path.join(ROOT, tool), "--help"], cwd=tmp_path, env=BARE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for tool in TOOLS}
    for tool, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "usage:" in out, f"python {tool} --help:\n{err[-3000:]}"
