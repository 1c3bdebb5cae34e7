"""Charts: written as small PNGs; a timeline needs events."""

import pytest

from modelpar.bench import plots


@pytest.fixture(scope="module")
def font_list():
    """matplotlib's font list, loaded before the guarded test (a module fixture is set up before the
    conftest's function-scoped guard): on a machine where matplotlib has no font cache yet, its first
    import of `font_manager` builds one and runs ``fc-list`` to do it, a process the pure tier would
    refuse; the charts themselves start none."""
    import matplotlib.font_manager

    return matplotlib.font_manager.fontManager


def test_charts_are_small_pngs(tmp_path, font_list):
    rows = [{"label": "ddp", "samples_per_s": 10.0, "pred_samples_per_s": 12.0,
             "memory": {"params": 2 ** 20, "grads": 2 ** 20, "optimizer": 2 ** 21, "activations": 2 ** 22}},
            {"label": "fsdp", "samples_per_s": 8.0, "memory": {"params": 2 ** 19, "activations": 2 ** 22}}]
    events = [{"stage": s, "action": a, "mb": m, "start_us": 1000 * (m + s) + (500 if a == "B" else 0), "dur_us": 400}
              for s in range(2) for m in range(4) for a in ("F", "B")]
    paths = [plots.plot_throughput(rows, tmp_path / "t.png", title="t"),
             plots.plot_memory(rows, tmp_path / "m.png", title="m"),
             plots.plot_pipeline_timeline(events, tmp_path / "p.png", title="p")]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 1000 < len(data) < 300_000
    with pytest.raises(ValueError, match="no pipeline events"):
        plots.plot_pipeline_timeline([], tmp_path / "x.png", title="x")
