"""
The decode GEMVs: a step of a few tokens streams the weights of its live groups, and nothing else.

  gemv_mn(x[M,K], w[N,K], mask, group_size)  Q (K and V as its dense tail, RoPE and the cache write in its
                                             epilogue); gate+up with silu(gate)*up
kernels.gemm_mn calls it for decode-sized steps; its twin is kernels.gemm_mn_ref. P persistent programs share
the live groups' chunks (BN output rows each) out evenly, whole chunks per program, so no partial sum ever
leaves a program. Each program lists the live groups from the mask itself (a few hundred bytes): reading the
router's live list instead (kernels_step.norm_route writes one; gemm_k's decode tile reads it) made this
kernel use more registers and run slower on the H200 (results/decode_designs_h200.md).
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels_base import (codes_f32, config_for, empty, launch_args, num_sms, pdl_args, pow2_divisor, prior_done,
                          router_rule, router_second_linear, store_live)
from policy import GEMV_MAX_TOKENS


# ---------------------------------------------------------------------------------------------
# gemv_mn: output-channel groups (Q with K and V; gate+up)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _gemv_rows(g, chunk, GS: tl.constexpr, BN: tl.constexpr, HALF: tl.constexpr):
    # The BN output rows of a chunk of group g: consecutive rows, or with RoPE (HALF = head_dim / 2) the
    # rotation pairs (i, i + HALF) of one head side by side, lanes (2j, 2j + 1), so the epilogue has both.
    lane = tl.arange(0, BN)
    if HALF == 0:
        return g * GS + (chunk * BN) % GS + lane
    p = (chunk * BN) % GS // 2 + lane // 2  # the pair, counted within the group
    return g * GS + p // HALF * 2 * HALF + lane % 2 * HALF + p % HALF


@triton.jit
def _gemv_mn_block(x, w, w_up, lst, step, end, t, M, K, KS, sxm, swn, GS: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, FUSED: tl.constexpr, HALF: tl.constexpr, EVICT: tl.constexpr):
    # Loads of one step: chunk step // KS (BN rows of one live group), K slice step % KS.
    chunk, k0 = step // KS, (step % KS) * BK
    ok = (step + tl.zeros([BN], tl.int32)) < end
    g = tl.load(lst + chunk * BN // GS + tl.zeros([BN], tl.int32), mask=ok, other=0)  # [BN], all equal
    n = _gemv_rows(g, chunk, GS, BN, HALF)
    kk = k0 + tl.arange(0, BK)
    kok = (kk < K)[None, :]
    a = tl.load(x + t[:, None] * sxm + kk[None, :], mask=(t < M)[:, None] & kok, other=0.0)
    b = tl.load(w + n[:, None] * swn + kk[None, :], mask=ok[:, None] & kok, other=0.0, eviction_policy=EVICT)
    bu = b
    if FUSED:
        bu = tl.load(w_up + n[:, None] * swn + kk[None, :], mask=ok[:, None] & kok, other=0.0, eviction_policy=EVICT)
    return a, b, bu, g, n


@triton.jit
def _gemv_dot(a, b, acc, FP8: tl.constexpr, IEEE: tl.constexpr):
    # acc += a @ b.T on a 16-row tensor-core tile. fp8 codes and a bf16 input both as f16: the codes exactly
    # and with one hardware conversion per two codes (e4m3 -> bf16 takes several instructions per code),
    # the input exactly within f16's range (|a| < 65504), so the products are the twin's.
    if IEEE:
        return tl.dot(a, tl.trans(codes_f32(b, FP8)), acc, input_precision="ieee")
    if FP8:
        return tl.dot(a.to(tl.float16), tl.trans(b.to(tl.float16)), acc)
    return tl.dot(a, tl.trans(b.to(a.dtype)), acc)


@triton.jit
def _gemv_mn_out(out, ws, wus, mask, res, res_up, t, g, n, M, G, som, FUSED: tl.constexpr, FP8: tl.constexpr,
                 DECIDE: tl.constexpr):
    # A chunk's epilogue: fp8 scales, silu(gate) * up, the (token, group) outputs that skip set to 0 (DECIDE: one
    # token, whose live groups all run, and whose mask the first program is still writing: nothing to load).
    if FP8:  # the per-output-channel scales, in fp32
        res = res * tl.load(ws + n)[None, :]
        if FUSED:
            res_up = res_up * tl.load(wus + n)[None, :]
    if FUSED:
        res = res / (1.0 + tl.exp(-res)) * res_up
    if not DECIDE:
        on = tl.load(mask + t[:, None] * G + g[None, :], mask=(t < M)[:, None] & (g < G)[None, :], other=1) > 0
        res = tl.where(on, res, 0.0)
    tl.store(out + t[:, None] * som + n[None, :], res.to(out.dtype.element_ty), mask=(t < M)[:, None])


@triton.jit
def _gemv_qkv_out(q_out, k_dst, v_dst, cos, sin, slot, mask, res, t, g, n, M, G, NQ, NK, T, sdb, sdh, sdt,
                  BT: tl.constexpr, BN: tl.constexpr, HALF: tl.constexpr, DECIDE: tl.constexpr):
    # The epilogue of Q, K, V with RoPE: each value rounded to the model dtype as the projection's output
    # is, then rotated in fp32 ("rotate half": lane 2j holds x1, lane 2j + 1 its partner x2) and rounded
    # once, as rope_and_store does; Q to q_out (skipped (token, group) outputs 0), K and V (never pruned,
    # V not rotated) straight into the KV cache at each token's slot.
    r = res.to(q_out.dtype.element_ty).to(tl.float32)
    tok = (t < M)[:, None]
    dim = (n % (2 * HALF))[None, :]
    c = tl.load(cos + t[:, None] * 2 * HALF + dim, mask=tok, other=0.0)
    sn = tl.load(sin + t[:, None] * 2 * HALF + dim, mask=tok, other=0.0)
    x1, x2 = tl.split(tl.reshape(r, [BT, BN // 2, 2]))
    rot = tl.reshape(tl.join(-x2, x1), [BT, BN])
    val = tl.where((n < NQ + NK)[None, :], r * c + rot * sn, r)
    q = val
    if not DECIDE:  # (DECIDE: see _gemv_mn_out)
        q = tl.where(tl.load(mask + t[:, None] * G + g[None, :], mask=tok & (g < G)[None, :], other=1) > 0, val, 0.0)
    tl.store(q_out + t[:, None] * NQ + n[None, :], q.to(q_out.dtype.element_ty), mask=tok & (n < NQ)[None, :])
    kv = tl.where(n < NQ + NK, n - NQ, n - NQ - NK)  # the row within K, or within V
    dst = ((t // T).to(tl.int64) * sdb + tl.load(slot + t, mask=t < M, other=0) * sdt)[:, None] + \
        (kv // (2 * HALF) * sdh + kv % (2 * HALF))[None, :]
    tl.store(k_dst + dst, val.to(k_dst.dtype.element_ty), mask=tok & ((n >= NQ) & (n < NQ + NK))[None, :])
    tl.store(v_dst + dst, val.to(v_dst.dtype.element_ty), mask=tok & (n >= NQ + NK)[None, :])


@triton.jit
def _gemv_chunk_out(out, ws, wus, mask, res, res_up, t, g, n, M, G, som, k_dst, v_dst, cos, sin, slot, NQ, NK, T,
                    sdb, sdh, sdt, BT: tl.constexpr, BN: tl.constexpr, FUSED: tl.constexpr, FP8: tl.constexpr,
                    HALF: tl.constexpr, DECIDE: tl.constexpr):
    # A finished chunk's sums [BT, BN] to their outputs: Q, K, V with RoPE and the cache write, or the rest.
    if HALF > 0:
        if FP8:
            res = res * tl.load(ws + n)[None, :]
        _gemv_qkv_out(out, k_dst, v_dst, cos, sin, slot, mask, res, t, g, n, M, G, NQ, NK, T, sdb, sdh, sdt,
                      BT, BN, HALF, DECIDE)
    else:
        _gemv_mn_out(out, ws, wus, mask, res, res_up, t, g, n, M, G, som, FUSED, FP8, DECIDE)


@triton.jit
def _gemv_mn_kernel(x, w, w_up, ws, wus, out, mask, live_list, M, N, K, G, GE, sxm, swn, som,
                    cos, sin, slot, k_dst, v_dst, NQ, NK, T, sdb, sdh, sdt, z, rw, rb, keepf, live, R,
                    GS: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, FUSED: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
                    HALF: tl.constexpr, EVICT: tl.constexpr, PIPE: tl.constexpr, DECIDE: tl.constexpr,
                    RP: tl.constexpr, PDL: tl.constexpr):
    """Decode gemm_mn (M <= BT tokens): the weight rows of groups no token runs are never read.

    Grid (P,), persistent. The live chunks (BN rows of a live group) are shared out evenly, whole chunks
    per program, and one flat loop over (chunk, BK slice of K) steps loads the next step before using this
    one, across chunk boundaries too. One token: FMAs reduced
    every step (or, config DOT, as more tokens); more tokens: tl.dot on a 16-row tile (_gemv_dot). Inactive
    (token, group) outputs and the channels of dead groups are written as zeros. GE groups after the G
    routed ones are always live (the dense tail: K and V after Q, one stream). FP8: w (and w_up) hold e4m3 codes, half the bytes per step; the fp32 sums
    are multiplied by each row's scale (ws, wus) in the epilogue, before the SwiGLU. HALF > 0 (Q, K, V of
    a decode step): the epilogue also applies RoPE and writes K and V into the cache (_gemv_qkv_out; out
    is then Q alone, NQ wide), so no separate RoPE launch; twin kernels_step.rope_and_store_ref after
    kernels.gemm_mn_ref. PIPE > 0 (one token): the loop instead keeps PIPE steps' tiles in flight through
    shared memory (Triton's software pipeline, not registers) and sums [BN, BK] products lane by lane, reduced
    once per chunk rather than every step, so registers no longer cap the bytes in flight. PDL: see
    kernels_base.prior_done (the mask is the previous kernel's). DECIDE (one token, after
    kernels_step.norm_route_deferred): the mask is made here from the router's first Linear z (rw, rb: its second
    Linear, loaded before the wait; the rule of wide.Router, as norm_route applies it), in every program, which
    spares norm_route its ticket and last program; the first program writes it (mask, keepf) and the live list for
    the kernels after this one. Twin: kernels.gemm_mn_ref (the mask: kernels_step.route_ref).
    """
    gg = tl.arange(0, GP)
    if DECIDE:  # the router's second Linear: weights, so before the wait
        rr = tl.arange(0, RP)
        w_exec, w_skip, b_exec, b_skip = router_second_linear(rw, rb, gg, G, rr, R)  # [GP, RP], [GP]
    prior_done(PDL)
    pid, P = tl.program_id(0), tl.num_programs(0)
    t = tl.arange(0, BT)
    if DECIDE:
        zr = tl.load(z + rr, mask=rr < R, other=0.0)[None, :]
        run = (router_rule(zr, w_exec, w_skip, b_exec, b_skip) & (gg < G)).to(tl.int32)  # as norm_route decides
        bits = run[None, :]  # [1, GP]
        if pid == 0:
            tl.store(mask + gg, run.to(tl.uint8), mask=gg < G)
            tl.store(keepf + gg, run.to(tl.float32), mask=gg < G)
            store_live(live, run, gg, G)
    else:
        bits = tl.load(mask + t[:, None] * G + gg[None, :], mask=(t < M)[:, None] & (gg < G)[None, :],
                       other=0).to(tl.int32)
    # WIDE skip: the live-group list; a group no token of the step runs is never put on it, so its weight
    # rows are never read (the dense tail, K and V after Q, is always live)
    live = ((tl.max(bits, 0) > 0) | ((gg >= G) & (gg < G + GE))).to(tl.int32)
    dead = tl.where(gg < G + GE, 1 - live, 0)
    n_live = tl.sum(live, 0)
    lst = live_list + pid * GP  # this program's list: live groups ascending, then dead ones
    tl.store(lst + tl.cumsum(live, 0) - 1, gg, mask=live > 0)
    tl.store(lst + n_live + tl.cumsum(dead, 0) - 1, gg, mask=dead > 0)
    tl.debug_barrier()
    KS = tl.cdiv(K, BK)
    C = n_live * (GS // BN)  # live chunks, shared out evenly
    begin, end = pid * C // P * KS, (pid + 1) * C // P * KS
    if PIPE > 0:  # one token, [BN, BK] lane sums, tiles in flight through shared memory
        acc = tl.zeros([BN, BK], tl.float32)
        acc_up = tl.zeros([BN, BK], tl.float32)
        for step in tl.range(begin, end, num_stages=PIPE):
            a, b, bu, g, n = _gemv_mn_block(x, w, w_up, lst, step, end, t, M, K, KS, sxm, swn, GS, BN, BK, FUSED,
                                            HALF, EVICT)
            acc += codes_f32(b, FP8) * a.to(tl.float32)
            if FUSED:
                acc_up += codes_f32(bu, FP8) * a.to(tl.float32)
            if step % KS == KS - 1:  # chunk done: epilogue
                _gemv_chunk_out(out, ws, wus, mask, tl.sum(acc, 1)[None, :], tl.sum(acc_up, 1)[None, :], t, g, n, M,
                                G, som, k_dst, v_dst, cos, sin, slot, NQ, NK, T, sdb, sdh, sdt, BT, BN, FUSED, FP8,
                                HALF, DECIDE)
                acc = tl.zeros([BN, BK], tl.float32)
                acc_up = tl.zeros([BN, BK], tl.float32)
    else:
        if BT == 1:
            acc = tl.zeros([BN], tl.float32)
            acc_up = tl.zeros([BN], tl.float32)
        else:
            acc = tl.zeros([BT, BN], tl.float32)
            acc_up = tl.zeros([BT, BN], tl.float32)
        a_nx, b_nx, bu_nx, g_nx, n_nx = _gemv_mn_block(x, w, w_up, lst, begin, end, t, M, K, KS, sxm,
                                                       swn, GS, BN, BK, FUSED, HALF, EVICT)
        for step in range(begin, end):
            a, b, bu, g, n = a_nx, b_nx, bu_nx, g_nx, n_nx
            a_nx, b_nx, bu_nx, g_nx, n_nx = _gemv_mn_block(x, w, w_up, lst, step + 1, end, t, M, K, KS,
                                                           sxm, swn, GS, BN, BK, FUSED, HALF, EVICT)
            if BT == 1:
                acc += tl.sum(codes_f32(b, FP8) * a.to(tl.float32), 1)
                if FUSED:
                    acc_up += tl.sum(codes_f32(bu, FP8) * a.to(tl.float32), 1)
            else:
                acc = _gemv_dot(a, b, acc, FP8, IEEE)
                if FUSED:
                    acc_up = _gemv_dot(a, bu, acc_up, FP8, IEEE)
            if step % KS == KS - 1:  # chunk done: epilogue
                _gemv_chunk_out(out, ws, wus, mask, acc if BT > 1 else acc[None, :],
                                acc_up if BT > 1 else acc_up[None, :], t, g, n, M, G, som, k_dst, v_dst, cos, sin,
                                slot, NQ, NK, T, sdb, sdh, sdt, BT, BN, FUSED, FP8, HALF, DECIDE)
                acc = acc * 0.0
                acc_up = acc_up * 0.0
    D = (G + GE - n_live) * (GS // BN)  # dead groups' chunks, shared out the same way: zeros only
    for c in range(pid * D // P, (pid + 1) * D // P):
        n = _gemv_rows(tl.load(lst + n_live + c * BN // GS), c, GS, BN, HALF)
        tl.store(out + t[:, None] * som + n[None, :], tl.zeros([BT, BN], out.dtype.element_ty),
                 mask=(t < M)[:, None])


class Rope(NamedTuple):
    """What Q, K, V's decode GEMV needs to apply RoPE and fill the KV cache in its epilogue."""
    cos: torch.Tensor      # [M, head_dim] per token (engine.StepInputs)
    sin: torch.Tensor
    slot: torch.Tensor     # [M] the cache slot of each token's K/V
    k_cache: torch.Tensor  # [B, Hkv, L, head_dim]
    v_cache: torch.Tensor
    n_q: int               # Q's rows (H * head_dim); K's and V's follow, n_k rows each
    n_k: int
    tokens_per_row: int    # T of the step (M = B * T)


# The Triton kernel gemv_mn launches, by a public name: tools that build it on their own (research.sass) use it.
GEMV_KERNEL = _gemv_mn_kernel


def gemv_mn(x, w, w_up, ws, wus, out, mask, group_size, G, GE, config=None, rope=None, decision=None):
    """Launch _gemv_mn_kernel for kernels.gemm_mn (x [M <= 16, K]; mask uint8 [M, G]; out [M, N]; ws, wus the
    fp8 scales or placeholders). rope (a Rope): w is Q, K, V; the epilogue rotates Q and K and writes K and V
    into the cache; returns Q [M, n_q], rotated. decision (kernels_step.Decision, one token): mask is its keep,
    which this launch makes and writes, with its keepf and live list."""
    M, K = x.shape
    N = w.shape[0]
    fused, fp8 = w_up is not w, ws is not x
    key = ("gemv_mn_1_fused" if fused else "gemv_mn_1") + ("_fp8" if fp8 else "") if M == 1 else "gemv_mn"
    cfg = config_for(key, config)
    P = cfg["programs_per_sm"] * num_sms(x.device)
    GP = max(2, triton.next_power_of_2(G + GE))
    BN = pow2_divisor(group_size, cfg["BN"])
    # One token: fp32 multiply-adds on the weights alone, or (config DOT) the same 16-row tensor-core tile as
    # more tokens, which takes the per-code conversions and products off the FMA pipes at the price of
    # 15 rows of padding in the input tile.
    BT = 1 if M == 1 and not cfg.get("DOT") else GEMV_MAX_TOKENS
    live_list = empty((P, GP), torch.int32, x.device)  # each program's list of the live groups
    half, kc, vc, d = 0, x, x, 0
    if rope is not None:
        kc, vc = rope.k_cache, rope.v_cache
        d = kc.shape[-1]
        # (groups of whole heads, so a chunk's rotation pairs are one head's; Q | K | V fall on head boundaries)
        assert not fused and group_size % d == 0 and rope.n_q + 2 * rope.n_k == N
        assert BN >= 2 and kc.stride() == vc.stride() and kc.stride(-1) == 1, "RoPE pairs need 2 lanes a chunk"
        half, out = d // 2, empty((M, rope.n_q), x.dtype, x.device)
    cos, sin, slot = (rope.cos, rope.sin, rope.slot) if rope is not None else (x, x, x)
    dec = decision
    if dec is not None:
        assert M == 1 and dec.keep.numel() == G and dec.w.shape[0] == 2 * G, "decision: one token's, G groups"
        assert dec.keep.data_ptr() == mask.data_ptr(), "decision: the mask is its keep"
    _gemv_mn_kernel[(P,)](x, w, w_up, ws, wus, out, mask, live_list,
                          M, N, K, G, GE, x.stride(0), w.stride(0), out.stride(0),
                          cos, sin, slot, kc, vc, rope.n_q if rope else 0, rope.n_k if rope else 0,
                          rope.tokens_per_row if rope else 1, kc.stride(0), kc.stride(1) if rope else 0,
                          kc.stride(2) if rope else 0, *((dec.z, dec.w, dec.b, dec.keepf, dec.live, dec.z.shape[-1])
                                                         if dec is not None else (x, x, x, x, x, 0)),
                          GS=group_size, GP=GP,
                          BT=BT, BN=BN, BK=cfg["BK"], FUSED=fused, FP8=fp8, IEEE=x.dtype == torch.float32,
                          HALF=half, EVICT=cfg.get("evict", ""), PIPE=cfg.get("PIPE", 0) if BT == 1 else 0,
                          DECIDE=dec is not None, RP=triton.next_power_of_2(dec.z.shape[-1]) if dec is not None else 1,
                          **launch_args(cfg),
                          **pdl_args(x.device))
    return out
