"""The import drawing of a package, from its source (ast), not by importing: an edge for every import of one of its
modules, at module level and inside functions alike (an import inside a function still closes a circle, it only
hides it until the call). tests/test_import_graph.py holds the house to it; tools/draw_house.py draws its folders.
"""
import ast

MARK = "# lazy:"


def modules(root, package="megatron_ds"):
    """{dotted name: (path, is a package)} of every module under root/package."""
    found = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _targets(name, is_package, node, known):
    """The package modules an import statement of module `name` loads (the most specific each names)."""
    if isinstance(node, ast.Import):
        wanted = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = name.split(".") if is_package else name.split(".")[:-1]
            base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
        wanted = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    out = []
    for target in wanted:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target:
            out.append(target)
    return out


def statement_blocks(node):
    """The statement lists directly inside `node` (its bodies, else-branches, finally and handlers)."""
    for field in ("body", "orelse", "finalbody"):
        block = getattr(node, field, None)
        if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
            yield block
    for handler in getattr(node, "handlers", ()):
        yield handler.body


def _declared(block, i, parent, lines):
    """Whether block[i] (an import) carries the mark, or its run of imports has it on a comment above."""
    if MARK in lines[block[i].lineno - 1]:
        return True
    j = i
    while j > 0 and isinstance(block[j - 1], (ast.Import, ast.ImportFrom)):
        j -= 1
    above = block[j - 1].end_lineno if j > 0 else parent.lineno
    return any(MARK in line for line in lines[above:block[j].lineno - 1])


def draw(root, package="megatron_ds"):
    """(edges {module: {module}}, [(module, line, statement)] of undeclared function-local imports)."""
    known = modules(root, package)
    edges, undeclared = {name: set() for name in known}, []
    for name, (path, is_package) in known.items():
        text = path.read_text()
        lines = text.splitlines()

        def visit(node, in_function):
            for block in statement_blocks(node):
                for i, stmt in enumerate(block):
                    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                        targets = _targets(name, is_package, stmt, known)
                        edges[name].update(targets)
                        if in_function and targets and not _declared(block, i, node, lines):
                            undeclared.append((name, stmt.lineno, lines[stmt.lineno - 1].strip()))
                    else:
                        visit(stmt, in_function or isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)))

        visit(ast.parse(text), False)
    return edges, undeclared


def circles(edges):
    """The strongly connected components of more than one module (or a module importing itself)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found
