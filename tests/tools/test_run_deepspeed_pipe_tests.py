"""tools/run_deepspeed_pipe_tests.py takes DeepSpeed's source from --source, --git-dir or the environment, and
without one says in one line how to get it (no machine's own folder as a default)."""
import subprocess

import pytest

from tools import run_deepspeed_pipe_tests as tool


def test_without_a_source_one_line_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.delenv(tool.SOURCE_VAR, raising=False)
    assert tool.main(["zbv"]) == 2
    err = capsys.readouterr().err
    tag = f"v{tool.installed_version()}"
    assert err.count("\n") == 1 and err.startswith("run_deepspeed_pipe_tests: error: DeepSpeed's tests are not in")
    assert f"git clone --depth 1 --branch {tag} https://github.com/deepspeedai/DeepSpeed" in err
    assert tool.SOURCE_VAR in err


def test_the_source_from_flags_or_the_environment(tmp_path):
    checkout = tmp_path / "DeepSpeed"
    (checkout / "tests" / "unit").mkdir(parents=True)
    assert tool.tests_source(str(checkout), None) == ("source", checkout)
    assert tool.tests_source(None, None, env={tool.SOURCE_VAR: str(checkout)}) == ("source", checkout)
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    assert tool.tests_source(None, str(checkout), env={}) == ("git", checkout / ".git")
    bare = tmp_path / "bare.git"
    subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True)
    assert tool.tests_source(None, None, env={tool.SOURCE_VAR: str(bare)}) == ("git", bare)
    assert tool.tests_source(str(checkout), str(bare), env={}) == ("source", checkout)  # --source first


@pytest.mark.parametrize("args, words", [
    ((None, "/nonexistent/ds"), "--git-dir /nonexistent/ds: no such folder"),
    (("{tmp}", None), "holds no tests/unit"),
    ((None, "{tmp}"), "not a git repository nor a checkout holding tests/unit"),
])
def test_a_wrong_source_is_one_line(tmp_path, args, words):
    args = [a.format(tmp=tmp_path) if a else a for a in args]
    with pytest.raises(tool.SourceError) as info:
        tool.tests_source(*args, env={})
    assert words in str(info.value) and "\n" not in str(info.value)
