"""research/attn_o_lab.py: its batch-1 decode attention + O kernel, one launch (O waiting on each head group's
merged output) and two, equals the fp64 twin, reads no skipped group's O columns or K/V, no key past kv_len (all
NaN) and no skipped group's output (NaN before each launch), and leaves its tickets and flags zero for the next
launch (without a GPU it stops in one line: tests/test_gate_up_lab.py)."""
import pytest
import torch

import kernels_base
from kernels_step import live_ref
from research import attn_o_lab as lab

# 8 query heads in 2 groups (one KV head's 4 each), head dim 16, a model dim of 36 (a block of O's rows past the end)
SHAPE = (8, 2, 16, 36, 48)


@pytest.mark.parametrize("skipped", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("kv_len", [40, 17, 1], ids=["3 chunks", "2 chunks, the last short", "one key"])
def test_attention_and_o_equal_the_twin_one_launch_and_two(kv_len, skipped):
    assert lab.check(SHAPE, kv_len, skipped, (16, 16, 8, 4)) < (1e-5 if lab.INTERP else 1e-2)


def test_one_chunk_per_group_stores_without_a_merge():
    # CH past kv_len: one item per group, no partials, no ticket; O's rows one block per program
    assert lab.check(SHAPE, 40, 0.5, (64, 16, 4, 4)) < (1e-5 if lab.INTERP else 1e-2)


def test_the_sweep_times_every_row_without_an_error(monkeypatch):
    # the GPU sweep's row builder at a small shape: graph replay swapped for one eager call of each copy
    import bench.common
    import research.lab
    monkeypatch.setattr(research.lab, "graph_ms", lambda smoke, fns, reps=20: bench.common.graph_ms(True, fns))
    monkeypatch.setattr(lab, "CONFIGS", [(16, 16, 8, 4)])
    rows = lab.sweep(copies=2, shape=SHAPE[:4], kv_lens=(40,))
    assert len(rows) == 2 * 5 and all("err" not in r and r["us"] > 0 for r in rows), rows
    assert "| 40 | 50% | lab, one launch (16, 16, 8, 4) |" in lab.markdown(
        dict(gpu="g", torch="t", triton="t", date="d", command="c"), rows)


def test_a_long_row_gets_longer_items_not_more_than_the_shipped_kernels_max_chunks():
    cap = kernels_base.CONFIGS["attn_decode"]["max_chunks"]
    n = 16 * cap * 2 + 5  # items of 16 keys would be 2 * cap + 1 per group
    assert lab.check((8, 2, 16, 36, n), n, 0.5, (16, 16, 8, 4)) < (1e-5 if lab.INTERP else 1e-2)
    dtype = torch.float32 if lab.INTERP else torch.bfloat16
    q, k, v, wo, res, keep = lab.problem(8, 2, 16, 36, n, n, 0.0, dtype)
    attn_o = lab.AttnO(8, 2, 16, 36, n, dtype, q.device)
    attn_o(q, k, v, wo, res, live_ref(keep), n, (16, 16, 8, 4))
    assert 1 < attn_o.chunks <= cap
