from tools import draw_house


def test_the_house_stands_pipe_layers_above_the_ones_they_import_and_the_picture_is_written(tmp_path, capsys):
    assert draw_house.main(["--out", str(tmp_path / "house.png")]) == 0
    assert (tmp_path / "house.png").stat().st_size > 10_000
    graph = draw_house.folder_edges(draw_house.draw(draw_house.ROOT)[0])
    level = draw_house.levels(graph)
    # pipe/'s layers, bottom to top (docs/DESIGN.md): each strictly above what it builds on
    for lower, upper in [("pipe/plan/", "pipe/parallel/"), ("pipe/parallel/", "pipe/moe/"), ("pipe/moe/", "pipe/"),
                         ("pipe/", "pipe/foreign/"), ("pipe/foreign/", "pipe/hf/"), ("schedules/", "pipe/plan/"),
                         ("model/", "pipe/"), ("pipe/", "training/")]:
        assert level[lower] < level[upper], (lower, upper, level)
    assert "pipe/deepspeed/" in graph and graph["errors.py"] == set()
    assert "wrote" in capsys.readouterr().out


def test_folders_of_a_circle_share_a_level():
    graph = {"a/": {"b/"}, "b/": {"a/", "c/"}, "c/": set()}
    assert draw_house.levels(graph) == {"a/": 1, "b/": 1, "c/": 0}
