"""The linter CI runs with the tests (pyproject.toml [tool.ruff]): no undefined name, no unused import or
variable, no syntax error anywhere in the clone; its report names each finding."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_clone_passes_the_linter():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", ROOT],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
