"""tools/build_default_corpus.py: an offline English corpus, the same bytes on every run."""
import hashlib
import json
import os
import re
import subprocess
import sys

from megatron_ds.data import default_corpus
from megatron_ds.testing.launcher import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = child_env(ROOT)  # what `pip install .` gives a tool run as a script


def test_corpus_is_json_lines_of_unique_english_prose(tmp_path):
    out = tmp_path / "corpus.jsonl"
    docs, size = default_corpus.write_corpus(str(out), max_docs=120)  # all pydoc topics + the first modules
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == docs == 120 and size == out.stat().st_size > 300_000
    texts = [json.loads(line)["text"] for line in lines]
    assert all(set(json.loads(line)) == {"text"} for line in lines)
    assert all(len(t) >= default_corpus.MIN_CHARS for t in texts)
    # pydoc topics first, sorted by name, then stdlib modules ("name\n\ndocstring"), sorted by name.
    from pydoc_data.topics import topics
    n_topics = len({topics[k].strip() for k in topics if len(topics[k].strip()) >= default_corpus.MIN_CHARS})
    assert texts[0].startswith('The "assert" statement')
    assert texts[n_topics - 1].split("\n")[0] in {topics[k].strip().split("\n")[0] for k in topics}
    modules = [t.split("\n\n", 1)[0] for t in texts[n_topics:]]
    assert all(re.fullmatch(r"[a-z][\w.]*", m) for m in modules) and modules == sorted(modules)
    assert "argparse" in modules
    assert len(set(texts)) == len(texts)
    assert os.listdir(tmp_path) == ["corpus.jsonl"]  # the temp file was renamed


def test_cli_is_deterministic_and_honours_max_docs(tmp_path):
    script = os.path.join(ROOT, "tools", "build_default_corpus.py")
    digests = []
    for name in ("a.jsonl", "b.jsonl"):
        run = subprocess.run([sys.executable, script, "--output", str(tmp_path / name), "--max-docs", "100"],
                             capture_output=True, text=True, timeout=60, env=ENV)
        assert run.returncode == 0, run.stderr
        assert "Wrote 100 documents" in run.stderr
        digests.append(hashlib.sha256((tmp_path / name).read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) == 100
    bad = subprocess.run([sys.executable, script, "--output", str(tmp_path / "nodir" / "c.jsonl")],
                         capture_output=True, text=True, timeout=60, env=ENV)
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr
