"""fp8 weights (e4m3, one scale per output channel) with dynamic width: the decode kernels read the fp8
bytes of the live groups only, and their twins are the bf16 references on the dequantized weights.

On CPU the kernels run in the Triton interpreter (fp32 activations), so the fp8 kernels must equal
their twins to fp32 rounding, pruned outputs exactly zero. End to end, Engine(weights="fp8") must route
and generate exactly as the torch model whose prunable weights were replaced by their fp8 values.
Quality (perplexity) is eval.py's; speed is bench_e2e.py's (`--only fp8`).
"""
import copy

import pytest
import torch

import engine
import kernels
from conftest import assert_close as _assert_close
from generate import generate
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
def test_fp8_gemm_k_matches_the_dequantized_twin_with_the_residual(launches, M, p_on, split):
    gen = torch.Generator().manual_seed(M + split)
    G, gs, N = 4, 16, 40
    a = torch.randn(M, G * gs, generator=gen).to(DEV)
    w, s = fp8_weight(N, G * gs, gen)
    res = torch.randn(M, N, generator=gen).to(DEV)
    mask = mask_of(M, G, p_on, gen)
    a_garbage = torch.where(mask.repeat_interleave(gs, 1), a, torch.full_like(a, float("nan")))
    cfg = {"SPLIT": split} if M <= kernels.SMALL_M else None
    tickets = torch.zeros(64, dtype=torch.int32, device=DEV)
    out = kernels.gemm_k(a_garbage, w, mask, gs, residual=res, tickets=tickets, w_scale=s, config=cfg)
    assert_close(out, kernels.gemm_k_ref(a, w, mask, gs, residual=res, w_scale=s))
    assert torch.count_nonzero(tickets) == 0, "the split leaves its tickets at zero"
    assert launches.count("gemm_k_kernel") == 1
