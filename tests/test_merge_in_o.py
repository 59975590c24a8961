"""Decode attention's merge handed to the O projection (Policy.merge_in_o, one-token steps).

attention_decode(partials=True) stores each work item's normalised partial and log2-sum-exp and merges
nothing; kernels.gemm_k, handed those Partials as its input, rebuilds attention's work list from the head
mask and kv_len and merges each head's chunks as it loads that head's slice. The twins: the partials
merged in PyTorch (merge_partials_ref) equal attention_decode_ref; gemm_k on the partials equals gemm_k_ref on
attention_decode_ref's output. Under the interpreter every buffer starts as NaN, so a partial that was
not written, or a row read that belongs to no item, shows. What the kernels read: test_skipped_work.py.
"""
import pytest
import torch

import engine
import kernels
import kernels_attention
import kernels_step
from policy import Policy
from test_e2e import DEV, GPU, greedy_both, rel_err, wide_model
from test_kernels import assert_close, make_mask, randn

LENGTHS = [1, 16, 17, 70, 33, 2, 64]  # the newest key first, last and alone in a 16-key block


def decode_inputs(H, Hkv, L, D, G, p_on, length, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q, kc, vc = (randn(*s, gen=gen).to(dtype) for s in ((1, H, 1, D), (1, Hkv, L, D), (1, Hkv, L, D)))
    mask = make_mask((1, G), p_on, gen)
    # K/V of KV heads none of whose query heads run are never read: poison them
    dead = ~mask.repeat_interleave(H // G, 1).view(1, Hkv, H // Hkv).any(-1)
    kc_p, vc_p = kc.clone(), vc.clone()
    kc_p[dead], vc_p[dead] = float("nan"), float("nan")
    return q, kc, vc, kc_p, vc_p, mask, torch.tensor([length], device=DEV)


@pytest.mark.parametrize("per_sm", [64, 4, 1])
@pytest.mark.parametrize("p_on", [0.0, 0.25, 1.0])
def test_the_partials_merged_in_torch_equal_attention(per_sm, p_on):
    for i, length in enumerate(LENGTHS):
        q, kc, vc, kc_p, vc_p, mask, kv_len = decode_inputs(8, 2, 70, 16, 4, p_on, length, seed=i)
        parts = kernels_attention.attention_decode(q, kc_p, vc_p, mask, kv_len, config=dict(programs_per_sm=per_sm),
                                                   partials=True)
        ref = kernels_attention.attention_decode_ref(q, kc, vc, mask, kv_len)
        assert_close(kernels_attention.merge_partials_ref(parts, 8), ref)


O_CONFIGS = {"default": None, "FMA": dict(FMA=True), "FMA + PIPE": dict(FMA=True, PIPE=3), "no split": dict(SPLIT=1)}


@pytest.mark.parametrize("o_config", list(O_CONFIGS))
@pytest.mark.parametrize("source", ["own scan", "router's list"])
@pytest.mark.parametrize("fmt", ["fp32", "fp8"])
@pytest.mark.parametrize("G", [4, 8], ids=["group = KV head", "group < KV head"])
def test_gemm_k_merges_the_partials_as_it_reads_them(o_config, source, fmt, G):
    H, Hkv, D, N = 8, 2, 16, 48
    for p_on, per_sm, lengths in ((0.5, 64, (17, 70)), (0.25, 4, (1, 64)), (1.0, 1, (33,)), (0.0, 4, (16,))):
        for i, length in enumerate(lengths):
            q, kc, vc, kc_p, vc_p, mask, kv_len = decode_inputs(H, Hkv, 70, D, G, p_on, length, seed=10 * i + G)
            gen = torch.Generator().manual_seed(i)
            w, res = randn(N, H * D, gen=gen) / (H * D) ** 0.5, randn(1, N, gen=gen)
            w, ws = kernels.quantize_fp8(w) if fmt == "fp8" else (w, None)
            live = kernels_step.live_ref(mask) if source == "router's list" else None
            parts = kernels_attention.attention_decode(q, kc_p, vc_p, mask, kv_len,
                                                       config=dict(programs_per_sm=per_sm), partials=True)
            out = kernels.gemm_k(parts, w, mask, H * D // G, residual=res, w_scale=ws, live=live,
                                 config=O_CONFIGS[o_config])
            y = kernels_attention.attention_decode_ref(q, kc, vc, mask, kv_len).reshape(1, H * D)
            assert_close(out, kernels.gemm_k_ref(y, w, mask, H * D // G, residual=res, w_scale=ws))


def test_partials_are_one_token_only():
    q, kc, vc, _, _, mask, kv_len = decode_inputs(8, 2, 70, 16, 4, 1.0, 20, seed=0)
    parts = kernels_attention.attention_decode(q.expand(2, -1, -1, -1), kc.expand(2, -1, -1, -1),
                                               vc.expand(2, -1, -1, -1), mask.expand(2, -1), kv_len.expand(2),
                                               partials=True)
    with pytest.raises(AssertionError, match="one token"):
        kernels.gemm_k(parts, randn(8, 128), mask.expand(2, -1), 32)


@pytest.mark.parametrize("routers", [True, False], ids=["wide", "dense"])
def test_greedy_tokens_with_the_merge_in_o_equal_the_reference(launches, routers):
    m = wide_model(routers=routers)
    prompt = torch.tensor([[5, 17, 3, 44, 9, 21, 8, 60, 2, 33, 14, 7]], device=DEV)
    (ref, _), (out, _) = greedy_both(m, prompt, 6, policy=Policy(merge_in_o=True))
    assert torch.equal(out, ref), f"\n{ref.tolist()}\n{out.tolist()}"
    e = engine.Engine(m, Policy(merge_in_o=True))
    kinds = {op.kind for op in e.step_plan(1, True, 0).layers[0].values()}
    assert {"decode_live_partials" if routers else "decode_every_partials"} <= kinds, kinds


@GPU
@pytest.mark.parametrize("length", [1, 1000, 8192])
@pytest.mark.parametrize("p_on", [0.5, 1.0])
def test_gpu_gemm_k_merges_llama_shaped_partials(length, p_on):
    H, Hkv, D, G, N = 32, 8, 128, 8, 4096
    torch.manual_seed(length)
    q, kc, vc, kc_p, vc_p, mask, kv_len = decode_inputs(H, Hkv, 8192, D, G, p_on, length, seed=1,
                                                         dtype=torch.bfloat16)
    w = (torch.randn(N, H * D, device=DEV) / (H * D) ** 0.5).to(torch.bfloat16)
    res = torch.randn(1, N, device=DEV, dtype=torch.bfloat16)
    y = kernels_attention.attention_decode_ref(q.float(), kc.float(), vc.float(), mask, kv_len).reshape(1, H * D)
    ref = kernels.gemm_k_ref(y, w.float(), mask, H * D // G, residual=res.float())
    for fmt in ("bf16", "fp8"):
        wq, ws = kernels.quantize_fp8(w) if fmt == "fp8" else (w, None)
        ref_f = ref if ws is None else kernels.gemm_k_ref(y, wq, mask, H * D // G, residual=res.float(), w_scale=ws)
        for live in (None, kernels_step.live_ref(mask)):
            parts = kernels_attention.attention_decode(q, kc_p, vc_p, mask, kv_len, partials=True)
            out = kernels.gemm_k(parts, wq, mask, H * D // G, residual=res, w_scale=ws, live=live)
            assert rel_err(out, ref_f) <= 1e-2, (fmt, live is None, rel_err(out, ref_f))
