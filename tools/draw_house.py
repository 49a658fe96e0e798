"""Draw the house: megatron_ds's folders and the imports between them, from the source (no import of the package's
modules), as a PNG. Each box is a folder (pipe/'s, model/'s and training/'s subpackages their own boxes, so are the
top-level modules); an arrow goes from a folder to each folder it imports; a folder sits above every folder it imports, and
folders that import each other (one room's, such as training/ and training/config/) share a level, their arrows
red. tests/test_import_graph.py refuses module circles and pipe/'s upward imports.

    python tools/draw_house.py --out docs/house.png
"""
import argparse
import collections
import pathlib
import sys

from megatron_ds.testing.import_graph import circles, draw

ROOT = pathlib.Path(__file__).resolve().parents[1]


def folder(module):
    """The box a dotted module name belongs to: X/ or X/Y/ for a package module (generators/ goes with
    schedules/), the file's name for a top-level module ("__init__.py": megatron_ds itself)."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    if len(parts) == 1 and not (ROOT / "megatron_ds" / parts[0]).is_dir():
        return parts[0] + ".py"
    depth = 2 if len(parts) > 2 or (ROOT / "megatron_ds" / "/".join(parts)).is_dir() else 1
    if parts[0] == "schedules":
        depth = 1
    return "/".join(parts[:depth]) + "/"


def folder_edges(edges):
    """{folder: {folder it imports}} without a folder's imports of itself."""
    out = collections.defaultdict(set)
    for importer, targets in edges.items():
        here = folder(importer)
        out[here].update(there for there in map(folder, targets) if there != here)
        out.setdefault(here, set())
    return dict(out)


def levels(graph):
    """{folder: level}: 0 for a folder that imports none, else one above the highest folder it imports (the
    folders of a circle share a level)."""
    group = {v: tuple(c) for c in circles(graph) for v in c}
    level = {}

    def of(v, seen=()):
        if v in level:
            return level[v]
        mates = group.get(v, (v,))
        below = [w for m in mates for w in graph.get(m, ()) if w not in mates and w not in seen]
        value = 1 + max((of(w, seen + mates) for w in below), default=-1)
        for m in mates:
            level[m] = value
        return value

    for v in graph:
        of(v)
    return level


def picture(graph, out):
    import matplotlib  # lazy: the drawing alone needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    level = levels(graph)
    rows = collections.defaultdict(list)
    for v in sorted(graph):
        rows[level[v]].append(v)
    width = max(len(r) for r in rows.values())
    where = {}
    for y, row in rows.items():
        for i, v in enumerate(row):
            where[v] = ((i + 0.5) * width / len(row), y * 1.6)
    fig, ax = plt.subplots(figsize=(2.4 * width + 2, 1.3 * len(rows) + 1.5))
    for v, targets in graph.items():
        for w in targets:
            (x0, y0), (x1, y1) = where[v], where[w]
            upward = level[w] >= level[v]
            ax.annotate("", xy=(x1, y1 + 0.25), xytext=(x0, y0 - 0.25),
                        arrowprops=dict(arrowstyle="->", lw=0.7, alpha=0.55, color="red" if upward else "grey"))
    for v, (x, y) in where.items():
        ax.text(x, y, v, ha="center", va="center", fontsize=9,
                bbox=dict(boxstyle="round", facecolor="#dde8f5" if v.startswith("pipe") else "#f2f2f2"))
    ax.set_xlim(-0.3, width + 0.3)
    ax.set_ylim(-0.8, max(rows) * 1.6 + 0.8)
    ax.axis("off")
    ax.set_title("megatron_ds: folders and their imports, each above what it imports (red: folders of one room "
                 "that import each other's modules; its modules have no circle)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="house.png", help="the PNG to write (default: house.png)")
    args = parser.parse_args(argv)
    edges, _ = draw(ROOT)
    graph = folder_edges(edges)
    level = levels(graph)
    for v in sorted(graph, key=lambda v: (-level[v], v)):
        print(f"{level[v]:2d}  {v:28s} -> {', '.join(sorted(graph[v])) or '(nothing of the package)'}")
    picture(graph, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
