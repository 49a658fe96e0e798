"""A small English corpus built offline from Python's own documentation.

Documents, in this fixed order:
1. every topic of `pydoc_data.topics` (the language reference's prose), by name;
2. for every pure-Python standard-library module (sorted by name), its module
   docstring followed by the docstrings of its public classes, functions and
   methods, in source order.
Sources are parsed with `ast`, never imported, so no module runs any code. The
result depends only on the Python version, never on the machine or the time.
"""
import ast
import importlib.util
import os
import sys

from megatron_ds.files import write_atomic

# Modules whose "docstrings" are not prose, or which are tests and tooling.
_SKIP_PREFIXES = ("test", "idlelib", "lib2to3", "ensurepip", "turtledemo", "this", "antigravity",
                  "__phello__", "pydoc_data", "sre_", "tkinter.test", "unittest.test", "ctypes.test")
MIN_CHARS = 200


def pydoc_topic_documents():
    from pydoc_data.topics import topics
    for name in sorted(topics):
        text = _clean(topics[name])
        if len(text) >= MIN_CHARS:
            yield text


def _stdlib_sources():
    names = sorted(n for n in getattr(sys, "stdlib_module_names", ()) if not n.startswith("_"))
    for name in names:
        if name.startswith(_SKIP_PREFIXES):
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        yield name, spec.origin
        if spec.submodule_search_locations:
            yield from _package_sources(name, list(spec.submodule_search_locations)[0])


def _package_sources(package, directory):
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if d not in ("test", "tests", "idle_test", "__pycache__")]
        rel = os.path.relpath(root, directory)
        prefix = package if rel == "." else package + "." + rel.replace(os.sep, ".")
        for f in files:
            if f.endswith(".py") and f != "__init__.py" and not f.startswith("_"):
                found.append((f"{prefix}.{f[:-3]}", os.path.join(root, f)))
    return sorted(found)  # by dotted name, whatever order the file system lists


def _module_document(name, path):
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    parts = []
    doc = ast.get_docstring(tree)
    if doc:
        parts.append(f"{name}\n\n{doc}")
    for node, qualname in _public_definitions(tree.body, ""):
        doc = ast.get_docstring(node)
        if doc:
            parts.append(f"{name}.{qualname}\n\n{doc}")
    return _clean("\n\n".join(parts))


def _public_definitions(body, outer):
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name.startswith("_"):
                continue
            qualname = f"{outer}{node.name}"
            yield node, qualname
            if isinstance(node, ast.ClassDef):
                yield from _public_definitions(node.body, qualname + ".")


def _clean(text):
    lines = [line.rstrip() for line in text.strip().splitlines()]
    return "\n".join(lines)


def iter_documents():
    seen = set()  # some pydoc topics share one text; a corpus should not repeat documents
    for text in _all_documents():
        if text not in seen:
            seen.add(text)
            yield text


def _all_documents():
    yield from pydoc_topic_documents()
    for name, path in _stdlib_sources():
        text = _module_document(name, path)
        if len(text) >= MIN_CHARS:
            yield text


def write_corpus(output, max_docs=None):
    """Write the corpus as JSON lines {"text": ...} to `output` (atomically); returns (docs, bytes)."""
    import json
    out_dir = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(out_dir):
        raise FileNotFoundError(f"--output {output}: directory {out_dir} does not exist")
    docs = 0

    def write(tmp):
        nonlocal docs
        with open(tmp, "w", encoding="utf-8") as f:
            for text in iter_documents():
                if max_docs is not None and docs >= max_docs:
                    break
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                docs += 1

    write_atomic(output, write)
    return docs, os.path.getsize(output)


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(description="Build a small English corpus (JSON lines with a 'text' "
                                            "key) from Python's documentation, with no network.")
    p.add_argument("--output", required=True, help="path of the .jsonl file to write")
    p.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")
    args = p.parse_args(argv)
    if args.max_docs is not None and args.max_docs < 1:
        print(f"error: --max-docs {args.max_docs}: must be at least 1", file=sys.stderr)
        return 2
    try:
        docs, size = write_corpus(args.output, args.max_docs)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"Wrote {docs} documents ({size / 1e6:.2f} MB) to {args.output}", file=sys.stderr)
    return 0
