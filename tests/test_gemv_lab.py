"""research/gemv_lab.py: its lab kernels equal their twin (they back results/gemv_lab_*), and it stops in one
line without a GPU."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from research import gemv_lab


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("kind, mode", [("tma", 1), ("ptr", 1), ("ptr", 2)])
def test_lab_kernels_equal_the_twin_over_the_live_groups_only(kind, mode, fp8):
    # K = 512 in slices of 128: four steps per chunk; 2 x 4 "SMs" of programs share 16 chunks of 16 rows
    assert gemv_lab.check(kind, 512, 512, 128, fp8, (16, 128, 2, 2, 4, mode)) < (3e-3 if mode == 2 else 1e-5)


def test_lab_loads_only_mode_is_not_a_gemv():
    # mode 3 times the access pattern alone: its output is not the product (so the check does not assert on it)
    assert gemv_lab.check("ptr", 512, 512, 128, True, (16, 128, 2, 1, 4, 3)) > 0.1


def test_lab_results_list_the_shipped_kernel_first_for_each_shape_and_format():
    for grid in ("tiles", "modes"):
        path = os.path.join(ROOT, "results", f"gemv_lab_h100_{grid}.json")
        data = json.load(open(path))
        assert data["meta"]["gpu"].startswith("NVIDIA") and data["meta"]["command"].startswith("python -m research")
        seen = []
        for r in data["rows"]:
            key = (r["shape"], r["fp8"])
            if key not in seen:
                seen.append(key)
                assert r["kind"] == "shipped", key
        md = open(path[:-5] + ".md").read()
        assert md == gemv_lab.markdown(data["meta"], data["rows"]), "the table is made from the json"


def test_lab_without_a_gpu_stops_in_one_line():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "-m", "research.gemv_lab"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and r.stderr.strip().count("\n") == 0 and "TRITON_INTERPRET=1" in r.stderr


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="--smoke runs the kernels in the interpreter")
def test_gemv_paths_checks_every_path_against_its_twin_and_writes_its_table(tmp_path):
    from research import gemv_paths
    out = str(tmp_path / "paths")
    rows = gemv_paths.main(["--smoke", "--out", out])
    names = [r["path"] for r in rows]
    assert names[:5] == ["dense tail, every row", "dense tail, half the rows", "mask, every group",
                         "mask, half the groups, contiguous", "mask, half the groups at random"]
    assert names[5].startswith("mask made in the GEMV") and names[6].startswith("the same mask, given")
    assert rows[1]["MB"] == pytest.approx(rows[0]["MB"] / 2) == pytest.approx(rows[4]["MB"])  # equal bytes
    assert all(r["rel_err"] <= 1e-2 for r in rows) and 0 < rows[5]["live_groups"] < rows[2]["live_groups"]
    data = json.load(open(out + ".json"))
    assert data["meta"]["command"] == "python -m research.gemv_paths --smoke --out " + out
    assert open(out + ".md").read() == gemv_paths.markdown(data["meta"], data["rows"])
