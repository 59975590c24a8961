"""research/ffn_flow_lab.py: its one-token FFN kernel, one launch (down waiting on gate+up's per-group counts) and
two, equals the fp64 twin, reads no skipped group's weights (they are NaN) or h (NaN before each launch), leaves its
counts zero for the next launch (without a GPU it stops in one line: tests/test_gate_up_lab.py)."""
import pytest

from research import ffn_flow_lab as lab


@pytest.mark.parametrize("skipped", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("cfg", [(3, 8, 16, 16, 4), (1, 16, 32, 8, 4)], ids=["many programs", "one per group"])
def test_flow_kernel_equals_the_twin_one_launch_and_two(cfg, skipped):
    # D 40: a K step and a block of down's rows past the end; 6 groups of 16 channels
    assert lab.check(40, 96, 16, skipped, cfg) < (1e-5 if lab.INTERP else 1e-2)


def test_flow_kernel_at_one_live_group_and_every_item_on_one_program():
    assert lab.check(32, 64, 16, 0.75, (1, 4, 32, 32, 4)) < (1e-5 if lab.INTERP else 1e-2)


def test_the_sweep_times_every_row_without_an_error(monkeypatch):
    # the GPU sweep's row builder at a small shape: graph replay swapped for one eager call of each copy
    import bench.common
    import research.lab
    monkeypatch.setattr(research.lab, "graph_ms", lambda smoke, fns, reps=20: bench.common.graph_ms(True, fns))
    monkeypatch.setattr(lab, "CONFIGS", [(3, 8, 16, 16, 4)])
    rows = lab.sweep(copies=2, shape=(40, 96, 16))
    assert len(rows) == 2 * 3 and all("err" not in r and r["us"] > 0 for r in rows), rows
    assert "| 50% | lab, one launch (3, 8, 16, 16, 4) |" in lab.markdown(
        dict(gpu="g", torch="t", triton="t", date="d", command="c"), rows)
