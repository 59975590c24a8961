"""bench/step_profile.py: a decode step's kernels assigned to the ops of the engine's plan, and the bytes each
op must read. The profile itself needs a GPU (`python -m bench.e2e --only profile`); what it does with the
kernels it sees is checked here on synthetic kernel lists; bench/prefill.py's smoke run too."""
import os

import pytest
import torch

import kernels_base
from bench import step_profile as bp
import policy
from model import ModelConfig, Transformer

WIDE = [("wide", "wide")] * 2


def step(kernels, t=0.0, dur=8.0, gap=2.0):
    out = []
    for name in kernels:
        out.append((name, t, t + dur))
        t += dur + gap
    return out


def layer_b1():  # decode B1: every pruned op in Triton, RoPE in the Q, K, V GEMV's epilogue
    return ["_norm_route_kernel", "_gemv_mn_kernel", "_attn_decode_kernel", "_gemm_k_kernel",
            "_norm_route_kernel", "_gemv_mn_kernel", "_gemm_k_kernel"]


def test_triton_kernels_go_to_the_op_that_launches_them_in_order():
    plan = policy.Policy().plan(policy.Shape(1, True), WIDE)
    got = bp.assign_ops(step(["embedding_kernel"] + layer_b1() * 2 + ["_rms_norm_kernel", "nvjet_head_gemm"]), plan)
    labels = [g[0] for g in got]
    per_layer = ["attn_norm", "qkv", "attention", "o", "ffn_norm", "gate_up", "down"]
    assert labels == ["embedding"] + per_layer * 2 + ["step_norm", "step_head"]
    assert got[0][3] == 0.0 and all(g[3] == 2.0 for g in got[1:]) and all(g[2] == 8.0 for g in got)


def test_cublas_gemms_take_the_next_cublas_op_and_small_kernels_stay_with_theirs():
    # decode B32 under the batch rule: Q/K/V, O, gate+up and down on cuBLAS; silu*up (a Triton kernel of
    # gate+up's op) and the residual add (a torch kernel) after their GEMM; a split-K reduction belongs to the
    # GEMM before it
    plan = policy.Policy().plan(policy.Shape(32, True, dense_ffn=True), WIDE)
    layer = ["_norm_route_kernel", "nvjet_tst_qkv", "_rope_kernel", "_attn_decode_kernel", "sm90_xmma_gemm_o",
             "splitKreduce_kernel", "_rms_norm_kernel", "nvjet_gate_up", "_swiglu_rows_kernel",
             "gemv2T_kernel_down", "elementwise_add"]
    got = bp.assign_ops(step(["indexSelect"] + layer * 2 + ["_rms_norm_kernel", "nvjet_head"]), plan)
    want = ["embedding"] + ["attn_norm", "qkv", "rope", "attention", "o", "o", "ffn_norm", "gate_up", "gate_up",
                            "down", "down"] * 2 + ["step_norm", "step_head"]
    assert [g[0] for g in got] == want


def test_a_dense_later_chunk_s_every_head_layout_comes_before_the_embedding():
    # A dense layer's prefill chunk after the first: Engine.inputs builds the every-head layout before the
    # embedding, so its kernels open the step; the layers' kernels still go to the layers, not past them.
    plan = policy.Policy().plan(policy.Shape(100, False, start=8192), [(None, None)] * 2)
    layer = ["_rms_norm_kernel", "nvjet_qkv", "_rope_kernel", "_attn_prefill_kernel", "nvjet_o",
             "_rms_norm_kernel", "nvjet_gate_up", "_swiglu_rows_kernel", "nvjet_down"]
    got = bp.assign_ops(step(["_layout_kernel", "_worklist_kernel", "indexSelect"] + layer * 2
                             + ["_rms_norm_kernel", "nvjet_head"]), plan)
    want = (["step_every_head"] * 2 + ["embedding"]
            + ["attn_norm", "qkv", "rope", "attention", "o", "ffn_norm", "gate_up", "gate_up", "down"] * 2
            + ["step_norm", "step_head"])
    assert [g[0] for g in got] == want


def test_sdpa_s_flash_kernel_is_the_attention_op_s_and_the_o_gemm_after_it_is_o_s():
    # a dense first chunk: RoPE in Triton, then SDPA (FlashAttention's kernel), then O on cuBLAS
    plan = policy.Policy().plan(policy.Shape(100, False), [(None, None)])
    layer = ["_rms_norm_kernel", "nvjet_qkv", "_rope_kernel", "void pytorch_flash::flash_fwd_kernel<Flash_fwd>",
             "nvjet_o", "_rms_norm_kernel", "nvjet_gate_up", "_swiglu_rows_kernel", "nvjet_down"]
    got = bp.assign_ops(step(["indexSelect"] + layer + ["_rms_norm_kernel", "nvjet_head"]), plan)
    assert [g[0] for g in got] == ["embedding", "attn_norm", "qkv", "rope", "attention", "o", "ffn_norm", "gate_up",
                                   "gate_up", "down", "step_norm", "step_head"]


def test_the_summary_adds_up_per_op_and_against_the_step_time():
    plan = policy.Policy().plan(policy.Shape(1, True), WIDE)
    got = bp.assign_ops(step(layer_b1() * 2), plan)
    s = bp.summarize(got, {"qkv": 2e6, "attention": 1e6}, step_ms=0.2)
    assert s["kernels"] == 14 and s["kernel_us"] == 112.0 and s["gap_us"] == 26.0 and s["step_us"] == 200.0
    assert s["ops"]["qkv"] == dict(kernels=2, us=16.0, gap_us=4.0, MB=2.0, GBps=125)
    assert s["ops"]["gate_up"]["GBps"] is None  # no bytes counted for it
    md = bp.profile_markdown(dict(gpu="GPU", torch="t", triton="tr", date="d", command="c", model="m", steps=[
        dict(s, batch=1, context=1024, weights="bf16", profile="WIDE 50/50", masks=None)]))
    assert "| Q, K, V | 2 | 16.0 | 4.0 | 2.0 | 125 |" in md and "batch 1, context 1024, bf16: WIDE 50/50" in md


@pytest.mark.parametrize("batch, union, row", [(1, 0.5, 0.5), (32, 1.0, 0.25)])
def test_bytes_follow_the_op_kinds_and_the_masks(batch, union, row):
    cfg = dict(vocab_size=128, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=16, intermediate_size=128)
    m = Transformer(ModelConfig(**cfg))
    masks = dict(attn_union_live=union, ffn_union_live=union, attn_skip=1 - row, ffn_skip=0.5)
    shape = policy.Shape(batch, True, dense_ffn=batch > 4)
    plan = policy.Policy().plan(shape, WIDE)
    b = bp.op_bytes(m, plan, batch, 100, masks)
    e = 4  # fp32
    kv = batch * 100 * 2 * 4 * 16 * e
    q = 64 * 8 * 16 * e
    assert b["attention"] == pytest.approx(2 * kv * row)  # each row's live KV heads only, at any batch
    if batch == 1:  # the GEMVs and gemm_k read the live groups' weights only
        assert b["qkv"] == pytest.approx(2 * (q * 0.5 + 2 * 64 * 4 * 16 * e))
        assert b["gate_up"] == pytest.approx(2 * 2 * 64 * 128 * e * 0.5)
    else:  # cuBLAS reads everything
        assert b["o"] == pytest.approx(2 * q) and b["down"] == pytest.approx(2 * 64 * 128 * e)
    assert b["step_head"] == 128 * 64 * e


def test_the_profile_lands_beside_the_e2e_results():
    assert bp.profile_out("results/e2e_h200") == "results/decode_profile_h200"
    assert bp.profile_out("/tmp/x/run") == "/tmp/x/run_decode_profile"


def test_a_side_streams_router_goes_to_its_norm_even_when_it_starts_after_the_gemm_beside_it():
    # Policy.router_side_stream at decode B32: the plain norm, then Q, K, V's GEMM on the main stream while
    # norm_route decides on the side stream, starting after the GEMM does; the gap after an overlapped kernel
    # counts from the later of the two ends
    plan = policy.Policy(router_side_stream=True).plan(policy.Shape(32, True, dense_ffn=True), WIDE)
    assert plan.layers[0]["attn_norm"].kind == "norm_route_side"
    layer = [("_rms_norm_kernel", 0, 2), ("nvjet_tst_qkv", 3, 20), ("_norm_route_kernel", 4, 12),
             ("_rope_kernel", 21, 23), ("_attn_decode_kernel", 24, 40), ("nvjet_o", 41, 50),
             ("_rms_norm_kernel", 51, 53), ("nvjet_gate_up", 54, 80), ("_swiglu_rows_kernel", 81, 83),
             ("nvjet_down", 84, 100)]
    kernels = [(n, t0 + 100 * i, t1 + 100 * i) for i in range(2) for n, t0, t1 in layer]
    got = bp.assign_ops(kernels + [("_rms_norm_kernel", 201, 202), ("nvjet_head", 203, 210)], plan)
    want = ["attn_norm", "qkv", "attn_norm", "rope", "attention", "o", "ffn_norm", "gate_up", "gate_up", "down"]
    assert [g[0] for g in got] == want * 2 + ["step_norm", "step_head"]
    assert [g[3] for g in got[:4]] == [0.0, 1.0, 0.0, 1.0], "rope's gap from the GEMM's end, not the router's"
    # the router starting first and ending last: RoPE after the GEMM waited on nothing (the GPU was busy)
    early = [("_rms_norm_kernel", 0, 2), ("_norm_route_kernel", 2, 30), ("nvjet_tst_qkv", 3, 20), ("_rope_kernel", 21, 23)]
    got = bp.assign_ops(early, plan)
    assert [g[0] for g in got] == ["attn_norm", "attn_norm", "qkv", "rope"] and got[3][3] == 0.0


def test_a_gemm_that_comes_as_two_kernels_stays_with_its_op_and_nothing_shifts():
    # cuBLAS may run one GEMM as two kernels (e.g. a split-K pass with a GEMM-like name): the second must
    # not take the next cuBLAS op, or every later kernel would land one op (and one layer) late.
    plan = policy.Policy().plan(policy.Shape(32, True, dense_ffn=True), WIDE)
    layer = ["_norm_route_kernel", "sm90_xmma_gemm_a", "sm90_xmma_gemm_b", "_rope_kernel", "_attn_decode_kernel",
             "nvjet_o", "_rms_norm_kernel", "nvjet_gate_up", "_swiglu_rows_kernel", "nvjet_down", "elementwise_add"]
    got = bp.assign_ops(step(["indexSelect"] + layer * 2 + ["_rms_norm_kernel", "nvjet_head"]), plan)
    want = ["embedding"] + ["attn_norm", "qkv", "qkv", "rope", "attention", "o", "ffn_norm", "gate_up", "gate_up",
                            "down", "down"] * 2 + ["step_norm", "step_head"]
    assert [g[0] for g in got] == want


@pytest.mark.skipif(not kernels_base.INTERPRET, reason="--smoke runs the kernels in the Triton interpreter (the CPU "
                    "test setup); on a GPU `python -m bench.prefill` is the real run")
def test_prefill_chunk_bench_smoke_writes_every_length_and_start(tmp_path):
    from bench import prefill
    rec = prefill.main(["--smoke", "--lengths", "1,9", "--starts", "0,20", "--out", str(tmp_path / "p")])
    got = {(r["profile"], r["start"], r["tokens"]) for r in rec["rows"]}
    assert got == {(p, s, t) for p in ("dense", "WIDE 50/50") for s in (0, 20) for t in (1, 9)}
    md = open(tmp_path / "p.md").read()
    assert "| 20 | 9 |" in md and "Slowest WIDE chunk" in md and os.path.isfile(tmp_path / "p.png")


def test_prefill_chunk_markdown_gives_each_ops_idle_time_and_the_replays_totals():
    from bench import prefill
    row = lambda name, ops, gaps: dict(profile=name, start=0, tokens=100, eager_ms=9.0, graph_ms=5.0, host_ms=4.0,
                                       ops=ops, gaps=gaps, ms_per_1k=50.0)
    rec = dict(gpu="GPU", torch="t", triton="tr", date="d", command="c", model="m", timing="t", starts=[0],
               lengths=[100], rows=[row("dense", {"attn_norm": 100.0, "qkv": 700.0}, {"attn_norm": 30.0, "qkv": 2.0}),
                                    row("WIDE 50/50", {"attn_norm": 800.0, "qkv": 700.0}, {"attn_norm": 90.0, "qkv": 5.0})])
    md = prefill.markdown(rec)
    assert "Idle time before each op's kernels" in md
    assert "| WIDE 50/50 | 0 | 100 | 90 | 5 | 1500 | 95 |" in md, md  # per op, then the kernels' and gaps' sums
    assert "| dense | 0 | 100 | 30 | 2 | 800 | 32 |" in md


def test_prefill_chunk_markdown_lists_the_slowest_chunks_kernels_and_denses():
    from bench import prefill
    row = lambda name, ms, kernels: dict(profile=name, start=0, tokens=100, eager_ms=9.0, graph_ms=ms, host_ms=4.0,
                                         ops={"attn_norm": 1.0}, gaps={}, kernels=kernels, ms_per_1k=50.0)
    rec = dict(gpu="GPU", torch="t", triton="tr", date="d", command="c", model="m", timing="t", starts=[0],
               lengths=[100], rows=[row("dense", 5.0, [["gate_up", "nvjet_a", 1900.0, 32]]),
                                    row("WIDE 50/50", 6.0, [["attn_norm", "_norm_route_part_kernel", 600.0, 32],
                                                            ["attn_norm", "splitKreduce", 250.0, 32]]),
                                    row("WIDE 75/25", 5.5, [["gate_up", "nvjet_b", 1.0, 1]])])
    md = prefill.markdown(rec)  # the slowest WIDE chunk is 50/50's (0.83x), not 75/25's
    assert "of that chunk's replay (WIDE 50/50, 100 tokens at start 0)" in md, md
    assert "| WIDE 50/50 | attn_norm | `splitKreduce` | 250 | 32 |" in md
    assert "| dense | gate_up | `nvjet_a` | 1900 | 32 |" in md and "nvjet_b" not in md


def test_prefill_chunk_bench_refuses_a_bad_policy_in_one_line(capsys):
    from bench import prefill
    from conftest import assert_one_line_error, stopped
    assert_one_line_error(stopped(capsys, prefill.main, "--smoke", "--policy", "no_such=1"), "NAME=VALUE")
    assert_one_line_error(stopped(capsys, prefill.main, "--smoke", "--policy", "router_side_stream=1"), "true or false")


def test_prefill_chunk_bench_reads_policy_fields_in_their_own_types():
    from bench.common import policy_of
    from policy import Policy
    assert policy_of("router_side_stream=false") == Policy()
    assert policy_of("router_side_stream=True,live_attention_min_tokens=64") == Policy(
        router_side_stream=True, live_attention_min_tokens=64)


def test_the_fp8_profile_at_one_token_runs_dense_every_way_the_e2e_bench_times_it():
    from bench.e2e import FP8_ENGINES
    names = [n for n, _, _ in bp.profiles_of(1, "fp8")]
    assert names == ["dense", "dense, _scaled_mm per-tensor", "dense, WIDE kernels", "WIDE 50/50"]
    dense_fp8 = {(p.fp8_tensorwise_one_token, p.fp8_scaled_mm_min_tokens) for k, (_, w, p) in FP8_ENGINES.items()
                 if k.startswith("dense fp8")}
    assert {(p.fp8_tensorwise_one_token, p.fp8_scaled_mm_min_tokens) for _, s, p in bp.profiles_of(1, "fp8")
            if s is None} == dense_fp8
    assert [n for n, _, _ in bp.profiles_of(32, "bf16")] == ["dense", "WIDE 50/50", "WIDE 75/25"]
