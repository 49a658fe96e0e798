"""The docs' lists stay equal to what they list: DESIGN.md's schedule names to the catalogue, and the layout
blocks of DESIGN.md and README.md to the package tree (its packages, top-level modules and the training
layer's modules). A module added, moved or removed without its line fails here."""
import pathlib
import re

from megatron_ds.schedules import CATALOG

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "megatron_ds"


def tree():
    """(subpackages, top-level modules, training modules) of megatron_ds/, as the layouts name them."""
    packages = {p.name + "/" for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    top = {p.name for p in PKG.glob("*.py") if p.name != "__init__.py"}
    training = {p.name for p in (PKG / "training").glob("*.py") if p.name != "__init__.py"}
    return packages, top, training


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


def listed(doc):
    """(packages, top-level modules, training modules) the doc's layout names under megatron_ds/. DESIGN.md:
    `megatron_ds/` at indent 0, its packages and modules at 2, training's modules at 4. README.md: entries
    `megatron_ds/X ...` at 0, the training layer's modules indented under `megatron_ds/training/`."""
    packages, top, training = set(), set(), set()
    inside = in_training = False
    design = doc.endswith("DESIGN.md")
    for indent, names in layout_entries(doc):
        if indent == 0:
            inside = names[0] == "megatron_ds/" if design else names[0].startswith("megatron_ds/")
            names = [] if design else [names[0].replace("megatron_ds/", "", 1)] + names[1:]
            in_training = bool(names) and names[0] == "training/"
        elif design and indent == 2:
            in_training = names[0] == "training/"
        elif in_training:
            training.update(names)
            continue
        if inside:
            packages.update(n for n in names if n.endswith("/"))
            top.update(n for n in names if n.endswith(".py"))
    return packages, top, training


def test_design_names_every_schedule_of_the_catalogue():
    text = " ".join((ROOT / "docs" / "DESIGN.md").read_text().split())
    sentence = text[text.index("Schedule names:"):].split("(new ones", 1)[0]
    assert re.findall(r"`([\w-]+)`", sentence) == list(CATALOG)


def test_the_layouts_list_the_package_tree():
    want = tree()
    for doc in ("docs/DESIGN.md", "README.md"):
        got = listed(doc)
        for what, have, should in zip(("packages", "top-level modules", "training modules"), got, want):
            assert have == should, (f"{doc} layout, {what}: missing {sorted(should - have)}, "
                                    f"stale {sorted(have - should)}")
