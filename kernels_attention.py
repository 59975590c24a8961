"""
WIDE attention kernels: causal prefill and split-KV decode over the live query-head groups only.

Same contract as kernels.py: each op has a PyTorch twin (`*_ref`: SDPA, then the skipped
(token, head-group) outputs set to 0), and the op itself always launches its Triton kernels.
  attention_prefill(q[B,H,T,d], k, v[B,Hkv,T,d], head_mask[B,T,G] or its Layout)  -> [B,H,T,d]
  attention_decode(q[B,H,1,d], k_cache, v_cache[B,Hkv,L,d], head_mask[B,G], kv_len[B]) -> [B,H,1,d]
K/V are never pruned (the cache stays complete); what is skipped is the work of the query
heads a token skips, and in decode the K/V reads of a KV head none of whose query heads run.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels_base import check_device, config_for, empty, launch_args, num_sms, pdl_args, prior_done
from kernels_layout import Layout, as_layout


def _expand_heads(mask, H):
    # [..., G] group mask -> [..., H] head mask (groups are contiguous runs of query heads)
    return mask.repeat_interleave(H // mask.shape[-1], dim=-1)


def attention_prefill_ref(q, k, v, head_mask, causal=True, start=0):
    """SDPA (GQA by repeating K/V heads), then the skipped (token, head-group) outputs set to 0.
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
def attn_block(acc, m_i, l_i, qt, kb, vb, skt, svt, start, pos, kv_end, qk_scale,
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


@triton.jit(do_not_specialize=["T", "MT"])  # chunk lengths: see Policy.warm_chunks
def _attn_prefill_kernel(q, k, v, o, perm, bcounts, B, T, G, MT, start, LK,
                         sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, qk_scale,
                         HPG: tl.constexpr, HPK: tl.constexpr, PACK: tl.constexpr,
                         BMT: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, BP: tl.constexpr,
                         CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    """Flash attention for the live (token, head-group) pairs only.

    Grid (cdiv(T,BMT)+1, H/PACK, B). A program owns PACK query heads that share one group and
    one KV head (GQA packing: rows = PACK heads x BMT tokens, K/V read once for all of them)
    and one tile of the group's live tokens of sequence b, in the layout's ascending order.
    The causal key range ends at the tile's last token, so compaction keeps the causal saving.
    Tiles past the live tokens (block skip) load nothing; they write the zeros of the
    skipped tokens. A chunk of a longer prompt starts at position S (read from `start`, so that one
    CUDA graph serves every start): its T queries sit at S..S+T-1 and see the S + T keys before them.
    Without CAUSAL every query sees the LK keys. Twin: attention_prefill_ref.
    """
    tile, h0, b = tl.program_id(0), tl.program_id(1) * PACK, tl.program_id(2)
    S = tl.load(start).to(tl.int32)
    g, hk = h0 // HPG, h0 // HPK
    bb = tl.arange(0, BP)
    bc = tl.load(bcounts + bb * G + g, mask=bb < B, other=0)
    cnt = tl.sum(tl.where(bb == b, bc, 0), 0)
    off = tl.sum(tl.where(bb < b, bc, 0), 0)
    n_live = tl.cdiv(cnt, BMT)
    r = tl.arange(0, PACK * BMT)
    head = h0 + r // BMT
    dd = tl.arange(0, D)
    # WIDE skip: a dead tile (no live token of this group left for it) loads no Q/K/V: it zeros the
    # skipped tokens' outputs and returns
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
        acc, m_i, l_i = attn_block(acc, m_i, l_i, qt, kb, vb, skt, svt, s, lim, kv_end, qk_scale,
                                   BN, D, False, IEEE)
    for s in range(mid, kv_end, BN):
        acc, m_i, l_i = attn_block(acc, m_i, l_i, qt, kb, vb, skt, svt, s, lim, kv_end, qk_scale,
                                   BN, D, True, IEEE)
    tl.store(o + b * sob + head[:, None] * soh + pos[:, None] * sot + dd[None, :],
             (acc / l_i[:, None]).to(o.dtype.element_ty), mask=ok[:, None])


def attention_prefill(q, k, v, head_mask, causal=True, config=None, start=0):
    """q[B,H,T,d], k/v[B,Hkv,>=start+T,d], head_mask [B,T,G] (or its Layout) -> [B,H,T,d].
    start > 0: a chunk of a longer prompt, its queries at positions start.., the keys before them cached
    (causal: the keys past start + T are never read). start: an int, or a one-element integer tensor on
    q's device (the engine's: no host read, so a CUDA graph replays it at any start)."""
    check_device(q)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    if not torch.is_tensor(start):
        assert k.shape[2] >= start + T or not causal, "causal: k/v hold at least the start + T keys"
        start = torch.full((1,), start, dtype=torch.int32, device=q.device)
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
    """SDPA of one query over cache positions [0, kv_len[b]), then skipped head groups set to 0."""
    B, H, _, _ = q.shape
    rep, L = H // k_cache.shape[1], k_cache.shape[2]
    visible = torch.arange(L, device=q.device)[None, :] < kv_len.to(q.device)[:, None]  # [B, L]
    o = F.scaled_dot_product_attention(q, k_cache.repeat_interleave(rep, 1),
                                       v_cache.repeat_interleave(rep, 1), attn_mask=visible[:, None, None, :])
    keep = _expand_heads(head_mask, H)[:, :, None, None]
    return torch.where(keep, o, torch.zeros((), dtype=o.dtype, device=o.device))


@triton.jit
def merge_chunks(po, plse, first, items, r, HPK: tl.constexpr, BH: tl.constexpr, D: tl.constexpr):
    # Chunks first..first+items-1 of one KV head's HPK query heads (rows r): each chunk's normalised partial (po)
    # and log2-sum-exp (plse), merged in chunk order, one partial at a time (a merge over all of them at once would
    # hold them all in registers for the whole kernel and cost it occupancy). Returns the merged output [BH, D].
    dd = tl.arange(0, D)
    m = tl.full([BH], float("-inf"), tl.float32)
    l = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    for it in range(first, first + items):
        crow = it * HPK + r
        lse = tl.load(plse + crow, mask=r < HPK, other=0.0, cache_modifier=".cg")
        part = tl.load(po + crow[:, None] * D + dd[None, :], mask=(r < HPK)[:, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        old, wgt = tl.exp2(m - m_new), tl.exp2(lse - m_new)
        acc = acc * old[:, None] + wgt[:, None] * part
        l = l * old + wgt
        m = m_new
    return acc / l[:, None]


@triton.jit
def _attn_decode_kernel(q, k, v, head_mask, kv_len, po, plse, tickets, o, B, G, NP, TARGET,
                        sqb, sqh, skb, skh, skt, svb, svh, svt, sob, soh, qk_scale,
                        HKV: tl.constexpr, HPK: tl.constexpr, HPG: tl.constexpr, H2: tl.constexpr,
                        BJ: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, MC: tl.constexpr,
                        D: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    """Split-KV decode attention (one query token per row) over a work list of live items only.

    The work is a list of items (row b, KV head, chunk of that row's cached keys), built in every
    program from the head mask and kv_len (a few hundred values): pairs (b, KV head) none of whose query
    heads run get no item, and each live pair's kv_len[b] keys are cut into chunks of CH keys, CH chosen
    so that the whole step has about TARGET items. So the work spreads evenly over the GPU whatever the
    mask and the rows' lengths (a skipped head or a short row costs no program), and only live K/V are
    read. Grid (NP + B): programs 0..NP-1 take item pid if it exists; program NP + b writes the zeros of
    row b's skipped heads. A program owns its KV head's HPK query heads as rows (padded to BH).
    The merge is in the same launch: a pair cut into several chunks stores each chunk's normalised partial
    and log2-sum-exp, and the last of its programs to take the pair's ticket merges them (in chunk order,
    so the result does not depend on which finished last) and resets the ticket. At most MC chunks per pair
    (longer chunks instead), so that merge stays short. PDL: see kernels_base.prior_done.
    Twin: attention_decode_ref.
    """
    prior_done(PDL)
    pid = tl.program_id(0)
    dd = tl.arange(0, D)
    if pid >= NP:  # row b's heads whose group does not run get exact zeros (O's cuBLAS GEMM reads them)
        b = pid - NP
        hh = tl.arange(0, H2)
        on = tl.load(head_mask + b * G + hh // HPG, mask=hh < HKV * HPK, other=1)
        tl.store(o + b * sob + hh[:, None] * soh + dd[None, :], tl.zeros([H2, D], o.dtype.element_ty),
                 mask=(on == 0)[:, None])
        return
    j = tl.arange(0, BJ)  # pair j: row j // HKV, KV head j % HKV
    jok = j < B * HKV
    live = tl.zeros([BJ], tl.int32)
    for r in tl.static_range(HPK):
        live = live | tl.load(head_mask + (j // HKV) * G + ((j % HKV) * HPK + r) // HPG, mask=jok, other=0).to(tl.int32)
    # WIDE skip: a KV head none of whose query-head groups runs for row b gets no work item, so its K/V
    # are never read
    n = tl.where(live > 0, tl.load(kv_len + j // HKV, mask=jok, other=0), 0)
    # chunks of whole key blocks, about TARGET items in all, at most MC per pair (the merge reads them in turn)
    ch = tl.maximum(tl.maximum(tl.cdiv(tl.cdiv(tl.sum(n, 0), TARGET), BN), tl.cdiv(tl.cdiv(tl.max(n, 0), MC), BN)),
                    1) * BN
    cnt = tl.cdiv(n, ch)
    cum = tl.cumsum(cnt, 0)
    if pid >= tl.sum(cnt, 0):
        return
    pj = tl.sum((cum <= pid).to(tl.int32), 0)  # the pair this item belongs to
    sel = j == pj
    first = tl.sum(tl.where(sel, cum - cnt, 0), 0)
    items = tl.sum(tl.where(sel, cnt, 0), 0)
    end_all = tl.sum(tl.where(sel, n, 0), 0)
    b, hk = pj // HKV, pj % HKV
    start = (pid - first) * ch
    end = tl.minimum(start + ch, end_all)
    r = tl.arange(0, BH)
    head = hk * HPK + r
    act = (r < HPK) & (tl.load(head_mask + b * G + head // HPG, mask=r < HPK, other=0) > 0)
    qt = tl.load(q + b * sqb + head[:, None] * sqh + dd[None, :], mask=act[:, None], other=0.0)
    kb, vb = k + b * skb + hk * skh, v + b * svb + hk * svh
    acc = tl.zeros([BH, D], tl.float32)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    pos = r * 0 + end  # decode: every cached key up to kv_len is visible
    full = start + (end - start) // BN * BN
    for t0 in range(start, full, BN):
        acc, m_i, l_i = attn_block(acc, m_i, l_i, qt, kb, vb, skt, svt, t0, pos, end, qk_scale,
                                   BN, D, False, IEEE)
    for t0 in range(full, end, BN):
        acc, m_i, l_i = attn_block(acc, m_i, l_i, qt, kb, vb, skt, svt, t0, pos, end, qk_scale,
                                   BN, D, True, IEEE)
    optr = o + b * sob + head[:, None] * soh + dd[None, :]
    if items == 1:  # the pair's keys in one chunk: nothing to merge
        tl.store(optr, (acc / l_i[:, None]).to(o.dtype.element_ty), mask=act[:, None])
        return
    row = pid * HPK + r
    tl.store(po + row[:, None] * D + dd[None, :], acc / l_i[:, None], mask=(r < HPK)[:, None])
    tl.store(plse + row, m_i + tl.log2(l_i), mask=r < HPK)
    tl.debug_barrier()  # this program's partial is stored before its ticket is taken (release)
    if tl.atomic_add(tickets + pj, 1) != items - 1:
        return
    tl.atomic_xchg(tickets + pj, 0)  # the pair's last program: reset the ticket, then merge
    merged = merge_chunks(po, plse, first, items, r, HPK, BH, D)
    tl.store(optr, merged.to(o.dtype.element_ty), mask=act[:, None])


# The Triton kernel attention_decode launches, by a public name (research.sass builds it on its own).
DECODE_KERNEL = _attn_decode_kernel


def attention_decode(q, k_cache, v_cache, head_mask, kv_len, config=None, tickets=None):
    """q[B,H,1,d], k/v cache [B,Hkv,L,d], head_mask [B,G], kv_len [B] -> [B,H,1,d].
    kv_len[b] must lie in [1, L] (a decode step's row holds at least its own key; the engine's always do):
    the kernel does not clamp it (a length past L would read past the cache, 0 would leave the row's live
    heads unwritten), since checking it on the host would cost a sync per step.
    tickets: int32 zeros, at least B * Hkv, for the in-launch merge (the kernel leaves them zero, so a
    caller, e.g. the engine's CUDA-graphed step, can keep one buffer); None allocates them."""
    check_device(q)
    B, H, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    G = head_mask.shape[1]
    assert H % G == 0 and H % Hkv == 0, "head_mask must be [B, G] with G | H"
    assert D >= 16 and D == triton.next_power_of_2(D), "head dim must be a power of two >= 16"
    cfg = config_for("attn_decode", config)
    # About `target` items in a step (enough to fill the GPU a few times over); never more programs
    # than items can exist: (B * Hkv pairs) x (chunks of BN keys), or target + one per pair (see kernel).
    target = cfg["programs_per_sm"] * num_sms(q.device)
    n_prog = min(B * Hkv + target, B * Hkv * triton.cdiv(L, cfg["BN"]))
    hpk = H // Hkv
    if tickets is None:
        tickets = torch.zeros(B * Hkv, dtype=torch.int32, device=q.device)
    assert tickets.numel() >= B * Hkv and tickets.dtype == torch.int32, "one int32 ticket per (row, KV head)"
    po = empty((n_prog * hpk, D), torch.float32, q.device)
    plse = empty((n_prog * hpk,), torch.float32, q.device)
    o = empty((B, H, 1, D), q.dtype, q.device)
    _attn_decode_kernel[(n_prog + B,)](
        q, k_cache, v_cache, head_mask.contiguous().view(torch.uint8), kv_len.to(device=q.device, dtype=torch.int32),
        po, plse, tickets, o, B, G, n_prog, target,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), o.stride(0), o.stride(1),
        (1.0 / math.sqrt(D)) * 1.4426950408889634, HKV=Hkv, HPK=hpk, HPG=H // G,
        H2=triton.next_power_of_2(H), BJ=max(2, triton.next_power_of_2(B * Hkv)),
        BH=max(16, triton.next_power_of_2(hpk)), BN=cfg["BN"], MC=cfg["max_chunks"], D=D,
        IEEE=q.dtype == torch.float32, **launch_args(cfg), **pdl_args(q.device))
    return o
