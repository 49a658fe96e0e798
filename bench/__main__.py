"""`python -m bench`: every bench with its one-line purpose (its docstring's first sentence), read without importing
it (no torch start-up); the helpers the benches share are listed apart."""
import ast
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent


def benches() -> list:
    """[(name, first docstring line, runnable)], runnable: the module has a main() (`python -m bench.NAME`)."""
    out = []
    for path in sorted(HERE.glob("*.py")):
        if path.stem.startswith("__"):
            continue
        tree = ast.parse(path.read_text())
        runnable = any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)
        out.append((path.stem, purpose(ast.get_docstring(tree) or ""), runnable))
    return out


def purpose(doc: str, width: int = 110) -> str:
    """The docstring's first sentence (its first paragraph's lines joined), cut to `width` characters."""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    sentence = text.split(". ")[0].rstrip(".")
    return sentence if len(sentence) <= width else sentence[:width - 3].rstrip() + "..."


def main(argv=None) -> int:
    rows = benches()
    width = max(len(name) for name, _, _ in rows)
    lines = ["Benches (python -m bench.NAME --help for each one's flags):"]
    lines += [f"  {name:<{width}}  {purpose}" for name, purpose, runnable in rows if runnable]
    lines += ["", "Shared by them:"]
    lines += [f"  {name:<{width}}  {purpose}" for name, purpose, runnable in rows if not runnable]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
