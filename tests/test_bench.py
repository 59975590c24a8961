"""The benchmark scripts keep working: each --smoke mode runs the whole benchmark code path (every
correctness check, row builder and results writer) on tiny fp32 shapes in the Triton interpreter, and
the JSON it writes has the fields that results/ promises. The timings of a smoke run mean nothing;
speed is measured on the GPU with `python -m bench.ops` and `python -m bench.e2e`, never here.
Bad flags end in one line before the device check (in-process: they stop before any work)."""
import copy
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

import kernels_base
from bench import common
from conftest import assert_one_line_error, stopped

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPARSITIES = {0.25, 0.5, 0.75}


def start_smoke(tmp_path, module, *args):
    """Start `python -m module --smoke` in a fresh interpreter; finish_smoke waits for it. The smoke runs are the
    CPU test setup (the newest Triton's interpreter); on a GPU machine the benchmark itself is the real run."""
    if torch.cuda.is_available():
        pytest.skip("--smoke runs the kernels in the Triton interpreter (the CPU test setup); on a GPU the "
                    "benchmark itself is the real run")
    out = str(tmp_path / "bench")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen([sys.executable, "-m", module, *args, "--smoke", "--out", out], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, out


def finish_smoke(started):
    """The JSON and markdown a started smoke run wrote (it must exit 0 within 300 s)."""
    proc, out = started
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    with open(out + ".json") as f, open(out + ".md") as g:
        return json.load(f), g.read()


def smoke(tmp_path, module, *args):
    return finish_smoke(start_smoke(tmp_path, module, *args))


@pytest.fixture(scope="module")
def both_runs(tmp_path_factory):
    # The two whole smoke runs are single-threaded interpreters: side by side they take the time of one.
    runs = (start_smoke(tmp_path_factory.mktemp("kernels"), "bench.ops"),
            start_smoke(tmp_path_factory.mktemp("e2e"), "bench.e2e"))
    yield runs
    for proc, _ in runs:  # a run no selected test waited for must not outlive the module
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def kernel_run(both_runs):
    return finish_smoke(both_runs[0])


@pytest.fixture(scope="module")
def e2e_run(both_runs):
    return finish_smoke(both_runs[1])


def assert_meta(meta, module):
    for key in ("gpu", "torch", "triton", "date", "command"):
        assert meta.get(key), f"results must record {key}"
    assert meta["command"].startswith(f"python -m {module}") and meta["smoke"] is True


def test_every_kernel_row_is_checked_at_its_own_sparsity(kernel_run):
    data, _ = kernel_run
    assert_meta(data["meta"], "bench.ops")
    by_case = {}
    for r in data["rows"]:
        by_case.setdefault((r["op"], r["tokens"]), set()).add(r["sparsity"])
        assert r["rel_err"] <= 1e-2 and r["all_active_rel_err"] <= 1e-2
        assert r["pruned_zero"] is True and r["nan_free"] is True
        assert 0 < r["realized_active"] < 1 and abs(r["realized_active"] - (1 - r["sparsity"])) < 0.15
    assert all(s == SPARSITIES for s in by_case.values()), by_case
    ops = {op.split(" (")[0] for op, _ in by_case}
    assert {"gate+up", "q_proj", "Q/K/V proj", "down", "o_proj", "attention decode", "attention prefill"} <= ops
    assert {"fp8 gate+up", "fp8 Q/K/V proj", "fp8 down", "fp8 o_proj"} <= ops


def test_fp8_rows_are_judged_against_stock_fp8_with_bf16_beside(kernel_run):
    fp8 = [r for r in kernel_run[0]["rows"] if r["op"].startswith("fp8 ")]
    assert fp8 and all(r["tokens"] == 1 for r in fp8)
    for r in fp8:  # the input's quantization is in the stock side's time (its per-row or per-tensor path, the
        # faster); bf16 cuBLAS is the other dense
        assert r["dense_baseline"] in ("scaled_mm", "scaled_mm_tensorwise")
        assert r["graph_speedup_vs_dense"] > 0 and r["speedup_vs_dense"] > 0


def test_decode_sized_kernel_rows_are_judged_on_cuda_graphs_and_keep_do_bench(kernel_run):
    rows = kernel_run[0]["rows"]
    decode = [r for r in rows if r["tokens"] <= 16]
    prefill = [r for r in rows if r["tokens"] > 16]
    assert decode and prefill
    for r in decode:
        assert r["timing"] == "cuda_graph" and r["judged_speedup"] == r["graph_speedup"]
        assert r["dense_graph_ms"] > 0 and r["sparse_graph_ms"] > 0 and r["all_active_graph_ms"] > 0
        assert r["dense_ms"] > 0 and r["sparse_ms"] > 0 and "speedup" in r  # do_bench too
        assert "dense_GBps" in r and "sparse_useful_GBps" in r
    for r in prefill:
        assert r["timing"] == "do_bench" and "graph_speedup" not in r and r["judged_speedup"] == r["speedup"]
        assert "dense_TFLOPs" in r


def test_rotating_copies_put_twice_the_l2_between_reuses_at_every_sparsity(kernel_run):
    for r in kernel_run[0]["rows"]:
        if r["tokens"] <= 16:
            assert r["copies"] >= 2 and r["reuse_bytes"] >= 2 * r["l2_bytes"], r
        else:
            assert r["copies"] == 1  # do_bench flushes the L2 between repetitions


def test_dense_side_is_fused_gate_up_with_and_without_swiglu(kernel_run):
    rows = kernel_run[0]["rows"]
    gate_up = [r for r in rows if r["op"].startswith("gate+up")]
    assert {r["tokens"] for r in gate_up} >= {1, 8}
    for r in gate_up:
        assert r["dense_swiglu_ms"] > 0 and r["speedup_vs_dense_swiglu"] > 0
        if r["tokens"] <= 16:
            assert r["graph_speedup_vs_dense_swiglu"] > 0
    prefill_attention = [r for r in rows if r["op"].startswith("attention prefill")]
    assert all(r["dense_baseline"] in ("sdpa_gqa", "sdpa_expanded") for r in prefill_attention)


def test_kernel_markdown_has_the_table_and_every_target(kernel_run):
    _, md = kernel_run
    from bench import ops
    assert "| op | tokens |" in md and "CUDA graph" in md and "do_bench" in md
    for text, *_ in ops.TARGETS:
        assert f"| {text} |" in md


def test_tune_times_each_config_passed_to_the_op(tmp_path):
    data, md = smoke(tmp_path, "bench.tune", "--only", "attn_decode")
    assert list(data["results"]) == ["attn_decode", "attn_decode 1x1024", "attn_decode 32x8192 75%"]  # batch 16, 1, 32
    for r in data["results"].values():
        variants = r["variants"]
        assert len(variants) >= 2 and all("failed" not in v and v["ms"] > 0 and v["rel_err"] <= 1e-2 for v in variants)
        assert variants[0]["config"] == r["current"]  # today's CONFIGS entry first
    assert data["results"]["attn_decode"]["variants"][-1]["config"]["BN"] == 64
    assert "| attn_decode |" in md and data["meta"]["command"].startswith("python -m bench.tune")


def test_tune_times_serving_batch_attention_at_three_quarters_skipped(tmp_path):
    data, md = smoke(tmp_path, "bench.tune", "--only", "32x8192")
    (r,) = data["results"].values()
    assert list(data["results"]) == ["attn_decode 32x8192 75%"] and r["skipped"] == 0.75 and r["live"] == 0.25
    assert all("failed" not in v and v["rel_err"] <= 1e-2 for v in r["variants"])


def test_tune_in_step_refuses_keys_it_cannot_time_in_a_step_in_one_line(capsys):
    from bench import tune
    from conftest import run_main
    r = run_main(capsys, tune.main, "--smoke", "--in-step", "--only", "norm_route")
    assert_one_line_error(r, "--in-step", "norm_route")


def test_tune_in_step_times_each_variant_between_two_runs_of_the_current_configs(tmp_path):
    data, md = smoke(tmp_path, "bench.tune", "--only", "gemm_k_small_1_fp8", "--in-step")
    (r,) = data["results"].values()
    assert r["weights"] == "fp8" and r["step"] == [1, 24] and r["wide_ms"] > 0 and r["dense_ms"] > 0
    (v,) = r["variants"]  # --smoke: the first variant
    assert "failed" not in v and v["config"] != r["current"] and v["wide_ms"] > 0 and v["dense_ms"] > 0
    assert v["ratio"] == pytest.approx(v["wide_ms"] / v["wide_base_ms"])
    assert "| gemm_k_small_1_fp8 | 1x24 | fp8 |" in md


def test_configs_tried_reaches_every_launch_inside_the_block_and_restores_after():
    import kernels_attention
    q = torch.randn(1, 4, 1, 16)
    k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    mask, kv_len = torch.ones(1, 2, dtype=torch.bool), torch.tensor([8], dtype=torch.int32)
    before = copy.deepcopy(kernels_base.CONFIGS)
    with kernels_base.configs_tried({"attn_decode": dict(BN=3)}):
        assert kernels_base.config_for("attn_decode", None) == {**before["attn_decode"], "BN": 3}
        with pytest.raises(Exception, match="power of 2"):  # 3 keys a block is no Triton tile: the launch saw it
            kernels_attention.attention_decode(q, k, v, mask, kv_len)
    assert kernels_base.CONFIGS == before
    with pytest.raises(ValueError):
        with kernels_base.configs_tried({"attn_decode": dict(BN=3)}):
            raise ValueError("restored on the way out too")
    assert kernels_base.CONFIGS == before
    out = kernels_attention.attention_decode(q, k, v, mask, kv_len)
    ref = kernels_attention.attention_decode_ref(q, k, v, mask, kv_len)
    assert torch.allclose(out, ref, atol=1e-4)


def test_tune_takes_several_names_and_checks_the_prefetch_variant(tmp_path):
    data, _ = smoke(tmp_path, "bench.tune", "--only", "attn_decode,gemm_k_small_long_k")
    assert set(data["results"]) == {"attn_decode", "attn_decode 1x1024", "attn_decode 32x8192 75%",
                                    "gemm_k_small_long_k", "gemm_k_small_long_k_fp8"}
    last = data["results"]["gemm_k_small_long_k"]["variants"][-1]  # --smoke: the first and the last variant
    assert last["config"].get("PREFETCH") and "failed" not in last and last["rel_err"] <= 1e-2


def test_tune_times_the_prefill_router_d_split_pair_against_the_split_kernel_and_the_plain_norm(tmp_path):
    data, _ = smoke(tmp_path, "bench.tune", "--only", "norm_route")
    (pair,) = data["results"].values()
    assert pair["current"] == data["results"]["norm_route_parts 20"]["current"]
    assert pair["timing"] == "cuda_graph", "microsecond kernels: timed as graph replays"
    assert set(pair["others_ms"]) == {"rms_norm"}, "the dense model's plain norm timed beside the router module"
    first, last = pair["variants"]  # --smoke: the current D-split pair, and the split kernel in tiles of 16
    assert last["config"] == {"SPLIT_TILE": 16}
    for v in pair["variants"]:  # the decisions are the twin's
        assert "failed" not in v and v["rel_err"] <= 1e-2


def test_tune_sweeps_the_fp8_keys_on_fp8_weights_with_an_fma_variant(tmp_path):
    data, _ = smoke(tmp_path, "bench.tune", "--only", "fp8")
    assert set(data["results"]) == {"gemv_mn_1_fused_fp8", "gemv_mn_1_fp8", "gemm_k_small_long_k_fp8", "gemm_k_small_1_fp8"}
    for key, r in data["results"].items():
        assert all("failed" not in v and v["rel_err"] <= 1e-2 for v in r["variants"]), key  # checked on fp8 codes
    assert any(v["config"].get("FMA") for v in data["results"]["gemm_k_small_1_fp8"]["variants"])


def test_tune_having_keeps_the_current_config_and_only_the_variants_that_set_the_name(tmp_path):
    data, _ = smoke(tmp_path, "bench.tune", "--only", "gemv_mn_1_fp8,gemm_k_small_1_fp8", "--having", "DOT,FMA")
    r = data["results"]["gemv_mn_1_fp8"]
    first, last = r["variants"]  # --smoke: the first and the last of the kept ones (DOT's are not the sweep's last)
    assert first["config"] == r["current"] and "DOT" not in r["current"]
    assert last["config"].get("DOT") and "failed" not in last and last["rel_err"] <= 1e-2
    assert data["results"]["gemm_k_small_1_fp8"]["variants"][-1]["config"].get("FMA")  # either name kept


def test_e2e_rows_carry_dense_bandwidth_and_the_byte_limit(e2e_run):
    data, md = e2e_run
    assert_meta(data, "bench.e2e")
    rows = data["rows"]
    assert {r["phase"] for r in rows} == {"prefill", "decode", "decode: dense engine vs torch.compile",
                                          "decode (small model)"}
    for r in rows:
        assert r["dense_GBps"] > 0 and r["dense_tok_s"] > 0
    decode = [r for r in rows if r["phase"] == "decode"]
    assert {r["batch"] for r in decode} == {1, 6}
    for r in decode:
        assert 0 < r["dense_copy_frac"] and r["byte_limit_speedup"] >= 1 and r["wide_tok_s"] > 0
        assert set(r["dense_ms_by_policy"]) == ({"triton", "sdpa", "cublas linears"} if r["batch"] == 1
                                                else {"triton", "sdpa"})  # (no 'PDL off' without PDL)
        assert set(r["masks"]) == {"attn_skip", "ffn_skip", "attn_union_live", "ffn_union_live"}
    assert set(next(r for r in decode if r["batch"] == 6)["wide_ms_by_policy"]) == {"default", "all sparse",
                                                                                  "router side stream"}
    assert set(next(r for r in decode if r["batch"] == 1)["wide_ms_by_policy"]) == {"default", "rule in norm_route"}


def test_e2e_compares_the_dense_engine_with_torch_compile_once(e2e_run):
    data, md = e2e_run
    compiled = [r for r in data["rows"] if "compiled_ms" in r]
    assert len(compiled) == 1
    r = compiled[0]
    assert r["batch"] == 1 and r["dense_tok_s"] > 0 and r["compiled_tok_s"] > 0 and "compiled_GBps" in r
    assert "torch.compile" in md and "tok/s" in md


def test_e2e_markdown_lists_every_target_with_a_verdict(e2e_run):
    _, md = e2e_run
    from bench import e2e
    for text, *_ in e2e.TARGETS:
        line = next(l for l in md.splitlines() if l.startswith(f"| {text} |"))
        assert line.endswith(("| met |", "| missed |", "| |"))


def test_smoke_never_writes_under_results(capsys, monkeypatch):
    from bench import e2e
    monkeypatch.setattr(kernels_base, "INTERPRET", True)  # as --smoke runs (the CPU test setup)
    r = stopped(capsys, e2e.main, "--smoke", "--out", "results/e2e_smoke")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "results/" in r.stderr
    assert not os.path.exists(os.path.join(ROOT, "results", "e2e_smoke.json"))


def test_e2e_append_replaces_only_the_parts_it_runs(tmp_path, e2e_run):
    # The prefill part measured again onto the module's whole smoke run: --append replaces the prefill
    # rows instead of adding more, keeps every other part's rows and command, and says which command
    # measured which part.
    first, _ = e2e_run
    with open(tmp_path / "bench.json", "w") as f:  # smoke() writes and reads tmp_path/bench.*
        json.dump(first, f)
    second, md = smoke(tmp_path, "bench.e2e", "--only", "prefill", "--append")
    assert sorted(r["phase"] for r in second["rows"]) == sorted(r["phase"] for r in first["rows"])
    assert any(r["phase"] == "prefill" for r in first["rows"])
    assert [r for r in second["rows"] if r["phase"] != "prefill"] == [r for r in first["rows"] if r["phase"] != "prefill"]
    assert "--append" in second["commands"]["prefill"]
    assert all("--append" not in c for part, c in second["commands"].items() if part != "prefill")
    assert "Rows by part: " in md


def test_e2e_append_onto_a_file_that_is_not_its_results_is_one_line(tmp_path, capsys, monkeypatch):
    from bench import e2e
    (tmp_path / "bench.json").write_text("{not json")
    monkeypatch.setattr(kernels_base, "INTERPRET", True)  # as --smoke runs (the CPU test setup)
    r = stopped(capsys, e2e.main, "--smoke", "--only", "fp8", "--append", "--out", str(tmp_path / "bench"))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "--append" in r.stderr


@pytest.mark.parametrize("flags, words", [
    (("--budget-s", "-1"), ("--budget-s",)),
    (("--budget-s", "nan"), ("--budget-s", "finite")),
    (("--decode", "1x0"), ("--decode", "BATCHxCONTEXT")),
    (("--decode", "8"), ("--decode", "BATCHxCONTEXT")),
    (("--only", "decode,speed"), ("--only", "prefill, decode")),
    (("--only", ","), ("--only",)),
])
def test_e2e_refuses_a_bad_flag_in_one_line_before_the_device_check(capsys, monkeypatch, flags, words):
    from bench import e2e
    monkeypatch.setattr(common, "prepare", lambda *a: pytest.fail("the flags were not checked first"))
    assert_one_line_error(stopped(capsys, e2e.main, "--smoke", *flags), *words)


@pytest.mark.parametrize("module", ["bench.ops", "bench.tune", "bench.e2e", "bench.serving"])
def test_smoke_without_the_interpreter_names_the_command_to_run(capsys, monkeypatch, module):
    # (as on a GPU machine, where the tests run without TRITON_INTERPRET)
    monkeypatch.setattr(kernels_base, "INTERPRET", False)
    main = importlib.import_module(module).main
    assert_one_line_error(stopped(capsys, main, "--smoke"), f"TRITON_INTERPRET=1 python -m {module} --smoke")


def test_e2e_fp8_times_each_dense_side_both_ways_and_keeps_the_faster(tmp_path):
    from bench import e2e
    data, md = smoke(tmp_path, "bench.e2e", "--only", "fp8")
    (r,) = [r for r in data["rows"] if r["phase"] == "decode fp8"]
    assert set(r["ms"]) == set(e2e.FP8_ENGINES) | {"dense bf16", "dense fp8"}
    ways = {"dense bf16": ["WIDE kernels", "cuBLAS"],
            "dense fp8": ["WIDE kernels", "_scaled_mm", "_scaled_mm, per-tensor"]}
    for side, names in ways.items():
        assert r["ms"][side] == min(r["ms"][f"{side} ({n})"] for n in names)
    assert r["dense_fp8_vs_dense_bf16"] == pytest.approx(r["ms"]["dense bf16"] / r["ms"]["dense fp8"])
    assert "dense fp8 (_scaled_mm)" in md and "| WIDE fp8 vs dense fp8 (at its best), batch 1 | not measured |" in md


def test_decode_timing_feeds_every_engine_the_same_tokens_and_cache():
    # An A/B between two policies must time the same work: the same tokens and cached keys, so the same masks.
    # (Fed back, each engine's own argmax sent the next tokens, and so every later mask, its own way.)
    import policy
    from bench import e2e
    run = e2e.smoke_run()
    m, _ = common.random_model(run, max_seq_len=64)
    e2e.calibrate_routers(m, 0.5, run.calibrate_tokens)
    got = [common.with_engine(m, True, pol, lambda e: e2e.time_decode(run, e, 1, 24, 3)[1])
           for pol in (policy.Policy(), policy.Policy(sparse_decode_max_tokens=0), policy.Policy())]
    assert got[0] == got[1] == got[2], got


def test_e2e_redraws_a_decode_profile_from_its_json_on_any_machine(tmp_path, capsys):
    # The committed H100 profile: its table rewritten identically from the .json, and the plot of where each step's
    # time goes (no GPU, no interpreter, no measuring).
    import shutil
    from bench import e2e
    from conftest import run_main
    src = os.path.join(ROOT, "results", "decode_profile_h100")
    shutil.copy(src + ".json", tmp_path / "p.json")
    r = run_main(capsys, e2e.main, "--redraw-profile", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "p.md").read_text() == open(src + ".md").read()
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "p.png").stat().st_size > 10000
    (tmp_path / "bad.json").write_text('{"rows": []}')
    assert_one_line_error(run_main(capsys, e2e.main, "--redraw-profile", str(tmp_path / "bad.json")),
                          "--redraw-profile", "decode profile")
