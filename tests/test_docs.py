"""The docs stay equal to what they describe: DESIGN.md's schedule names to the catalogue and its error list to
the UserError subclasses; the layout blocks of DESIGN.md and README.md to the package tree; every file path
the README, tests/README.md and docs/*.md cite to a file; the README opens with the two commands that work on a
fresh clone and is a door to every room of docs/. A module added, moved or removed without its line fails here."""
import ast
import pathlib
import re

from megatron_ds.schedules import CATALOG

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "megatron_ds"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "tests" / "README.md"] + DOCS  # every page whose paths and links are checked


def tree():
    """(subpackages, top-level modules, each room's modules) of megatron_ds/, as DESIGN.md's layout names them."""
    packages = {p.name + "/" for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    top = {p.name for p in PKG.glob("*.py") if p.name != "__init__.py"}
    return (packages, top) + tuple(room_tree(room) for room in ROOMS)


ROOMS = ("training", "pipe")  # the packages whose every module and subpackage DESIGN.md's layout lists


def room_tree(room):
    """A room's modules and subpackages, as `loop.py`, `config/` and `config/arguments.py`."""
    names = {str(p.relative_to(PKG / room)) for p in (PKG / room).rglob("*.py") if p.name != "__init__.py"}
    return names | {str(p.parent.relative_to(PKG / room)) + "/" for p in (PKG / room).glob("*/__init__.py")}


def all_packages():
    """Every package under megatron_ds/ at any depth, as `model/tensor_parallel/`."""
    return {str(p.parent.relative_to(PKG)) + "/" for p in PKG.rglob("__init__.py") if p.parent != PKG}


def layout_entries(doc):
    """(indent, [names]) of each entry line of the doc's first code block after its layout heading: the
    names before the description (two or more spaces). Wrapped descriptions (deep indents) are skipped."""
    text = (ROOT / doc).read_text()
    heading = "## Layers" if doc.endswith("DESIGN.md") else "## Layout"
    block = text[text.index(heading):].split("```")[1]
    entries = []
    for line in block.splitlines()[1:]:
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent > 8:
            continue
        head = re.split(r"\s{2,}", line.strip())[0]
        entries.append((indent, [n for n in re.split(r"[,\s]+", head) if n]))
    return entries


def design_listed():
    """(packages, top-level modules, then each room's modules) DESIGN.md's layout names: `megatron_ds/` at indent
    0, its packages and modules at 2, a room's (training/, pipe/) modules and subpackages at 4, a subpackage's
    modules at 6 (as `config/arguments.py`)."""
    packages, top, rooms = set(), set(), {room: set() for room in ROOMS}
    inside, room, sub = False, None, ""
    for indent, names in layout_entries("docs/DESIGN.md"):
        if indent == 0:
            inside, room = names[0] == "megatron_ds/", None
            continue
        if indent == 2:
            room = names[0].rstrip("/") if inside and names[0].rstrip("/") in ROOMS else None
        elif room:
            sub = names[0] if indent == 4 and names[0].endswith("/") else sub if indent == 6 else ""
            rooms[room].update(n if indent == 4 else sub + n for n in names)
            continue
        if inside:
            packages.update(n for n in names if n.endswith("/"))
            top.update(n for n in names if n.endswith(".py"))
    return (packages, top) + tuple(rooms[room] for room in ROOMS)


def readme_listed():
    """(packages at any depth, top-level modules) README.md's layout names, one line each: `megatron_ds/X/`
    or `megatron_ds/X.py` first, further names on the line relative to the same folder."""
    packages, top = set(), set()
    for indent, names in layout_entries("README.md"):
        if indent or not names[0].startswith("megatron_ds/"):
            continue
        first = names[0].removeprefix("megatron_ds/")
        folder = first.rstrip("/").rpartition("/")[0]
        for name in [first] + [f"{folder}/{n}" if folder else n for n in names[1:]]:
            (packages if name.endswith("/") else top).add(name)
    return packages, top


def test_design_names_every_schedule_of_the_catalogue():
    text = " ".join((ROOT / "docs" / "DESIGN.md").read_text().split())
    sentence = text[text.index("Schedule names:"):].split("(new ones", 1)[0]
    assert re.findall(r"`([\w-]+)`", sentence) == list(CATALOG)


def test_the_layouts_list_the_package_tree():
    want = tree()
    design = zip(("packages", "top-level modules") + tuple(f"{room} modules" for room in ROOMS), design_listed(), want)
    packages, top = readme_listed()
    readme = (("packages", packages, all_packages()), ("top-level modules", top, want[1]))
    for doc, pairs in (("docs/DESIGN.md", design), ("README.md", readme)):
        for what, have, should in pairs:
            assert have == should, (f"{doc} layout, {what}: missing {sorted(should - have)}, "
                                    f"stale {sorted(have - should)}")


def code_blocks(text):
    return [block.split("\n", 1)[1].strip() for block in text.split("```")[1::2]]


def test_the_readme_opens_with_the_quick_start_and_the_ci_command():
    """The first two code blocks: the quick start, then the set-up-and-test command that .ci/run runs (its
    header states it)."""
    ci = re.search(r"^#\s+(python3 -m venv .*)$", (ROOT / ".ci" / "run").read_text(), re.M).group(1)
    assert code_blocks((ROOT / "README.md").read_text())[:2] == ["bash scripts/quickstart.sh", ci]
    assert (ROOT / "scripts" / "quickstart.sh").is_file()


def test_the_readme_is_short_and_links_every_room():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 260, "README.md is a door: the manual's sections belong in docs/*.md"
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)\)", readme))
    rooms = {f"docs/{p.name}" for p in DOCS}
    assert linked == rooms, f"rooms the README does not link: {sorted(rooms - linked)}, stale: {sorted(linked - rooms)}"


PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$")  # SAVE/zero_to_fp32.py, tools/NAME.py
CITED = re.compile(r"(?<![\w./<>*-])((?:[\w.-]+/)*[\w-][\w.-]*\.(?:py|md))(?![\w/])")


def cited_paths(text):
    """The `x/y.py` and `y.md` paths a page cites (prose, code and links alike), placeholders left out."""
    for path in CITED.findall(text):
        parts = path.split("/")
        if not any(PLACEHOLDER.match(part.split(".")[0]) for part in parts):
            yield path


def repo_files():
    """The clone's .py and .md files, not those of the venv, git, caches or a run's output (runs/, data/)."""
    files = []
    for p in ROOT.rglob("*"):
        parts = p.relative_to(ROOT).parts
        if p.suffix in (".py", ".md") and parts[0] not in {".git", ".venv", "runs", "data"} \
                and "__pycache__" not in parts:
            files.append(p)
    return files


def test_every_path_the_docs_cite_exists():
    """A path with a folder exists relative to the clone, docs/, the package or one of its packages; a bare
    file name exists somewhere in the clone."""
    names = {p.name for p in repo_files()}
    bases = [ROOT, ROOT / "docs", PKG] + sorted(p for p in PKG.iterdir() if (p / "__init__.py").is_file())
    missing = []
    for doc in PAGES:
        for path in sorted(set(cited_paths(doc.read_text()))):
            found = any((base / path).is_file() for base in bases) if "/" in path else path in names
            if not found:
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, "cited files that do not exist:\n" + "\n".join(missing)


def user_errors():
    """The names of every class under megatron_ds/ that derives from UserError, read from the source."""
    bases = {}
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
    found, grew = {"UserError"}, True
    while grew:
        more = {name for name, parents in bases.items() if parents & found}
        grew, found = not more <= found, found | more
    return found - {"UserError"}


def test_design_lists_every_user_error():
    text = " ".join((ROOT / "docs" / "DESIGN.md").read_text().split())
    section = text[text.index("## Errors"):]
    listed = section[section.index("`megatron_ds.errors.UserError`"):section.index("The entry points")]
    assert set(re.findall(r"`(\w+Error)`", listed)) - {"UserError"} == user_errors()


def test_every_link_resolves_from_its_page():
    """A relative Markdown link or image is read from the page's own folder (as GitHub renders it)."""
    broken = []
    for doc in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            path = target.split("#", 1)[0]
            if path and "://" not in path and not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)
