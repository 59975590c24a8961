"""research/gate_up_lab.py: its lab kernel (gate and up interleaved, one product per K step) equals the twin of the
shipped gate+up tile, and each kernel lab (this one, ffn_flow_lab) stops in one line without a GPU."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from research import gate_up_lab


@pytest.mark.parametrize("skipped", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("cfg", [(16, 32, 4, 2, 1), (8, 64, 4, 2, 1)], ids=["whole group", "half a group"])
def test_lab_kernel_equals_the_twin_and_zeroes_the_pruned_slots(cfg, skipped):
    # 40 tokens in tiles of 16 (a boundary tile, a dead tile), 2 groups of 16 channels, K = 64 in slices
    assert gate_up_lab.check(40, 32, 64, 16, skipped, cfg, 16) < (1e-5 if gate_up_lab.INTERP else 1e-2)


def test_interleave_puts_gate_and_up_rows_in_pairs():
    import torch
    gate, up = torch.arange(6.0).view(3, 2), -torch.arange(6.0).view(3, 2)
    wi = gate_up_lab.interleave(gate, up)
    assert torch.equal(wi[0::2], gate) and torch.equal(wi[1::2], up)


@pytest.mark.parametrize("lab", ["research.gate_up_lab", "research.ffn_flow_lab", "research.attn_o_lab"])
def test_each_kernel_lab_without_a_gpu_stops_in_one_line(lab):  # (research.lab.lab_main, shared)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "-m", lab], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stderr.strip().count("\n") == 0 and "TRITON_INTERPRET=1" in r.stderr


def test_a_labs_table_row_gives_its_numbers_or_the_error_of_a_variant_that_does_not_fit():
    from research.lab import cells, lab_row
    ok = lab_row(dict(skipped=0.5), "fits", lambda: dict(us=30.0, tb_s=2.9))
    bad = lab_row(dict(skipped=0.5), "too big", lambda: 1 / 0)
    assert cells(ok, ("us", ".1f"), ("tb_s", ".2f")) == ["30.0", "2.90"]
    assert bad["kernel"] == "too big" and bad["err"].startswith("ZeroDivisionError")
    assert cells(bad, ("us", ".1f"), ("tb_s", ".2f")) == ["failed: ZeroDivisionError: division by zero", ""]
