"""fp8 weights (e4m3, one scale per output channel) with dynamic width: the decode kernels read the fp8
bytes of the live groups only, and their twins are the bf16 references on the dequantized weights.

On CPU the kernels run in the Triton interpreter (fp32 activations), so the fp8 kernels must equal
their twins to fp32 rounding, pruned outputs exactly zero. End to end, Engine(weights="fp8") must route
and generate exactly as the torch model whose prunable weights were replaced by their fp8 values.
Quality (perplexity) is eval.py's; speed is bench/e2e.py's (`--only fp8`).
"""
import copy

import pytest
import torch

import cli
import engine
import kernels
import kernels_base
import kernels_step
from conftest import assert_close as _assert_close
from generate import generate
from policy import GEMV_MAX_TOKENS, Policy
from test_e2e import DEV, assert_same_masks, rel_err, wide_model


def assert_close(out, ref, tol=1e-5):
    _assert_close(out, ref, rtol=tol, what="fp8 kernel output")


def mask_of(M, G, p_on, gen):
    if p_on in (0.0, 1.0):
        return torch.full((M, G), bool(p_on), device=DEV)
    return (torch.rand(M, G, generator=gen) < p_on).to(DEV)


def fp8_weight(N, K, gen):
    return kernels.quantize_fp8(torch.randn(N, K, generator=gen).to(DEV))


def assert_pruned_zero(out, mask, gs):
    keep = mask.repeat_interleave(gs, dim=1)
    assert (out[:, :keep.shape[1]][~keep] == 0).all(), "pruned outputs must be exactly zero"


# ---------------------------------------------------------------------------------- quantization
def test_quantize_fp8_round_trip_error_is_bounded_per_channel():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen) * torch.logspace(-3, 1, 64)[:, None]  # very different rows
    wq, scale = kernels.quantize_fp8(w)
    assert wq.dtype == torch.float8_e4m3fn and scale.shape == (64,) and scale.dtype == torch.float32
    back = kernels.dequantize_fp8(wq, scale)
    assert torch.allclose(back.abs().amax(1), w.abs().amax(1), rtol=1e-6), "each row's absmax maps to 448 exactly"
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 per element, above the subnormal range
    big = w.abs() >= scale[:, None] * 2.0 ** -6
    assert ((back - w).abs()[big] <= w.abs()[big] * 2.0 ** -4 + 1e-12).all()
    assert ((back - w).norm() / w.norm()).item() < 0.03
    assert kernels.quantize_fp8(torch.zeros(2, 16))[1].tolist() == [1.0, 1.0], "an all-zero row: scale 1"


def correlated_inputs(n, K, gen):
    # inputs that span few directions, of very different sizes, as a model's activations do: GPTQ moves each
    # rounding error into the directions the inputs rarely take
    r = K // 8
    z = torch.randn(n, r, generator=gen) * torch.logspace(1, -1, r)
    return z @ torch.randn(r, K, generator=gen) + 0.01 * torch.randn(n, K, generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gptq_fp8_keeps_round_to_nearests_scales_and_its_codes_survive_a_round_trip(dtype):
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(48, 96, generator=gen) * torch.logspace(-2, 1, 48)[:, None]).to(dtype)
    x = correlated_inputs(256, 96, gen)
    codes, scale = kernels.gptq_fp8(w, x.T @ x / len(x))
    rtn_codes, rtn_scale = kernels.quantize_fp8(w)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape and torch.equal(scale, rtn_scale)
    assert not torch.equal(codes.view(torch.uint8), rtn_codes.view(torch.uint8)), "GPTQ rounds differently"
    # the weights a calibrated model holds (dequantized, in its dtype) quantize back to GPTQ's codes
    again, again_scale = kernels.quantize_fp8(kernels.dequantize_fp8(codes, scale, dtype))
    assert torch.equal(again.view(torch.uint8), codes.view(torch.uint8))
    assert torch.allclose(again_scale, scale, rtol=2.0 ** -8, atol=0)


def test_gptq_fp8_keeps_a_rows_largest_weight_at_448_where_the_moved_errors_would_lower_it():
    # rounding 0.34 * 448 = 152.3 up to 160 moves -7.7 codes onto the next column, times 9.9 (the inputs'
    # correlation over the second input's size): left to rounding, the row's 448 would become 384, and
    # quantize_fp8 of the dequantized row would pick a smaller scale and other codes
    w = torch.tensor([[0.34, 1.0], [-0.34, -1.0]])
    codes, scale = kernels.gptq_fp8(w, torch.tensor([[100.0, 9.9], [9.9, 1.0]]))
    assert codes.float().tolist() == [[160.0, 448.0], [-160.0, -448.0]]
    again, _ = kernels.quantize_fp8(kernels.dequantize_fp8(codes, scale))
    assert torch.equal(again.view(torch.uint8), codes.view(torch.uint8))


def test_gptq_fp8_with_uncorrelated_inputs_rounds_to_nearest():
    # a diagonal hessian: no column's error can be helped by another's, so GPTQ is round-to-nearest; an input
    # channel that was always zero is fine
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(32, 64, generator=gen)
    h = torch.diag(torch.rand(64, generator=gen) + 0.1)
    h[5, 5] = 0.0
    codes, scale = kernels.gptq_fp8(w, h)
    assert torch.equal(codes.view(torch.uint8), kernels.quantize_fp8(w)[0].view(torch.uint8))
    # inputs that were all zero (a linear behind groups the routers skipped for every calibration token)
    codes, scale = kernels.gptq_fp8(w, torch.zeros(64, 64))
    assert torch.equal(codes.view(torch.uint8), kernels.quantize_fp8(w)[0].view(torch.uint8))


def test_gptq_fp8_stops_in_one_line_on_a_hessian_with_inf_or_nan():
    # activations that overflowed on a calibration batch (bf16 on a GPU): one clear line, not a linalg traceback
    w = torch.randn(8, 16)
    for bad in (float("nan"), float("inf")):
        h = torch.eye(16)
        h[3, 4] = bad
        with pytest.raises(cli.UserError, match="inf or NaN.*--weights fp8"):
            kernels.gptq_fp8(w, h)


def test_gptq_fp8_outputs_stay_closer_to_the_full_precision_linear_than_round_to_nearest():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=gen)
    x = correlated_inputs(1024, 128, gen)
    held_out = x[512:]  # calibrated on the first half
    out = kernels.dequantize_fp8(*kernels.gptq_fp8(w, x[:512].T @ x[:512] / 512))
    rtn = kernels.dequantize_fp8(*kernels.quantize_fp8(w))
    err = lambda v: ((held_out @ (v - w).T).norm() / (held_out @ w.T).norm()).item()
    assert err(out) < 0.6 * err(rtn), (err(out), err(rtn))


def test_calibrate_fp8_rounds_every_prunable_linear_and_brings_the_logits_closer():
    from tiny_models import random_model
    torch.manual_seed(0)
    batches = [torch.randint(0, 64, (4, 32)) for _ in range(3)]
    held_out = torch.randint(0, 64, (4, 32))
    m = random_model()
    with torch.no_grad():
        ref = m(held_out)[0]
        rtn = engine.fp8_model(copy.deepcopy(m))(held_out)[0]
        calibrated = kernels.calibrate_fp8(copy.deepcopy(m), batches)
        for layer in calibrated.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                        layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                assert torch.equal(kernels.dequantize_fp8(*kernels.quantize_fp8(lin.weight)), lin.weight)
        assert torch.equal(calibrated.embed_tokens.weight, m.embed_tokens.weight), "only the prunable linears"
        out = engine.fp8_model(calibrated)(held_out)[0]
    assert (out - ref).norm() < 0.95 * (rtn - ref).norm(), ((out - ref).norm(), (rtn - ref).norm())


# ---------------------------------------------------------------------------------- gemm_mn
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("p_on", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_fp8_gemv_mn_matches_the_dequantized_twin(launches, M, p_on, fused):
    gen = torch.Generator().manual_seed(M + int(10 * p_on))
    G, gs, K = 4, 16, 48
    x = torch.randn(M, K, generator=gen).to(DEV)
    w, s = fp8_weight(G * gs, K, gen)
    wu, su = fp8_weight(G * gs, K, gen) if fused else (None, None)
    mask = mask_of(M, G, p_on, gen)
    out = kernels.gemm_mn(x, w, mask, gs, w_up=wu, w_scale=s, w_up_scale=su)
    ref = kernels.gemm_mn_ref(x, w, mask, gs, w_up=wu, w_scale=s, w_up_scale=su)
    assert_close(out, ref)
    assert_pruned_zero(out, mask, gs)
    assert launches.count("gemv_mn_kernel") == 1


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("p_on", [0.0, 0.5, 1.0])
def test_fp8_gemv_mn_computes_the_dense_tail(M, p_on):
    gen = torch.Generator().manual_seed(7 + M)
    x = torch.randn(M, 32, generator=gen).to(DEV)
    w, s = fp8_weight(3 * 16 + 32, 32, gen)  # Q: 3 groups of 16, then K and V: 32 rows
    mask = mask_of(M, 3, p_on, gen)
    out = kernels.gemm_mn(x, w, mask, 16, dense_tail=32, w_scale=s)
    assert_close(out, kernels.gemm_mn_ref(x, w, mask, 16, dense_tail=32, w_scale=s))
    assert_pruned_zero(out, mask, 16)


def test_fp8_gemv_mn_with_no_groups_is_the_dense_linear():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 32, generator=gen).to(DEV)
    (w, s), (wu, su) = fp8_weight(64, 32, gen), fp8_weight(64, 32, gen)
    none = torch.ones(2, 0, dtype=torch.bool, device=DEV)  # the dense model: every row is the tail
    out = kernels.gemm_mn(x, w, none, 16, w_up=wu, dense_tail=64, w_scale=s, w_up_scale=su)
    deq = lambda q, sc: kernels.dequantize_fp8(q, sc)
    assert_close(out, torch.nn.functional.silu(x @ deq(w, s).t()) * (x @ deq(wu, su).t()))


def test_fp8_gemm_mn_with_many_tokens_dequantizes_to_the_same_result():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(20, 32, generator=gen).to(DEV)
    (w, s), (wu, su) = fp8_weight(64, 32, gen), fp8_weight(64, 32, gen)
    mask = mask_of(20, 4, 0.5, gen)
    out = kernels.gemm_mn(x, w, mask, 16, w_up=wu, w_scale=s, w_up_scale=su)
    assert_close(out, kernels.gemm_mn_ref(x, w, mask, 16, w_up=wu, w_scale=s, w_up_scale=su))


# ---------------------------------------------------------------------------------- gemm_k
@pytest.mark.parametrize("M", [1, 4, 21])
@pytest.mark.parametrize("p_on", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("split", [1, 2], ids=["plain", "split"])
@pytest.mark.parametrize("fma", [False, True], ids=["dot", "fma"])
def test_fp8_gemm_k_matches_the_dequantized_twin_with_the_residual(launches, M, p_on, split, fma):
    gen = torch.Generator().manual_seed(M + split)
    G, gs, N = 4, 16, 40
    a = torch.randn(M, G * gs, generator=gen).to(DEV)
    w, s = fp8_weight(N, G * gs, gen)
    res = torch.randn(M, N, generator=gen).to(DEV)
    mask = mask_of(M, G, p_on, gen)
    a_garbage = torch.where(mask.repeat_interleave(gs, 1), a, torch.full_like(a, float("nan")))
    cfg = {"SPLIT": split, "FMA": fma} if M <= GEMV_MAX_TOKENS else None  # FMA: one token, a one-row tile
    tickets = torch.zeros(64, dtype=torch.int32, device=DEV)
    out = kernels.gemm_k(a_garbage, w, mask, gs, residual=res, tickets=tickets, w_scale=s, config=cfg)
    assert_close(out, kernels.gemm_k_ref(a, w, mask, gs, residual=res, w_scale=s))
    assert torch.count_nonzero(tickets) == 0, "the split leaves its tickets at zero"
    assert launches.count("gemm_k_kernel") == 1
    (consts,) = launches.constants["gemm_k_kernel"]  # one token with FMA: a one-row tile, no tl.dot
    small = ("gemm_k_small_long_k" if G * gs >= kernels_base.LONG_K else "gemm_k_small_1" if M == 1
             else "gemm_k_small") + "_fp8"  # as gemm_k picks
    assert consts["BM"] == (1 if fma and M == 1 else kernels_base.CONFIGS[small if M <= GEMV_MAX_TOKENS else "gemm_k"]["BM"])


# ---------------------------------------------------------------------------------- fp8 activations
def test_the_kernels_e4m3_rounding_is_to_nearest_even_for_every_value_and_every_midpoint():
    # Every non-negative e4m3 value, and every midpoint between neighbours (the ties), both signs: a row whose
    # absmax is 448 has scale 1, so its codes are the values rounded. They must be torch's cast, ties to even.
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, NaN excluded
    mids = (grid[1:] + grid[:-1]) / 2
    quarter = grid[:-1] + (grid[1:] - grid[:-1]) / 4  # and a point either side of each midpoint
    row = torch.cat([grid, mids, quarter, mids + (grid[1:] - grid[:-1]) / 4])
    x = torch.stack([row, -row]).to(DEV)
    got = kernels_step.quantize_rows(x)
    assert got.scale.tolist() == [1.0, 1.0]
    assert torch.equal(got.codes.float(), x.to(torch.float8_e4m3fn).float())


def poisoned(*shape, gen, scales=None):
    x = torch.randn(*shape, generator=gen)
    return (x if scales is None else x * scales[:, None]).to(DEV)


@pytest.mark.parametrize("M, K", [(1, 64), (5, 100), (3, 300)])  # K: a power of two or not
@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
@pytest.mark.parametrize("p_on", [None, 0.0, 0.5, 1.0], ids=["no mask", "all off", "half", "all on"])
def test_quantize_rows_matches_its_twin_per_token_codes_and_scales(launches, M, K, swiglu, p_on):
    gen = torch.Generator().manual_seed(M * K)
    scales = torch.logspace(-6, 1 if swiglu else 3, M)  # rows of very different sizes: each gets its own scale
    x = poisoned(M, 2 * K if swiglu else K, gen=gen, scales=scales)
    if M > 1:
        x[1] = 0  # a row of zeros: scale 1, codes 0
    gs = 4 if K % 4 == 0 else K
    mask = None if p_on is None else mask_of(M, K // gs, p_on, gen)
    got = kernels_step.quantize_rows(x, swiglu, mask, gs if mask is not None else 0)
    want = kernels_step.quantize_rows_ref(x, swiglu, mask, gs)
    assert got.codes.dtype == torch.float8_e4m3fn and got.codes.shape == (M, K) and got.scale.shape == (M,)
    assert torch.equal(got.codes.float(), want.codes.float()), "codes differ (or were never written: NaN)"
    _assert_close(got.scale, want.scale, rtol=1e-6, what="scales")
    if mask is not None:
        assert (got.codes.float()[~mask.repeat_interleave(gs, 1)] == 0).all(), "a pruned channel's code is 0"
    assert launches.count("quantize_rows_kernel") == 1


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("M", [1, 6])
def test_rms_norm_with_fp8_output_is_the_norm_then_quantize_rows(residual, M):
    from model import RMSNorm
    gen = torch.Generator().manual_seed(M)
    D = 96
    norm = RMSNorm(D, 1e-5).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=gen))
    x, res = poisoned(2, M, D, gen=gen), poisoned(2, M, D, gen=gen) if residual else None
    got = kernels_step.rms_norm(x, norm, res, fp8=True)
    want = kernels_step.rms_norm_ref(x, norm, res, fp8=True)
    if residual:
        assert torch.equal(got[0], want[0])
        got, want = got[1], want[1]
    assert torch.equal(got.codes.float(), want.codes.float()) and got.codes.shape == (2 * M, D)
    _assert_close(got.scale, want.scale, rtol=1e-6, what="scales")


@pytest.mark.parametrize("M", [1, 7, 32])
def test_scaled_mm_is_the_codes_product_times_both_scales(M):
    # kernels.scaled_mm (torch._scaled_mm) against an fp64 product of the codes and the two scales
    gen = torch.Generator().manual_seed(M)
    a = kernels_step.quantize_rows_ref(poisoned(M, 64, gen=gen, scales=torch.logspace(-2, 2, M)))
    w, s = fp8_weight(48, 64, gen)
    want = (a.codes.double() @ w.double().t()) * a.scale.double()[:, None] * s.double()[None, :]
    _assert_close(kernels.scaled_mm(a, w, s, torch.float32), want, rtol=1e-6, what="scaled_mm")
    _assert_close(kernels.scaled_mm_ref(a, w, s, torch.float32), want, rtol=1e-6, what="its twin")
    if M == 1:  # one row: the library's per-tensor path gives the same product
        _assert_close(kernels.scaled_mm(a, w, s, torch.float32, tensorwise=True), want, rtol=1e-6, what="tensorwise")
    else:
        with pytest.raises(AssertionError, match="one row"):
            kernels.scaled_mm(a, w, s, torch.float32, tensorwise=True)


# ---------------------------------------------------------------------------------- the engine
def dequantized_copy(m, activations=False):
    """The torch model whose prunable weights (q, k, v, o, gate, up, down) are their fp8 values; activations:
    whose linears also quantize their inputs per token (engine.fp8_model)."""
    return engine.fp8_model(copy.deepcopy(m), activations)


def greedy(f, idx, n):
    # Eager steps (no CUDA graph on a GPU): the launch counts below see every decode step's kernels.
    steps = []
    out = generate(f, idx, n, temperature=0.0, cuda_graph=False,
                   on_token=lambda i, t, masks: steps.append({k: [x.clone() for x in v] for k, v in masks.items()}))
    return out, steps


WEIGHTS_ONLY = Policy(fp8_scaled_mm_min_tokens=10 ** 9)  # never _scaled_mm: the decode kernels read the codes
PER_TENSOR = Policy(fp8_tensorwise_one_token=True)  # a one-token step's _scaled_mm through the per-tensor path


@pytest.mark.parametrize("routers, pol", [(True, None), (False, WEIGHTS_ONLY), (False, None), (False, PER_TENSOR)],
                         ids=["wide", "dense, WIDE kernels", "dense, scaled_mm", "dense, scaled_mm per-tensor"])
def test_fp8_engine_generates_exactly_as_the_dequantized_torch_model(launches, monkeypatch, routers, pol):
    # WIDE's steps of this prompt are all decode-sized: the kernels read the weight codes (weights only). The
    # dense model runs WIDE's kernels the same way, or, by default, _scaled_mm on fp8 weights and per-token fp8
    # inputs: then its twin is the model whose linears quantize their inputs too.
    m = wide_model(routers=routers)
    scaled = not routers and pol in (None, PER_TENSOR)
    calls = []
    if pol is PER_TENSOR:  # the decode steps (one token) take the per-tensor path, the 5-token prefill per-row
        real = kernels.scaled_mm
        monkeypatch.setattr(kernels, "scaled_mm", lambda *a, **k: calls.append(k.get("tensorwise")) or real(*a, **k))
    ref_model = dequantized_copy(m, activations=scaled)
    idx = torch.tensor([[5, 17, 3, 44, 9]], device=DEV)
    with torch.no_grad():
        ref, ref_steps = greedy(ref_model, idx, 10)
        launches.clear()
        e = engine.Engine(m, pol, weights="fp8")
        out, out_steps = greedy(e, idx, 10)
    assert torch.equal(out, ref), f"\n{ref.tolist()}\n{out.tolist()}"
    for a, b in zip(ref_steps, out_steps):
        assert_same_masks(a, b)
    # every linear of every decode step: Q+K+V, gate+up (GEMV), O, down; or the quantizations of _scaled_mm's
    # inputs: the two norms, then O's and down's
    for name in ("rms_norm_kernel", "quantize_rows_kernel") if scaled else ("gemv_mn_kernel", "gemm_k_kernel"):
        assert launches.count(name) >= 9 * 2 * len(m.layers), f"{name}: the fp8 decode kernels did not run"
    if scaled:
        assert not launches.count("gemv_mn_kernel") and not launches.count("gemm_k_kernel")
        quantizing = sum(c["FP8"] for c in launches.constants["rms_norm_kernel"])  # per step: 2 a layer, the final one not
        assert quantizing == 2 * len(m.layers) * (launches.count("rms_norm_kernel") - quantizing)
    # and the weights they read were the fp8 codes, not the model's own
    assert all(w.dtype == torch.float8_e4m3fn for d in e.fp8.values() for w, _ in d.values())
    if pol is PER_TENSOR:
        per_step = 4 * len(m.layers)  # Q+K+V, O, gate+up, down
        assert calls == [False] * per_step + [True] * 9 * per_step, "prefill per row, each decode step per tensor"


def test_fp8_engine_logits_match_the_dequantized_model_for_prefill_and_batched_decode():
    # weights only: the prefill on the values the codes stand for, the decode steps on the codes
    m = wide_model()
    ref_model = dequantized_copy(m)
    idx = torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(1)).to(DEV)

    def steps(f):  # a 20-token prefill (dequantized, cuBLAS) then 3-token decode steps (fp8 kernels)
        f.setup_caches(3, 24)
        out = [f(idx, input_pos=torch.arange(20, device=DEV))]
        for i in range(2):
            out.append(f(idx[:, i:i + 1], input_pos=torch.tensor([20 + i], device=DEV)))
        f.clear_caches()
        return torch.cat(out, 1)

    with torch.no_grad():
        ref, out = steps(ref_model), steps(engine.Engine(m, WEIGHTS_ONLY, weights="fp8"))
    _assert_close(out, ref, rtol=1e-5, what="logits")


@pytest.mark.parametrize("routers", [True, False], ids=["wide", "dense"])
def test_an_fp8_prefill_on_scaled_mm_matches_the_model_that_quantizes_its_inputs(launches, routers):
    # A 3 x 20 token prefill: past the decode kernels, the library GEMMs run _scaled_mm on fp8 weights and
    # per-token fp8 inputs (the norm, or quantize_rows, makes them; down's forms silu(gate) * up and, routed,
    # zeroes the pruned groups), as the model whose linears quantize their inputs computes.
    m = wide_model(routers=routers)
    ref_model = dequantized_copy(m, activations=True)
    idx = torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(2)).to(DEV)
    with torch.no_grad():
        ref_masks, masks = {}, {}
        ref = ref_model(idx, masks=ref_masks)
        ref = ref[0] if isinstance(ref, tuple) else ref
        launches.clear()
        out = engine.Engine(m, weights="fp8")(idx, masks=masks)
    _assert_close(out, ref, rtol=1e-5, what="logits")
    assert_same_masks(ref_masks, masks)
    assert launches.count("quantize_rows_kernel") == 2 * len(m.layers) * (2 if routers else 1)
    assert sum(c["SWIGLU"] for c in launches.constants["quantize_rows_kernel"]) == len(m.layers)
    assert not launches.count("gemv_mn_kernel") and not launches.count("gemm_k_kernel")


def test_weights_other_than_bf16_and_fp8_are_refused_and_fp8_is_described():
    m = wide_model()
    with pytest.raises(ValueError, match="bf16 .* or fp8"):
        engine.Engine(m, weights="int4")
    assert isinstance(engine.select(m, "triton", weights="fp8"), engine.Engine)
    e = engine.Engine(m, weights="fp8")
    decode, prefill = e.step_plan(1, True).text(), e.step_plan(64, False).text()
    assert "[fp8]" in decode and "[fp8]" not in prefill and "[fp8 x fp8]" in prefill and "lm_head" in decode
    assert "[fp8 -> fp32]" in engine.Engine(m, WEIGHTS_ONLY, weights="fp8").step_plan(64, False).text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gptq_codes_on_the_gpu_in_bf16_are_the_codes_the_engine_reads():
    # as generate.py --weights fp8-gptq runs on a GPU: the model in bf16, the hessians and GPTQ on the device
    m = wide_model(dtype=torch.bfloat16)
    batches = [torch.randint(0, 96, (4, 48), device=DEV) for _ in range(2)]
    h = {}
    lin = m.layers[0].mlp.gate_proj
    def take(mod, args):  # (returns None: a pre-hook's return value would replace the linear's input)
        h.setdefault("x", args[0].detach().reshape(-1, args[0].shape[-1]))

    hook = lin.register_forward_pre_hook(take)
    with torch.no_grad():
        m(batches[0])
    hook.remove()
    x = h["x"].double()
    codes, _ = kernels.gptq_fp8(lin.weight, x.T @ x / len(x))
    assert codes.is_cuda and not torch.equal(codes.view(torch.uint8), kernels.quantize_fp8(lin.weight)[0].view(torch.uint8))
    kernels.calibrate_fp8(m, batches)
    e = engine.Engine(m, weights="fp8")
    for layer in m.layers:  # the engine's O codes dequantize to the calibrated bf16 weights
        codes, scale = e.fp8[id(layer)]["o"]
        assert torch.equal(kernels.dequantize_fp8(codes, scale, torch.bfloat16), layer.self_attn.o_proj.weight)
    ref_model = dequantized_copy(m)
    idx = torch.tensor([[5, 17, 3, 44, 9]], device=DEV)
    with torch.no_grad():
        assert torch.equal(greedy(e, idx, 8)[0], greedy(ref_model, idx, 8)[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 4])
def test_fp8_decode_kernels_on_the_gpu_in_bf16(M):
    gen = torch.Generator().manual_seed(M)
    G, gs, K, N = 8, 128, 1024, 512
    x = torch.randn(M, K, generator=gen).to(DEV, torch.bfloat16)
    (w, s), (wu, su) = fp8_weight(G * gs, K, gen), fp8_weight(G * gs, K, gen)
    mask = mask_of(M, G, 0.5, gen)
    h = kernels.gemm_mn(x, w, mask, gs, w_up=wu, w_scale=s, w_up_scale=su)
    _assert_close(h, kernels.gemm_mn_ref(x, w, mask, gs, w_up=wu, w_scale=s, w_up_scale=su), rtol=1e-2)
    wd, sd = fp8_weight(N, G * gs, gen)
    res = torch.randn(M, N, generator=gen).to(DEV, torch.bfloat16)
    out = kernels.gemm_k(h, wd, mask, gs, residual=res, w_scale=sd)
    _assert_close(out, kernels.gemm_k_ref(h, wd, mask, gs, residual=res, w_scale=sd), rtol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 5, 64])
def test_fp8_activations_and_scaled_mm_on_the_gpu_in_bf16(M):
    # Compiled, in bf16: quantize_rows (SwiGLU and a mask; sigmoid's exp may differ from torch's in the last
    # bit, so a code may move by one step), rms_norm's fp8 output, and _scaled_mm against its twin.
    gen = torch.Generator().manual_seed(M)
    K, G, N = 4096, 32, 1024
    gu = torch.randn(M, 2 * K, generator=gen).to(DEV, torch.bfloat16)
    mask = mask_of(M, G, 0.5, gen)
    got, want = kernels_step.quantize_rows(gu, True, mask, K // G), kernels_step.quantize_rows_ref(gu, True, mask, K // G)
    differ = got.codes.float() != want.codes.float()
    assert differ.float().mean() < 1e-3, "codes: more than a rounding tie's worth differ"
    _assert_close(got.scale, want.scale, rtol=1e-3, what="scales")
    from model import RMSNorm
    norm = RMSNorm(K, 1e-5).to(DEV, torch.bfloat16)
    x = torch.randn(M, K, generator=gen).to(DEV, torch.bfloat16)
    a, ref = kernels_step.rms_norm(x, norm, fp8=True), kernels_step.rms_norm_ref(x, norm, fp8=True)
    assert (a.codes.float() != ref.codes.float()).float().mean() < 1e-3
    w, s = fp8_weight(N, K, gen)
    _assert_close(kernels.scaled_mm(a, w, s, torch.bfloat16), kernels.scaled_mm_ref(a, w, s, torch.bfloat16), rtol=1e-2)
    if M == 1:
        _assert_close(kernels.scaled_mm(a, w, s, torch.bfloat16, tensorwise=True),
                      kernels.scaled_mm_ref(a, w, s, torch.bfloat16), rtol=1e-2, what="tensorwise")


def logits(f, idx):
    out = f(idx)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dense_fp8_engine_follows_the_model_that_quantizes_its_inputs(dtype):
    # A 48-token prefill: every library linear is "fp8 x fp8" (_scaled_mm, or its twin on the CPU). In fp32 on
    # the CPU the engine quantizes the same values at the same points as the twin model: equal to fp32's
    # rounding. In bf16, where a value is rounded to bf16 before its per-token quantization moves its e4m3 code
    # by a step now and then, and through this tiny model that alone moves the logits as far as the bf16 twin
    # is from the fp32 one: the engine must be no farther from the fp32 twin than the bf16 twin is.
    # (A GPU's _scaled_mm rounds its sums through bf16 in fp32 too, so fp32 is checked exactly on the CPU only.)
    if dtype == torch.float32 and DEV != "cpu":
        pytest.skip("exact only where the twin's fp32 sums are the kernel's (the CPU)")
    m = wide_model(routers=False, dtype=dtype)
    idx = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3)).to(DEV)
    with torch.no_grad():
        out = logits(engine.Engine(m, weights="fp8"), idx)
        ref32 = logits(dequantized_copy(wide_model(routers=False), activations=True), idx)
        if dtype == torch.float32:
            _assert_close(out, ref32, rtol=1e-4, what="logits")
            return
        noise = rel_err(logits(dequantized_copy(m, activations=True), idx), ref32)
    assert rel_err(out, ref32) <= 1.5 * noise, f"engine {rel_err(out, ref32):.3f} vs bf16 twin {noise:.3f}"
