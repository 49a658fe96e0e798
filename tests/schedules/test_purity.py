"""schedules/ is data in, data out: it must not import torch or deepspeed."""
import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "megatron_ds" / "schedules"


def test_no_torch_or_deepspeed_imports():
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in ("torch", "deepspeed"), f"{path} imports {name}"


def test_importing_schedules_loads_no_torch():
    code = ("import sys; "
            "import megatron_ds.schedules as s; s.simulate(s.build_schedule('zbv', 4, 8)); "
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=PKG.parents[1], capture_output=True, text=True)
    assert proc.stdout.strip() == "False", proc.stderr
