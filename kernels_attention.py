"""
WIDE attention kernels: causal prefill and split-KV decode over the active query-head groups only.

Same contract as kernels.py: each op has a PyTorch twin (`*_ref`: SDPA, then the inactive
(token, head-group) outputs set to 0), and the op itself always launches its Triton kernels.
  attention_prefill(q[B,H,T,d], k, v[B,Hkv,T,d], head_mask[B,T,G] or its Layout)  -> [B,H,T,d]
  attention_decode(q[B,H,1,d], k_cache, v_cache[B,Hkv,L,d], head_mask[B,G], kv_len[B]) -> [B,H,1,d]
K/V are never pruned (the cache stays complete); what is skipped is the work of the inactive query
heads, and in decode the K/V reads of a KV head none of whose query heads run.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels_base import check_device, config_for, empty, launch_args, num_sms
from kernels_layout import Layout, as_layout


def _expand_heads(mask, H):
    # [..., G] group mask -> [..., H] head mask (groups are contiguous runs of query heads)
    return mask.repeat_interleave(H // mask.shape[-1], dim=-1)


def attention_prefill_ref(q, k, v, head_mask, causal=True, start=0):
    """SDPA (GQA by repeating K/V heads), then the inactive (token, head-group) outputs set to 0.
    start: the queries sit at positions start.. and k/v hold the start + T keys before them."""
    B, H, T, _ = q.shape
    if isinstance(head_mask, Layout):
        head_mask = head_mask.mask.view(head_mask.batch, -1, head_mask.mask.shape[-1])
    rep = H // k.shape[1]
    visible = None
    if causal and start:
        visible = torch.arange(k.shape[2], device=q.device)[None, :] <= start + torch.arange(T, device=q.device)[:, None]
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                       attn_mask=visible, is_causal=causal and not start)
    keep = _expand_heads(head_mask, H).permute(0, 2, 1)[..., None]  # [B, H, T, 1]
    return torch.where(keep, o, torch.zeros((), dtype=o.dtype, device=o.device))


@triton.jit
def _attn_block(acc, m_i, l_i, qt, kb, vb, skt, svt, start, pos, kv_end, qk_scale,
                BN: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    # One online-softmax step over keys [start, start+BN) (exp2 domain). MASKED: causal + bounds.
    kv = start + tl.arange(0, BN)
    dd = tl.arange(0, D)
    if MASKED:
        kt = tl.load(kb + kv[:, None] * skt + dd[None, :], mask=(kv < kv_end)[:, None], other=0.0)
        vt = tl.load(vb + kv[:, None] * svt + dd[None, :], mask=(kv < kv_end)[:, None], other=0.0)
    else:
        kt = tl.load(kb + kv[:, None] * skt + dd[None, :])
        vt = tl.load(vb + kv[:, None] * svt + dd[None, :])
    s = tl.dot(qt, tl.trans(kt), input_precision="ieee" if IEEE else "tf32") * qk_scale
    if MASKED:
        s = tl.where((kv[None, :] <= pos[:, None]) & (kv < kv_end)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee" if IEEE else "tf32")
    return acc, m_new, l_i


@triton.jit
def _attn_prefill_kernel(q, k, v, o, perm, bcounts, B, T, G, MT, S, LK,
                         sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, qk_scale,
                         HPG: tl.constexpr, HPK: tl.constexpr, PACK: tl.constexpr,
                         BMT: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, BP: tl.constexpr,
                         CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    """Flash attention for the active (token, head-group) pairs only.

    Grid (cdiv(T,BMT)+1, H/PACK, B). A program owns PACK query heads that share one group and
    one KV head (GQA packing: rows = PACK heads x BMT tokens, K/V read once for all of them)
    and one tile of the group's active tokens of sequence b, in the layout's ascending order.
    The causal key range ends at the tile's last token, so compaction keeps the causal saving.
    Tiles past the active tokens (block skip) load nothing; they write the zeros of the
    inactive tokens. A chunk of a longer prompt starts at position S: its T queries sit at S..S+T-1
    and see the LK = S + T keys before them. Twin: attention_prefill_ref.
    """
    tile, h0, b = tl.program_id(0), tl.program_id(1) * PACK, tl.program_id(2)
    g, hk = h0 // HPG, h0 // HPK
    bb = tl.arange(0, BP)
    bc = tl.load(bcounts + bb * G + g, mask=bb < B, other=0)
    cnt = tl.sum(tl.where(bb == b, bc, 0), 0)
    off = tl.sum(tl.where(bb < b, bc, 0), 0)
    n_live = tl.cdiv(cnt, BMT)
    r = tl.arange(0, PACK * BMT)
    head = h0 + r // BMT
    dd = tl.arange(0, D)
    # WIDE skip: a dead tile (no active token of this group left for it) loads no Q/K/V: it zeros the
    # inactive tokens' outputs and returns
    if tile >= n_live:
        p = (tile - n_live) * BMT + r % BMT
        ok = p < T - cnt
        pos = tl.load(perm + g * MT + tl.sum(bc, 0) + b * T - off + p, mask=ok, other=0) - b * T
        tl.store(o + b * sob + head[:, None] * soh + pos[:, None] * sot + dd[None, :],
                 tl.zeros([PACK * BMT, D], o.dtype.element_ty), mask=ok[:, None])
        return
    p = (n_live - 1 - tile) * BMT + r % BMT  # latest (most causal work) tiles run first
    ok = p < cnt
    pos = tl.load(perm + g * MT + off + p, mask=ok, other=0) - b * T
    hi = tl.max(tl.where(ok, pos, 0), 0)
    lo = tl.min(tl.where(ok, pos, T), 0)
    pos = tl.where(ok, pos, hi)  # padded rows mimic the last token: finite, never stored
    qt = tl.load(q + b * sqb + head[:, None] * sqh + pos[:, None] * sqt + dd[None, :],
                 mask=ok[:, None], other=0.0)
    kb, vb = k + b * skb + hk * skh, v + b * svb + hk * svh
    acc = tl.zeros([PACK * BMT, D], tl.float32)
    m_i = tl.full([PACK * BMT], float("-inf"), tl.float32)
    l_i = tl.zeros([PACK * BMT], tl.float32)
    if CAUSAL:
        kv_end = S + hi + 1
        mid = (S + lo + 1) // BN * BN  # keys below mid are visible to every row: no mask needed
        lim = S + pos
    else:
        kv_end = LK
        mid = LK // BN * BN
        lim = pos * 0 + LK
    for s in range(0, mid, BN):
        acc, m_i, l_i = _attn_block(acc, m_i, l_i, qt, kb, vb, skt, svt, s, lim, kv_end, qk_scale,
                                    BN, D, False, IEEE)
    for s in range(mid, kv_end, BN):
        acc, m_i, l_i = _attn_block(acc, m_i, l_i, qt, kb, vb, skt, svt, s, lim, kv_end, qk_scale,
                                    BN, D, True, IEEE)
    tl.store(o + b * sob + head[:, None] * soh + pos[:, None] * sot + dd[None, :],
             (acc / l_i[:, None]).to(o.dtype.element_ty), mask=ok[:, None])


def attention_prefill(q, k, v, head_mask, causal=True, config=None, start=0):
    """q[B,H,T,d], k/v[B,Hkv,start+T,d], head_mask [B,T,G] (or its Layout) -> [B,H,T,d].
    start > 0: a chunk of a longer prompt, its queries at positions start.., the keys before them cached."""
    check_device(q)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    assert k.shape[2] == start + T or not causal, "causal: k/v hold exactly the start + T keys"
    lay = as_layout(head_mask)
    G = lay.mask.shape[1]
    assert lay.batch == B and H % G == 0 and H % Hkv == 0, "head_mask must be [B, T, G] with G | H"
    assert D >= 16 and D == triton.next_power_of_2(D), "head dim must be a power of two >= 16"
    hpg, hpk = H // G, H // Hkv
    pack = math.gcd(hpg, hpk)  # heads sharing one group and one KV head
    cfg = config_for("attn_prefill", config)
    bmt = max(16 // pack, cfg["BM"] // pack, 1)
    o = empty((B, H, T, D), q.dtype, q.device)
    grid = (triton.cdiv(T, bmt) + 1, H // pack, B)
    _attn_prefill_kernel[grid](
        q, k, v, o, lay.perm, lay.batch_counts, B, T, G, B * T, start, k.shape[2],
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        (1.0 / math.sqrt(D)) * 1.4426950408889634, HPG=hpg, HPK=hpk, PACK=pack, BMT=bmt,
        BN=cfg["BN"], D=D, BP=max(2, triton.next_power_of_2(B)), CAUSAL=causal,
        IEEE=q.dtype == torch.float32, **launch_args(cfg))
    return o


def attention_decode_ref(q, k_cache, v_cache, head_mask, kv_len):
    """SDPA of one query over cache positions [0, kv_len[b]), then inactive head groups set to 0."""
    B, H, _, _ = q.shape
    rep, L = H // k_cache.shape[1], k_cache.shape[2]
    visible = torch.arange(L, device=q.device)[None, :] < kv_len.to(q.device)[:, None]  # [B, L]
    o = F.scaled_dot_product_attention(q, k_cache.repeat_interleave(rep, 1),
                                       v_cache.repeat_interleave(rep, 1), attn_mask=visible[:, None, None, :])
    keep = _expand_heads(head_mask, H)[:, :, None, None]
    return torch.where(keep, o, torch.zeros((), dtype=o.dtype, device=o.device))


@triton.jit
def _attn_decode_kernel(q, k, v, head_mask, kv_len, po, plse, G, NS, SPLIT,
                        sqb, sqh, skb, skh, skt, svb, svh, svt, qk_scale,
                        HPK: tl.constexpr, HPG: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                        D: tl.constexpr, IEEE: tl.constexpr):
    """Split-KV decode attention (one query token), partial results per split.

    Grid (NS, Hkv, B). A program owns one KV head (its HPK query heads packed as rows, padded
    to BH) and SPLIT cache positions of sequence b. If none of its query heads' groups is
    active, it returns before reading anything: that KV head's K/V are never read (block skip).
    Writes the normalised partial output and its log2-sum-exp; _attn_merge_kernel combines them.
    Twin: attention_decode_ref.
    """
    s, hk, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = tl.arange(0, BH)
    head = hk * HPK + r
    act = tl.load(head_mask + b * G + head // HPG, mask=r < HPK, other=0) > 0
    n = tl.load(kv_len + b)
    start = s * SPLIT
    # WIDE skip: a KV head none of whose query-head groups runs for row b returns before its K/V are read
    if (tl.max(act.to(tl.int32), 0) == 0) | (start >= n):
        return
    end = tl.minimum(start + SPLIT, n)
    dd = tl.arange(0, D)
    qt = tl.load(q + b * sqb + head[:, None] * sqh + dd[None, :], mask=act[:, None], other=0.0)
    kb, vb = k + b * skb + hk * skh, v + b * svb + hk * svh
    acc = tl.zeros([BH, D], tl.float32)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    pos = r * 0 + end  # decode: every cached key up to kv_len is visible
    full = start + (end - start) // BN * BN
    for t0 in range(start, full, BN):
        acc, m_i, l_i = _attn_block(acc, m_i, l_i, qt, kb, vb, skt, svt, t0, pos, end, qk_scale,
                                    BN, D, False, IEEE)
    for t0 in range(full, end, BN):
        acc, m_i, l_i = _attn_block(acc, m_i, l_i, qt, kb, vb, skt, svt, t0, pos, end, qk_scale,
                                    BN, D, True, IEEE)
    row = (b * G * HPG + head) * NS + s
    tl.store(po + row[:, None] * D + dd[None, :], acc / l_i[:, None], mask=act[:, None])
    tl.store(plse + row, m_i + tl.log2(l_i), mask=act)


@triton.jit
def _attn_merge_kernel(po, plse, head_mask, kv_len, o, G, NS, SPLIT, sob, soh,
                       HPG: tl.constexpr, NSP: tl.constexpr, D: tl.constexpr):
    """Merge the split-KV partials of one (sequence, query head); inactive heads get zeros.

    Grid (H, B). Reads only the splits that hold keys (s*SPLIT < kv_len). Twin: attention_decode_ref.
    """
    h, b = tl.program_id(0), tl.program_id(1)
    dd = tl.arange(0, D)
    optr = o + b * sob + h * soh + dd
    if tl.load(head_mask + b * G + h // HPG) == 0:
        tl.store(optr, tl.zeros([D], o.dtype.element_ty))
        return
    ss = tl.arange(0, NSP)
    sok = (ss < NS) & (ss * SPLIT < tl.load(kv_len + b))
    row = (b * G * HPG + h) * NS + ss
    lse = tl.load(plse + row, mask=sok, other=float("-inf"))
    wgt = tl.where(sok, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    part = tl.load(po + row[:, None] * D + dd[None, :], mask=sok[:, None], other=0.0)
    tl.store(optr, (tl.sum(wgt[:, None] * part, 0) / tl.sum(wgt, 0)).to(o.dtype.element_ty))


def attention_decode(q, k_cache, v_cache, head_mask, kv_len, config=None):
    """q[B,H,1,d], k/v cache [B,Hkv,L,d], head_mask [B,G], kv_len [B] -> [B,H,1,d]."""
    check_device(q)
    B, H, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    G = head_mask.shape[1]
    assert H % G == 0 and H % Hkv == 0, "head_mask must be [B, G] with G | H"
    assert D >= 16 and D == triton.next_power_of_2(D), "head dim must be a power of two >= 16"
    cfg = config_for("attn_decode", config)
    # Shorter splits when B * Hkv is small, so that the grid still fills the GPU (batch 1 has only
    # Hkv programs per split); B * Hkv * L large enough keeps the tuned SPLIT.
    split = max(cfg["BN"], min(cfg["SPLIT"], triton.next_power_of_2(
        triton.cdiv(L * B * Hkv, 2 * num_sms(q.device)))))
    ns = triton.cdiv(L, split)
    hm = head_mask.contiguous().view(torch.uint8)
    kv_len = kv_len.to(device=q.device, dtype=torch.int32)
    po = empty((B, H, ns, D), torch.float32, q.device)
    plse = empty((B, H, ns), torch.float32, q.device)
    hpk = H // Hkv
    _attn_decode_kernel[(ns, Hkv, B)](
        q, k_cache, v_cache, hm, kv_len, po, plse, G, ns, split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        (1.0 / math.sqrt(D)) * 1.4426950408889634, HPK=hpk, HPG=H // G,
        BH=max(16, triton.next_power_of_2(hpk)), BN=cfg["BN"], D=D,
        IEEE=q.dtype == torch.float32, **launch_args(cfg))
    o = empty((B, H, 1, D), q.dtype, q.device)
    _attn_merge_kernel[(H, B)](po, plse, hm, kv_len, o, G, ns, split, o.stride(0), o.stride(1),
                               HPG=H // G, NSP=max(2, triton.next_power_of_2(ns)), D=D)
    return o
