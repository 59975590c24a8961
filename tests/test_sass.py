"""research/sass.py: the decode kernels built for sm_90a on a machine without a GPU, read back from the binary."""
import json
import os
import subprocess
import sys

import pytest
import triton

from conftest import ROOT

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
needs_tools = pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "cuobjdump")),
                                 reason="needs Triton's NVIDIA backend tools (ptxas, cuobjdump)")


@needs_tools
def test_every_decode_kernel_compiles_for_hopper_and_reads_back_registers_and_instructions(tmp_path):
    # in a process of its own without the interpreter, whose block sizes replace the GPU's
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "research.sass", "--out", str(tmp_path / "k")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((tmp_path / "k.json").read_text())
    assert data["meta"]["target"] == "sm_90a" and "no GPU" in data["meta"]["device"]
    rows = data["rows"]
    assert [r["key"] for r in rows] == ["gemv_mn_1_fused", "gemv_mn_1_fused_fp8", "gemv_mn_1", "gemv_mn_1_fp8",
                                        "attn_decode", "gemm_mn_fused", "gemm_mn_fused", "gemm_mn_fused"]
    for r in rows:
        assert r["config"].get("num_warps"), "the GPU's block sizes, not the interpreter's"
        assert 16 <= r["registers"] <= 255 and r["instructions"] == sum(r["ops"].values()) > 100, r["op"]
        assert r["programs_per_sm"] == min(65536 // (r["registers"] * r["threads"]), 2048 // r["threads"])
    ops = {r["key"]: r["ops"] for r in rows}
    # what the binaries must hold: fp8 codes converted by the e4m3 -> f16 instruction, bf16 weights never;
    # the decode attention's products on tensor cores
    assert ops["gemv_mn_1_fused_fp8"].get("F2FP.F16.E4M3.UNPACK_B", 0) > 0
    assert "F2FP.F16.E4M3.UNPACK_B" not in ops["gemv_mn_1_fused"]
    assert any(op.startswith(("HMMA", "HGMMA")) for op in ops["attn_decode"])
    # the prefill gate+up tile: config PAIRED runs one product twice as wide per K step, half the instructions of
    # the two-product tile's, as the lab kernel whose time it follows does
    tile, paired, lab = (r["ops"] for r in rows[5:])
    wgmma = lambda o: sum(n for op, n in o.items() if op.startswith("HGMMA"))
    assert rows[6]["config"]["PAIRED"] and "PAIRED" not in rows[5]["config"]
    assert wgmma(tile) == 2 * wgmma(paired) == 2 * wgmma(lab) > 0
    assert (tmp_path / "k.md").read_text().startswith("# The one-token decode kernels and the prefill gate+up tile")


def test_under_the_interpreter_it_stops_in_one_line():
    r = subprocess.run([sys.executable, "-m", "research.sass", "--out", os.devnull], cwd=ROOT,
                       env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stderr.strip().count("\n") == 0 and "TRITON_INTERPRET" in r.stderr, r.stderr
