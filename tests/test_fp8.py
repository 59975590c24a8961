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

import engine
import kernels
import kernels_base
from conftest import assert_close as _assert_close
from generate import generate
from policy import GEMV_MAX_TOKENS
from test_e2e import DEV, assert_same_masks, wide_model


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
    small = ("gemm_k_small_long_k" if G * gs >= kernels_base.LONG_K else "gemm_k_small") + "_fp8"  # as gemm_k picks
    assert consts["BM"] == (1 if fma and M == 1 else kernels_base.CONFIGS[small if M <= GEMV_MAX_TOKENS else "gemm_k"]["BM"])


# ---------------------------------------------------------------------------------- the engine
def dequantized_copy(m):
    """The torch model whose prunable weights (q, k, v, o, gate, up, down) are their fp8 values."""
    ref = copy.deepcopy(m)
    with torch.no_grad():
        for layer in ref.layers:
            a, f = layer.self_attn, layer.mlp
            for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, f.gate_proj, f.up_proj, f.down_proj):
                lin.weight.copy_(kernels.dequantize_fp8(*kernels.quantize_fp8(lin.weight), lin.weight.dtype))
    return ref


def greedy(f, idx, n):
    # Eager steps (no CUDA graph on a GPU): the launch counts below see every decode step's kernels.
    steps = []
    out = generate(f, idx, n, temperature=0.0, cuda_graph=False,
                   on_token=lambda i, t, masks: steps.append({k: [x.clone() for x in v] for k, v in masks.items()}))
    return out, steps


FP8_KERNELS = ("gemv_mn_kernel", "gemm_k_kernel")


@pytest.mark.parametrize("routers", [True, False], ids=["wide", "dense"])
def test_fp8_engine_generates_exactly_as_the_dequantized_torch_model(launches, routers):
    m = wide_model(routers=routers)
    ref_model = dequantized_copy(m)
    idx = torch.tensor([[5, 17, 3, 44, 9]], device=DEV)
    with torch.no_grad():
        ref, ref_steps = greedy(ref_model, idx, 10)
        launches.clear()
        e = engine.Engine(m, weights="fp8")
        out, out_steps = greedy(e, idx, 10)
    assert torch.equal(out, ref), f"\n{ref.tolist()}\n{out.tolist()}"
    for a, b in zip(ref_steps, out_steps):
        assert_same_masks(a, b)
    for name in FP8_KERNELS:  # every linear of every decode step: Q+K+V, gate+up (GEMV), O, down
        assert launches.count(name) >= 9 * 2 * len(m.layers), f"{name}: the fp8 decode kernels did not run"
    # and the weights they read were the fp8 codes, not the model's own
    assert all(w.dtype == torch.float8_e4m3fn for d in e.fp8.values() for w, _ in d.values())


def test_fp8_engine_logits_match_the_dequantized_model_for_prefill_and_batched_decode():
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
        ref, out = steps(ref_model), steps(engine.Engine(m, weights="fp8"))
    _assert_close(out, ref, rtol=1e-5, what="logits")


def test_weights_other_than_bf16_and_fp8_are_refused_and_fp8_is_described():
    m = wide_model()
    with pytest.raises(ValueError, match="bf16 .* or fp8"):
        engine.Engine(m, weights="int4")
    assert isinstance(engine.select(m, "triton", weights="fp8"), engine.Engine)
    e = engine.Engine(m, weights="fp8")
    decode, prefill = e.step_plan(1, True).text(), e.step_plan(64, False).text()
    assert "[fp8]" in decode and "[fp8]" not in prefill and "[fp8 -> fp32]" in prefill and "lm_head" in decode


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
