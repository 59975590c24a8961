"""The engine's fused step kernels (kernels_step.py) against their twins, and what the engine does to the weights.

The fused small kernels of a step (residual add + RMSNorm + router, RMSNorm alone, RoPE with the
KV-cache write) each have a PyTorch twin; on CPU they run in the Triton interpreter (fp32), and
every buffer they allocate starts poisoned (NaN / -1), so a slot never written fails here.
"""
import pytest
import torch

import engine
import kernels
import kernels_gemv
import kernels_step
import policy
import wide
from conftest import assert_close
from model import KVCache, ModelConfig, RMSNorm, Transformer

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def randn(*shape, seed=0, std=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std).to(DEV)


@pytest.mark.parametrize("rows, D", [(1, 64), (7, 96), (33, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("scale", [3.0, 1e-3])  # 1e-3: mean square ~1e-6, where eps = 1e-5 matters
def test_rms_norm_kernel_matches_twin(rows, D, with_residual, scale):
    norm = RMSNorm(D, 1e-5).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(randn(D, seed=1))
        x, res = randn(2, rows, D, seed=2, std=scale), randn(2, rows, D, seed=3, std=scale)
        got = kernels_step.rms_norm(x, norm, res if with_residual else None)
        ref = kernels_step.rms_norm_ref(x, norm, res if with_residual else None)
    for g, r in zip(got if with_residual else [got], ref if with_residual else [ref]):
        assert_close(g, r, atol=1e-5, what="RMSNorm")


def test_rms_norm_twin_is_the_model_norm_after_the_residual_add():
    norm = RMSNorm(32, 1e-5)
    x, res = torch.randn(3, 32), torch.randn(3, 32)
    h, y = kernels_step.rms_norm_ref(x, norm, res)
    assert torch.equal(h, res + x) and torch.equal(y, norm(res + x))


@pytest.mark.parametrize("B, T, H, Hkv, d", [(1, 1, 4, 2, 16), (2, 5, 8, 2, 32), (3, 1, 4, 4, 16)])
def test_rope_and_store_kernel_matches_twin(B, T, H, Hkv, d):
    cfg = ModelConfig(dim=H * d, n_heads=H, n_kv_heads=Hkv, max_seq_len=32)
    m = Transformer(cfg).to(DEV)
    M, L = B * T, 24
    # q, k, v as column slices of one fused QKV output, as the engine produces them
    qkv = randn(M, (H + 2 * Hkv) * d, seed=4)
    q, k, v = qkv[:, :H * d], qkv[:, H * d:(H + Hkv) * d], qkv[:, (H + Hkv) * d:]
    pos = torch.stack([torch.randperm(L, generator=torch.Generator().manual_seed(b))[:T] for b in range(B)]).to(DEV)
    cos, sin = m.rope(pos)
    step = engine.StepInputs(T == 1, cos.reshape(M, d).contiguous(), sin.reshape(M, d).contiguous(),
                       pos.reshape(M).contiguous(), None, None, None, 0)
    caches = [KVCache(B, L, Hkv, d, torch.float32, DEV) for _ in range(2)]
    for c in caches:  # what is already in the cache must survive
        c.k_cache.copy_(randn(B, Hkv, L, d, seed=5))
        c.v_cache.copy_(randn(B, Hkv, L, d, seed=6))
    got = kernels_step.rope_and_store(q, k, v, step, caches[0].k_cache, caches[0].v_cache, H, Hkv, d)
    ref = kernels_step.rope_and_store_ref(q, k, v, step, caches[1].k_cache, caches[1].v_cache, H, Hkv, d)
    assert_close(got, ref, atol=1e-5, what="rotated q")
    assert_close(caches[0].k_cache, caches[1].k_cache, atol=1e-5, what="k cache")
    assert torch.equal(caches[0].v_cache, caches[1].v_cache), "v is stored as it is"


@pytest.mark.parametrize("B, T, H, Hkv, d, G", [(1, 1, 4, 2, 16, 2), (3, 1, 8, 2, 16, 4), (2, 2, 4, 4, 32, 4)])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("pipe", [0, 3], ids=["fma", "pipe"])
def test_qkv_gemv_with_rope_in_its_epilogue_equals_the_projection_then_rope_and_store(B, T, H, Hkv, d, G, fp8, pipe):
    # One launch for Q, K, V of a decode-sized step: the GEMV's epilogue rotates Q and K and writes K and V
    # into the cache. It must equal gemm_mn (Q's skipped groups 0, K and V its dense tail), then rope_and_store.
    # pipe: one token's pipelined loop (config PIPE) ends in the same epilogue.
    cfg = ModelConfig(dim=H * d, n_heads=H, n_kv_heads=Hkv, max_seq_len=32)
    m = Transformer(cfg).to(DEV)
    M, L, D, nq, nk = B * T, 24, 48, H * d, Hkv * d
    x, w = randn(M, D, seed=1), randn(nq + 2 * nk, D, seed=2) / D ** 0.5
    ws = None
    if fp8:
        w, ws = kernels.quantize_fp8(w)
    mask = torch.rand(M, G, generator=torch.Generator().manual_seed(3)).to(DEV) < 0.5
    gs = nq // G
    pos = torch.stack([torch.randperm(L, generator=torch.Generator().manual_seed(b))[:T] for b in range(B)]).to(DEV)
    cos, sin = (c.reshape(M, d).contiguous() for c in m.rope(pos))
    step = engine.StepInputs(T == 1, cos, sin, pos.reshape(M).contiguous(), None, None, None, 0)
    caches = [KVCache(B, L, Hkv, d, torch.float32, DEV) for _ in range(2)]
    for c in caches:  # what is already in the cache must survive
        c.k_cache.copy_(randn(B, Hkv, L, d, seed=5))
        c.v_cache.copy_(randn(B, Hkv, L, d, seed=6))
    rope = kernels_gemv.Rope(cos, sin, step.slot, caches[0].k_cache, caches[0].v_cache, nq, nk, T)
    got = kernels.gemm_mn(x, w, mask, gs, dense_tail=2 * nk, w_scale=ws, rope=rope, config=dict(PIPE=pipe))
    qkv = kernels.gemm_mn_ref(x, w, mask, gs, dense_tail=2 * nk, w_scale=ws)
    ref = kernels_step.rope_and_store_ref(qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:], step,
                                          caches[1].k_cache, caches[1].v_cache, H, Hkv, d)
    assert_close(got, ref, atol=1e-5, what="rotated q")
    assert_close(caches[0].k_cache, caches[1].k_cache, atol=1e-5, what="k cache")
    assert_close(caches[0].v_cache, caches[1].v_cache, atol=1e-5, what="v cache")


def router(D=64, G=4, seed=0):
    torch.manual_seed(seed)
    return wide.Router(D, G, 32).to(DEV).eval()


@pytest.mark.parametrize("M", [1, 3, 16, 37])  # 2 rows each: 74 tokens run the D-split pair
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("ranks_per_program", [None, 8])  # 8: four programs hand over through the ticket
@pytest.mark.parametrize("scale", [4.0, 1e-3])  # 1e-3: mean square ~1e-6, where eps = 1e-5 matters
@pytest.mark.parametrize("tile, split_max", [(policy.NORM_ROUTE_TILE, policy.NORM_ROUTE_SPLIT_MAX_TOKENS), (16, 128)])
def test_norm_route_kernel_matches_twin_and_the_router_itself(M, with_residual, ranks_per_program, scale, tile,
                                                               split_max):
    # (16, 128): 74 tokens on the split kernel in tiles of 16, the last one partial
    r, norm = router(), RMSNorm(64, 1e-5).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(randn(64, seed=10))
        x, res = randn(2, M, 64, seed=7, std=scale), randn(2, M, 64, seed=11, std=scale)
        ticket = torch.zeros(64, dtype=torch.int32, device=DEV)  # one per tile of NORM_ROUTE_TILE tokens
        for _ in range(2):  # the tickets are back at zero after a launch, so a second one works the same
            normed, keep, keepf, live = kernels_step.norm_route(x, norm, r, res if with_residual else None, ticket,
                                                                ranks_per_program, split_max_tokens=split_max,
                                                                tile_tokens=tile)
            assert not ticket.any()
        ref_normed, ref, ref_f = kernels_step.norm_route_ref(x, norm, r, res if with_residual else None)
        assert torch.equal(keep, ref) and torch.equal(keepf, ref_f), "routing decisions must be identical"
        # A step of a few tokens (the second Linear in the same launch) also gets its live list.
        assert (live is not None) == (2 * M <= tile)
        if live is not None:
            assert torch.equal(live, kernels_step.live_ref(ref)), "the live list: count, live groups, then the others"
        assert torch.equal(keepf, r(res + x if with_residual else x)), "the twin is the router's own rule"
        for got, want in zip(normed if with_residual else [normed], ref_normed if with_residual else [ref_normed]):
            assert_close(got, want, atol=1e-5, what="h / RMSNorm(h)")
    assert 0 < keep.float().mean() < 1, "a test router should skip some groups"


@pytest.mark.parametrize("T", [1, 5, 70])  # one token tile, two, or the D-split pair
def test_norm_route_kernel_executes_on_a_tie(T):
    # z_skip == z_exec exactly: the paper's rule skips only if z_skip > z_exec, so a tie runs.
    r, norm = router(), RMSNorm(64, 1e-5).to(DEV)
    with torch.no_grad():
        r.up.weight.view(4, 2, -1)[:, 1] = r.up.weight.view(4, 2, -1)[:, 0]
        r.up.bias.zero_()
        _, keep, keepf, _ = kernels_step.norm_route(randn(1, T, 64, seed=8), norm, r)
    assert keep.all() and (keepf == 1).all()


@pytest.mark.parametrize("skip", [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 1]], ids=["all off", "all on", "ends off"])
def test_norm_route_live_list_counts_the_groups_some_token_runs_then_lists_the_rest(skip):
    r, norm = router(), RMSNorm(64, 1e-5).to(DEV)
    with torch.no_grad():
        r.up.weight.zero_()
        r.up.bias.view(4, 2)[:, 1] = torch.tensor(skip, dtype=torch.float32) * 2 - 1  # +1: skip, -1: run
        _, keep, _, live = kernels_step.norm_route(randn(1, 2, 64, seed=9), norm, r)
    on = [g for g in range(4) if not skip[g]]
    assert live.tolist() == [len(on)] + on + [g for g in range(4) if skip[g]]
    assert torch.equal(live, kernels_step.live_ref(keep))


def test_norm_route_kernel_skips_when_the_skip_logit_is_larger():
    r, norm = router(), RMSNorm(64, 1e-5).to(DEV)
    with torch.no_grad():
        r.up.weight.zero_()
        r.up.bias.view(4, 2)[:, 1] = torch.tensor([1e-3, -1e-3, 1e-3, -1e-3])  # skip, run, skip, run
        _, keep, _, _ = kernels_step.norm_route(randn(2, 3, 64, seed=9), norm, r)
    assert keep.tolist() == [[[False, True, False, True]] * 3] * 2


# A prefill chunk's norm + router: D split into slices of DS columns, then the slices' sums added up
# (kernels_step._norm_route_part_kernel, _norm_route_finish_kernel). (B, T, D, G, config): one token past the
# split kernel's limit in 5 tiles, the last of one token; D a multiple of neither DS nor BK (a short last
# slice); one slice for all of D; wider tiles and a G that is no power of two; one step per slice (BK = DS).
SPLIT_D = [(1, policy.NORM_ROUTE_SPLIT_MAX_TOKENS + 1, 64, 4, None),
           (2, 37, 100, 4, dict(BT=16, BK=16, DS=32, FINISH_BK=32)),
           (1, 70, 96, 4, dict(BT=16, BK=32, DS=96, FINISH_BK=32)),
           (3, 30, 160, 7, dict(BT=32, BK=16, DS=64, FINISH_BK=16)),
           (1, 70, 100, 4, dict(BT=16, BK=32, DS=32, FINISH_BK=32))]  # one step per slice (weights before the wait)


def split_d_case(B, T, D, G, config, scale, dtype=torch.float32):
    r, norm = router(D, G), RMSNorm(D, 1e-5).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(D, seed=10) + 1)
        # a trained router's biases, not the zeros it starts from (on the scale of h's logits, so both matter)
        r.down.bias.copy_(randn(32, seed=12, std=scale))
        r.up.bias.copy_(randn(2 * G, seed=13, std=0.1 * scale))
    x, res = randn(B, T, D, seed=7, std=scale).to(dtype), randn(B, T, D, seed=11, std=scale).to(dtype)
    return r, norm, x, res


@pytest.mark.parametrize("B, T, D, G, config", SPLIT_D,
                         ids=["65 tokens", "D=100", "one slice", "BT=32, G=7", "BK=DS"])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("scale", [4.0, 1e-3])  # 1e-3: mean square ~1e-6, where eps = 1e-5 matters
def test_prefill_norm_route_splits_d_and_matches_twin_and_the_router_itself(launches, B, T, D, G, config,
                                                                             with_residual, scale):
    r, norm, x, res = split_d_case(B, T, D, G, config, scale)
    residual = res if with_residual else None
    with torch.no_grad():
        normed, keep, keepf, live = kernels_step.norm_route(x, norm, r, residual, config=config)
        ref_normed, ref, ref_f = kernels_step.norm_route_ref(x, norm, r, residual)
        assert live is None, "a prefill chunk has no live list: gemm_mn's tiles take the mask"
        assert torch.equal(keep, ref) and torch.equal(keepf, ref_f), "routing decisions must be identical"
        assert torch.equal(keepf, r(res + x if with_residual else x)), "the twin is the router's own rule"
        for got, want in zip(normed if with_residual else [normed], ref_normed if with_residual else [ref_normed]):
            assert_close(got, want, atol=1e-5, what="h / RMSNorm(h) (or never written: NaN)")
    cfg = kernels_step.config_for("norm_route_parts", config)
    tiles, S = -(-B * T // cfg["BT"]), -(-D // cfg["DS"])
    assert launches.grids["norm_route_part_kernel"] == [(tiles, S)], "a program per (token tile, D-slice)"
    assert launches.grids["norm_route_finish_kernel"] == [(tiles, S + 1)], "... and one more per tile: the rule"
    assert launches.count("norm_route_kernel") == 0
    assert 0 < keep.float().mean() < 1, "a test router should skip some groups"


@pytest.mark.parametrize("B, T, D, G, config", SPLIT_D[1:2] + SPLIT_D[3:4], ids=["D=100", "BT=32, G=7"])
def test_prefill_norm_route_in_bf16_matches_twin_to_rounding_and_decides_on_the_h_it_wrote(B, T, D, G, config):
    # The interpreter's fp32 -> bf16 conversion may round differently from torch's, so h is checked to
    # one bf16 step and the decisions against the router's rule on the h the kernel wrote.
    r, norm, x, res = split_d_case(B, T, D, G, config, 4.0, torch.bfloat16)
    with torch.no_grad():
        (h, y), keep, keepf, _ = kernels_step.norm_route(x, norm, r, res, config=config)
        (h_ref, y_ref), _, _ = kernels_step.norm_route_ref(x, norm, r, res)
        assert h.dtype == y.dtype == torch.bfloat16 and keepf.dtype == torch.float32
        assert ((h.float() - h_ref.float()).abs() <= 2 ** -7 * h_ref.float().abs()).all(), "h: one bf16 step"
        assert_close(y.float(), kernels_step.rms_norm_ref(h, norm).float(), rtol=1e-2, what="RMSNorm(h)")
        assert_close(y.float(), y_ref.float(), rtol=2e-2, what="RMSNorm(h) against the twin")
        # the decisions: wide.Router's rule on the h written, wherever the two logits are more than 1e-4 apart
        # (the kernel's fp32 sums run in another order than torch's and may break a near-tie the other way)
        z = r.logits(h)
        sure = (z[..., 0] - z[..., 1]).abs() > 1e-4
        assert sure.float().mean() > 0.95 and torch.equal(keepf[sure], r(h)[sure])
        assert torch.equal(keep, keepf > 0.5)


def test_prefill_norm_route_executes_on_a_tie_and_skips_on_a_larger_skip_logit():
    # groups 0 and 3: identical execute and skip rows (a tie, whatever h is: it runs); group 1: the skip
    # logit larger by 1e-3 (skipped); group 2: smaller (runs). D = 100 in slices of 32: four partial sums.
    B, T, D, G, config = SPLIT_D[1]
    r, norm, x, res = split_d_case(B, T, D, G, config, 4.0)
    with torch.no_grad():
        up = r.up.weight.view(G, 2, -1)
        up[1:3] = 0
        up[:, 1] = up[:, 0]
        r.up.bias.view(G, 2)[:, 1] = r.up.bias.view(G, 2)[:, 0] + torch.tensor([0.0, 1e-3, -1e-3, 0.0], device=DEV)
        _, keep, keepf, _ = kernels_step.norm_route(x, norm, r, res, config=config)
    assert keep.tolist() == [[[True, False, True, True]] * T] * B and torch.equal(keepf, keep.float())


@pytest.mark.parametrize("M, K", [(1, 64), (5, 100), (3, 5000)])  # K: a power of two, not, past one program's slice
@pytest.mark.parametrize("p_on", [None, 0.0, 0.5, 1.0], ids=["no mask", "all off", "half", "all on"])
def test_swiglu_rows_matches_its_twin_and_zeroes_the_pruned_groups(launches, M, K, p_on):
    gen = torch.Generator().manual_seed(M * K)
    gu = torch.randn(M, 2 * K, generator=gen).to(DEV) * 3
    gs = 4 if K % 4 == 0 else K
    mask = None if p_on is None else (torch.rand(M, K // gs, generator=gen) < p_on).to(DEV)
    got = kernels_step.swiglu_rows(gu, mask, gs if mask is not None else 0)
    want = kernels_step.swiglu_rows_ref(gu, mask, gs)
    assert_close(got, want, rtol=1e-6, what="silu(gate) * up (or never written: NaN)")
    if mask is not None:
        assert (got[~mask.repeat_interleave(gs, 1)] == 0).all(), "a pruned channel is an exact 0"
    assert launches.count("swiglu_rows_kernel") == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_swiglu_rows_and_prefill_norm_route_on_the_gpu_in_bf16():
    # Compiled, in bf16 at the 8B shapes: sigmoid's exp may differ from torch's in the last bit.
    gen = torch.Generator().manual_seed(0)
    K, G = 14336, 112
    gu = torch.randn(300, 2 * K, generator=gen).to(DEV, torch.bfloat16)
    mask = (torch.rand(300, G, generator=gen) < 0.5).to(DEV)
    got, want = kernels_step.swiglu_rows(gu, mask, K // G), kernels_step.swiglu_rows_ref(gu, mask, K // G)
    assert (got != want).float().mean() < 1e-3 and (got.float() - want.float()).abs().max() < 0.05
    r, norm = wide.Router(4096, G, 32).to(DEV).eval(), RMSNorm(4096, 1e-5).to(DEV, torch.bfloat16)
    x, res = (torch.randn(1, 300, 4096, generator=gen).to(DEV, torch.bfloat16) for _ in range(2))
    (h, n), keep, _, _ = kernels_step.norm_route(x, norm, r, res)
    (h_ref, n_ref), keep_ref, _ = kernels_step.norm_route_ref(x, norm, r, res)
    assert torch.equal(h, h_ref) and (n.float() - n_ref.float()).abs().max() < 0.05
    assert (keep != keep_ref).float().mean() < 1e-3, "decisions: at most a near-tie's worth differ"


def test_fused_weights_are_views_and_change_no_output():
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=64, dim=64, n_heads=4, n_kv_heads=2, intermediate_size=128)).to(DEV).eval()
    idx = torch.randint(0, 64, (2, 9), device=DEV)
    with torch.no_grad():
        before = m(idx)
        e = engine.Engine(m)
        after = m(idx)
    assert torch.equal(before, after)
    a, f = m.layers[0].self_attn, m.layers[0].mlp
    wqkv, wgu = e.fused[id(m.layers[0])]
    assert a.q_proj.weight.data_ptr() == wqkv.data_ptr() and torch.equal(wqkv[-a.v_proj.weight.shape[0]:], a.v_proj.weight)
    assert f.up_proj.weight.data_ptr() == wgu[f.gate_proj.weight.shape[0]:].data_ptr()
