"""
The small fused kernels of an inference step (engine.py), each after its PyTorch twin:

  norm_route      residual add + RMSNorm + the wide.Router decision (and the live list): one launch per sublayer
                  in a decode step, two in a prefill chunk; norm_route_deferred (one token): the same launch
                  without the rule, which the decode GEMV after it applies (kernels_gemv)
  rms_norm        RMSNorm (with the residual add) where there is no router; its output as fp8 rows if asked
  rope_and_store  RoPE on q and k, and k, v written into the static KV cache at each token's slot
  swiglu_rows     silu(gate) * up of a library GEMM's output, the pruned channel groups' zeros in the same launch
  quantize_rows   a linear's input as fp8 rows (per-token e4m3 codes and scale) for kernels.scaled_mm; the
                  SwiGLU product and the pruned channel groups' zeros in the same launch

They skip nothing; they exist so that a decode step is a short list of launches that a CUDA graph
replays. Same contract as kernels.py: Triton on a GPU or under TRITON_INTERPRET=1, or a clear error.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import FP8, Fp8Rows, quantize_fp8
from kernels_base import (INTERPRET, check_device, config_for, empty, launch_args, pdl_args, prior_done, router_rule,
                          router_second_linear, store_live)
from model import apply_rope
from policy import NORM_ROUTE_SPLIT_MAX_TOKENS, NORM_ROUTE_TILE


def rms_norm_ref(x, norm, residual=None, fp8=False):
    """Twin of rms_norm: model.RMSNorm, after h = residual + x rounded to the model dtype; fp8: the
    normed rows as quantize_rows_ref makes them."""
    h = x if residual is None else residual + x
    y = norm(h)
    if fp8:
        y = quantize_rows_ref(y.reshape(-1, y.shape[-1]))
    return y if residual is None else (h, y)


def rms_norm(x, norm, residual=None, fp8=False):
    """norm(x) in one kernel; with residual, (h, norm(h)) for h = residual + x, also in one kernel.
    fp8: norm(...) as Fp8Rows [B*T, D] (the input of kernels.scaled_mm), quantized in the same kernel."""
    check_device(x)
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    M = x2.shape[0]
    y = empty(x2.shape, FP8 if fp8 else x2.dtype, x2.device)
    scale = empty((M,), torch.float32, x2.device) if fp8 else y
    h = empty(x2.shape, x2.dtype, x2.device) if residual is not None else x2
    res = residual.reshape(-1, D).contiguous() if residual is not None else x2
    BD = triton.next_power_of_2(D)
    _rms_norm_kernel[(M,)](x2, res, h, y, scale, norm.weight, D, norm.eps, HAS_RES=residual is not None, FP8=fp8,
                           BD=BD, num_warps=8 if BD >= 2048 else 4, **pdl_args(x.device))
    y = Fp8Rows(y, scale) if fp8 else y.view(x.shape)
    return y if residual is None else (h.view(x.shape), y)


@triton.jit
def _e4m3(v, ok):
    """One row held in registers (fp32, masked by ok) as fp8: scale = max |v| / 448 (1 for a row of zeros)
    and v / scale rounded to the nearest e4m3 value, ties to even, as an fp32 (quantize_fp8's rule). The
    rounding is done here, in integer and fp32 arithmetic, so that the conversion to e4m3 that follows is
    exact on every backend (the interpreter's own conversion rounds wrongly where the carry reaches the
    exponent)."""
    amax = tl.max(tl.where(ok, tl.abs(v), 0.0), 0)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    q = tl.minimum(tl.maximum(v / scale, -448.0), 448.0)
    b = q.to(tl.int32, bitcast=True)  # normal e4m3 values: keep 3 of fp32's 23 mantissa bits
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    tiny = (q + 24576.0) - 24576.0  # below 2^-6, e4m3's subnormals: multiples of 2^-9 (fp32's step at 1.5 * 2^14)
    return tl.where(tl.abs(q) < 0.015625, tiny, normal), scale


@triton.jit
def _rms_norm_kernel(x, res, h_out, y, scale, w, D, eps, HAS_RES: tl.constexpr, FP8: tl.constexpr, BD: tl.constexpr,
                     PDL: tl.constexpr):
    """One row per program: y = RMSNorm(x); with HAS_RES first h = res + x, rounded to the model
    dtype as `x + a` is, and stored. FP8: y gets the row's e4m3 codes and `scale` its scale. Grid (rows,).
    Skips nothing. Twin: rms_norm_ref."""
    prior_done(PDL)
    pid = tl.program_id(0)
    row = pid.to(tl.int64) * D
    d = tl.arange(0, BD)
    ok = d < D
    h = tl.load(x + row + d, mask=ok, other=0.0)
    if HAS_RES:
        h = (tl.load(res + row + d, mask=ok, other=0.0).to(tl.float32) + h.to(tl.float32)).to(h.dtype)
        tl.store(h_out + row + d, h, mask=ok)
    hf = h.to(tl.float32)
    n = (hf * tl.rsqrt(tl.sum(hf * hf, 0) / D + eps)).to(h.dtype)
    wt = tl.load(w + d, mask=ok, other=0.0)
    out = (wt.to(tl.float32) * n.to(tl.float32)).to(h.dtype)
    if FP8:
        q, s = _e4m3(out.to(tl.float32), ok)
        tl.store(y + row + d, q.to(y.dtype.element_ty), mask=ok)
        tl.store(scale + pid, s)
    else:
        tl.store(y + row + d, out, mask=ok)


def quantize_rows_ref(x, swiglu=False, mask=None, group_size=0):
    """Twin of quantize_rows: a = x, or F.silu(gate) * up; the pruned groups zeroed; quantize_fp8 per row."""
    if swiglu:
        g, u = x.chunk(2, dim=-1)
        x = F.silu(g) * u
    if mask is not None:
        x = (x.view(x.shape[0], -1, group_size) * mask[..., None]).view(x.shape[0], -1)
    return Fp8Rows(*quantize_fp8(x))


def quantize_rows(x, swiglu=False, mask=None, group_size=0):
    """x [M, K] -> Fp8Rows: each row's e4m3 codes and absmax scale (quantize_fp8's rule), one row per
    program. swiglu: x is gate and up side by side [M, 2K] and the row is silu(gate) * up, rounded to x's
    dtype as F.silu(g) * u is. mask [M, G] bool: group g's group_size channels zeroed where it is False
    (before the scale is taken, so a pruned channel is an exact 0 code)."""
    check_device(x)
    assert x.dim() == 2 and x.stride(1) == 1, "rows with contiguous elements"
    M, K = x.shape[0], x.shape[1] // (2 if swiglu else 1)
    codes = empty((M, K), FP8, x.device)
    scale = empty((M,), torch.float32, x.device)
    BK = triton.next_power_of_2(K)
    _quantize_rows_kernel[(M,)](x, codes, scale, x if mask is None else mask, K, x.stride(0),
                                1 if mask is None else mask.shape[1], max(1, group_size), SWIGLU=swiglu,
                                MASKED=mask is not None, BK=BK, num_warps=16 if BK >= 8192 else 4,
                                **pdl_args(x.device))
    return Fp8Rows(codes, scale)


@triton.jit
def _quantize_rows_kernel(x, codes, scale, mask, K, sx, G, GS, SWIGLU: tl.constexpr, MASKED: tl.constexpr,
                          BK: tl.constexpr, PDL: tl.constexpr):
    """One row per program: the row (x's, or silu(gate) * up from x's two halves), the pruned groups
    zeroed, as e4m3 codes and a scale (_e4m3). Grid (rows,). Skips nothing. Twin: quantize_rows_ref."""
    prior_done(PDL)
    m = tl.program_id(0)
    c = tl.arange(0, BK)
    ok = c < K
    run = ok
    if MASKED:  # a pruned channel is not even loaded: it is 0
        run = ok & (tl.load(mask + m * G + c // GS, mask=ok, other=0) != 0)
    row = x + m.to(tl.int64) * sx
    v = tl.load(row + c, mask=run, other=0.0)
    if SWIGLU:
        u = tl.load(row + K + c, mask=run, other=0.0)
        g = v.to(tl.float32)
        v = ((g / (1.0 + tl.exp(-g))).to(u.dtype).to(tl.float32) * u.to(tl.float32)).to(u.dtype)
    q, s = _e4m3(v.to(tl.float32), ok)
    tl.store(codes + m.to(tl.int64) * K + c, q.to(codes.dtype.element_ty), mask=ok)
    tl.store(scale + m, s)


def swiglu_rows_ref(gu, mask=None, group_size=0):
    """Twin of swiglu_rows: F.silu(gate) * up, then the pruned channel groups zeroed."""
    g, u = gu.chunk(2, dim=-1)
    a = F.silu(g) * u
    if mask is not None:
        a = (a.view(a.shape[0], -1, group_size) * mask[..., None]).view(a.shape[0], -1)
    return a


def swiglu_rows(gu, mask=None, group_size=0):
    """gate and up side by side [M, 2K] (one library GEMM's output) -> silu(gate) * up [M, K], rounded as
    F.silu(g) * u is, with group g's group_size channels zeroed where mask [M, G] is False (a pruned channel
    is not even loaded). One launch where torch takes two or three (silu, the product, the zeros)."""
    check_device(gu)
    assert gu.dim() == 2 and gu.stride(1) == 1, "rows with contiguous elements"
    M, K = gu.shape[0], gu.shape[1] // 2
    a = empty((M, K), gu.dtype, gu.device)
    BK = min(triton.next_power_of_2(K), 4096)
    _swiglu_rows_kernel[(M, triton.cdiv(K, BK))](gu, a, gu if mask is None else mask, K, gu.stride(0),
                                                  1 if mask is None else mask.shape[1], max(1, group_size),
                                                  MASKED=mask is not None, BK=BK, num_warps=8 if BK >= 2048 else 4,
                                                  **pdl_args(gu.device))
    return a


@triton.jit
def _swiglu_rows_kernel(gu, a, mask, K, sx, G, GS, MASKED: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    """A slice of BK channels of one row per program: silu(gate) * up, the pruned groups' channels 0.
    Grid (rows, cdiv(K, BK)). Skips nothing it writes. Twin: swiglu_rows_ref."""
    prior_done(PDL)
    m = tl.program_id(0)
    c = tl.program_id(1) * BK + tl.arange(0, BK)
    ok = c < K
    run = ok
    if MASKED:  # a pruned channel is not even loaded: it is 0
        run = ok & (tl.load(mask + m * G + c // GS, mask=ok, other=0) != 0)
    row = gu + m.to(tl.int64) * sx
    g = tl.load(row + c, mask=run, other=0.0)
    u = tl.load(row + K + c, mask=run, other=0.0)
    gf = g.to(tl.float32)
    v = ((gf / (1.0 + tl.exp(-gf))).to(u.dtype).to(tl.float32) * u.to(tl.float32)).to(u.dtype)
    tl.store(a + m.to(tl.int64) * K + c, v, mask=ok)


def rope_and_store_ref(q, k, v, step, k_dst, v_dst, H, Hkv, d):
    """Twin of rope_and_store: model.apply_rope on q and k, then k and v written at each token's slot."""
    M = q.shape[0]
    B = k_dst.shape[0]
    T = M // B
    cos, sin = step.cos.view(B, T, 1, d), step.sin.view(B, T, 1, d)
    q = apply_rope(q.view(B, T, H, d), cos, sin).view(M, H * d)
    k = apply_rope(k.view(B, T, Hkv, d), cos, sin)                        # [B, T, Hkv, d]
    idx = step.slot.view(B, 1, T, 1).expand(B, Hkv, T, d)
    k_dst.scatter_(2, idx, k.transpose(1, 2).to(k_dst.dtype))
    v_dst.scatter_(2, idx, v.view(B, T, Hkv, d).transpose(1, 2).to(v_dst.dtype))
    return q


def rope_and_store(q, k, v, step, k_dst, v_dst, H, Hkv, d):
    """RoPE on q [M, H*d] and k [M, Hkv*d]; k and v go into k_dst/v_dst [B, Hkv, L, d] at step.slot."""
    check_device(q)
    # q, k, v may be column slices of one fused QKV output: rows strided, elements contiguous.
    q, k, v = (t if t.stride(1) == 1 else t.contiguous() for t in (q, k, v))
    assert k.stride(0) == v.stride(0), "k and v must share a row stride"
    M = q.shape[0]
    q_out = empty((M, H * d), q.dtype, q.device)
    T = M // k_dst.shape[0]
    _rope_kernel[(M,)](q, k, v, step.cos, step.sin, step.slot, q_out, k_dst, v_dst, T, H, Hkv, q.stride(0),
                       k.stride(0), k_dst.stride(0), k_dst.stride(1), k_dst.stride(2),
                       HP=triton.next_power_of_2(H), HKP=triton.next_power_of_2(Hkv), HALF=d // 2, num_warps=4,
                       **pdl_args(q.device))
    return q_out


@triton.jit
def _rotate(src, dst, ok, c1, c2, s1, s2, HALF: tl.constexpr):
    # apply_rope's "rotate half" in fp32: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), rounded once.
    x1 = tl.load(src, mask=ok, other=0.0)
    x2 = tl.load(src + HALF, mask=ok, other=0.0)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(dst, (a1 * c1 + (-a2) * s1).to(x1.dtype).to(dst.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, (a2 * c2 + a1 * s2).to(x1.dtype).to(dst.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["T"])  # chunk lengths: see Policy.warm_chunks
def _rope_kernel(q, k, v, cos, sin, slot, q_out, k_dst, v_dst, T, H, HKV, sq, sk, sdb, sdh, sdt,
                 HP: tl.constexpr, HKP: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr):
    """RoPE for every head of one token. Grid (B*T,): the query heads go to q_out; the key heads, and
    the value heads as they are, straight into the KV cache at the token's slot (K/V are never pruned:
    the cache stays dense). Skips nothing. Twin: rope_and_store_ref."""
    # sq: row stride of q (its heads contiguous); q_out is [M, H * 2 * HALF]; sk: row stride of k and v.
    prior_done(PDL)
    m = tl.program_id(0)
    i = tl.arange(0, HALF)[None, :]
    c1, c2 = tl.load(cos + m * 2 * HALF + i), tl.load(cos + m * 2 * HALF + HALF + i)
    s1, s2 = tl.load(sin + m * 2 * HALF + i), tl.load(sin + m * 2 * HALF + HALF + i)
    hq = tl.arange(0, HP)[:, None]
    _rotate(q + m * sq + hq * 2 * HALF + i, q_out + m * H * 2 * HALF + hq * 2 * HALF + i, hq < H,
            c1, c2, s1, s2, HALF)
    hk = tl.arange(0, HKP)[:, None]
    dst = (m // T).to(tl.int64) * sdb + hk * sdh + tl.load(slot + m) * sdt
    _rotate(k + m * sk + hk * 2 * HALF + i, k_dst + dst + i, hk < HKV, c1, c2, s1, s2, HALF)
    dd = tl.arange(0, 2 * HALF)[None, :]
    vals = tl.load(v + m * sk + hk * 2 * HALF + dd, mask=hk < HKV, other=0.0)
    tl.store(v_dst + dst + dd, vals.to(v_dst.dtype.element_ty), mask=hk < HKV)


def route_ref(router, x):
    """wide.Router's inference rule (skip iff z_skip > z_exec; a tie executes): (bool, float) [B, T, G]."""
    z = router.logits(x)
    keep = z[..., 1] <= z[..., 0]
    return keep, keep.float()


def live_ref(keep):
    """Twin of norm_route's live list: keep bool [..., G] -> int32 [1 + G], the number of groups some token
    runs, those groups ascending, then the others ascending."""
    on = keep.reshape(-1, keep.shape[-1]).any(0)
    groups = torch.arange(on.numel(), device=keep.device)
    return torch.cat([on.sum().view(1), groups[on], groups[~on]]).to(torch.int32)


def norm_route_ref(x, norm, router, residual=None):
    """Twin of norm_route: (rms_norm_ref(x, norm, residual), *route_ref(router, x or h))."""
    normed = rms_norm_ref(x, norm, residual)
    return (normed, *route_ref(router, x if residual is None else normed[0]))


def norm_route(x, norm, router, residual=None, tickets=None, ranks_per_program=None, config=None,
               split_max_tokens=NORM_ROUTE_SPLIT_MAX_TOKENS, tile_tokens=NORM_ROUTE_TILE):
    """The start of a sublayer for the tokens of a step: h = residual + x (if given), RMSNorm(h), and the
    wide.Router decision on the raw h. Returns (normed, keep bool, keep float, live) with
    normed = norm(x), or (h, norm(h)) with a residual; masks [B, T, G]. live: the step's live list, int32
    [1 + G] (the number of groups some token runs, those groups ascending, then the others), which the
    decode kernels read instead of scanning the mask; None for a step of more than one token tile.
    Up to split_max_tokens tokens (decode steps), one launch whose programs split the router's ranks, so a
    few tokens still spread over the GPU. Longer steps (prefill chunks), two launches with D split over
    programs: each (tile of tokens, D-slice) gets its slice's sums of squares and share of the router's first
    Linear (every rank, so the router's weights are read once per tile), then each (tile, D-slice) adds the
    slices up in a fixed order and writes its RMSNorm(h), and one more program per tile applies the rule.
    tickets: int32 zeros, one per tile of tile_tokens tokens (a power of two; the kernel leaves them zero, so a
    CUDA graph can replay it; launches on one stream run one after another, so an engine needs one buffer)."""
    check_device(x)
    B, T, D = x.shape
    M = B * T
    down, up = router.down, router.up
    G, R = router.n_groups, down.out_features
    x2 = x.reshape(M, D).contiguous()
    res = residual.reshape(M, D).contiguous() if residual is not None else x2
    y = empty((M, D), x.dtype, x.device)
    h = empty((M, D), x.dtype, x.device) if residual is not None else y
    keep = empty((M, G), torch.uint8, x.device)
    keepf = empty((M, G), torch.float32, x.device)
    if M > split_max_tokens:  # a prefill chunk: D split over programs, then the slices' partial sums added up
        cfg = config_for("norm_route_parts", config)
        BT, BK, DS = cfg["BT"], cfg["BK"], cfg["DS"]
        assert DS % BK == 0 and DS % cfg["FINISH_BK"] == 0, "norm_route_parts: DS a multiple of BK and FINISH_BK"
        n_tiles, S, RP = triton.cdiv(M, BT), triton.cdiv(D, DS), max(16, triton.next_power_of_2(R))
        part_ss = empty((S, M), torch.float32, x.device)  # each D-slice's sums of squares, per token
        part_z = empty((S, M, RP), torch.float32, x.device)  # ... and its share of the first Linear
        prec = cfg.get("PREC", "ieee")
        _norm_route_part_kernel[(n_tiles, S)](
            x2, res, h, down.weight, part_ss, part_z, M, D, R, HAS_RES=residual is not None, BT=BT, BK=BK, DS=DS,
            RP=RP, PREC=prec, **launch_args(cfg), **pdl_args(x.device))
        # the finish only streams h into y (and one program per tile the rule): its own column step and warps
        _norm_route_finish_kernel[(n_tiles, S + 1)](
            h if residual is not None else x2, y, norm.weight, norm.eps, down.bias, up.weight, up.bias, part_ss,
            part_z, keep, keepf, M, D, R, G, S, BT=BT, BK=cfg["FINISH_BK"], DS=DS, RP=RP,
            BG=max(16, triton.next_power_of_2(G)), PREC=prec, num_warps=cfg["finish_warps"], **pdl_args(x.device))
        normed = y.view(x.shape) if residual is None else (h.view(x.shape), y.view(x.shape))
        return normed, keep.view(torch.bool).view(B, T, G), keepf.view(B, T, G), None
    normed, z, live = _norm_route_split(x, norm, router, residual, tickets, ranks_per_program, x2, res, y, h, keep,
                                        keepf, tile_tokens, True)
    return normed, keep.view(torch.bool).view(B, T, G), keepf.view(B, T, G), live


class Decision(NamedTuple):
    """A one-token router decision that norm_route_deferred left to the kernel reading the mask: the router's
    first Linear (z, fp32) is written; that kernel (the decode GEMV, kernels_gemv) applies the second Linear (w, b)
    and the rule in every program and writes keep, keepf and live from its first, before any later kernel reads
    them (they are the buffers norm_route would have filled)."""
    keep: torch.Tensor   # bool [1, 1, G]
    keepf: torch.Tensor  # float [1, 1, G]
    live: torch.Tensor   # int32 [1 + G]
    z: torch.Tensor      # fp32 [1, R]
    w: torch.Tensor      # router.up.weight [2G, R]: (execute, skip) rows per group
    b: torch.Tensor      # router.up.bias [2G]


def norm_route_deferred(x, norm, router, residual=None, tickets=None):
    """norm_route for one token without the decision: the residual add, the RMSNorm and the router's first
    Linear, so the launch has no ticket and no last program; (normed, Decision) for the decode GEMV to finish.
    The deferred rule is wide.Router's, so the masks and the live list are norm_route's."""
    B, T, D = x.shape
    assert B * T == 1, "norm_route_deferred: one token (a decode step of one row)"
    G = router.n_groups
    x2 = x.reshape(1, D).contiguous()
    res = residual.reshape(1, D).contiguous() if residual is not None else x2
    y = empty((1, D), x.dtype, x.device)
    h = empty((1, D), x.dtype, x.device) if residual is not None else y
    keep, keepf = empty((1, G), torch.uint8, x.device), empty((1, G), torch.float32, x.device)
    normed, z, live = _norm_route_split(x, norm, router, residual, tickets, None, x2, res, y, h, keep, keepf,
                                        NORM_ROUTE_TILE, False)
    return normed, Decision(keep.view(torch.bool).view(1, 1, G), keepf.view(1, 1, G), live, z,
                            router.up.weight.contiguous(), router.up.bias.contiguous())


def _norm_route_split(x, norm, router, residual, tickets, ranks_per_program, x2, res, y, h, keep, keepf, tile_tokens,
                      decide):
    # norm_route's one launch for a decode step: the router's ranks split over programs -> (normed, z, live)
    B, T, D = x.shape
    M = B * T
    down, up = router.down, router.up
    G, R = router.n_groups, down.out_features
    z = empty((M, R), torch.float32, x.device)  # the first Linear's outputs, handed to each tile's last program
    live = empty((1 + G,), torch.int32, x.device)
    assert tile_tokens >= 2 and tile_tokens & (tile_tokens - 1) == 0, "tile_tokens: a power of two >= 2"
    BT = max(2, triton.next_power_of_2(min(M, tile_tokens)))
    n_tiles = triton.cdiv(M, BT)
    tickets = torch.zeros(n_tiles, dtype=torch.int32, device=x.device) if tickets is None else tickets
    assert tickets.numel() >= n_tiles and tickets.dtype == torch.int32, "one int32 ticket per token tile"
    # One router rank per program on a GPU; the interpreter pays per program, so one program there,
    # unless a test asks for several (the ticket hand-over only happens between programs).
    RB = ranks_per_program or (triton.next_power_of_2(R) if INTERPRET else 1)
    RP, BG = triton.next_power_of_2(R), max(2, triton.next_power_of_2(G))
    P = triton.cdiv(R, RB)
    CW = triton.cdiv(D, P)  # the columns of h / RMSNorm(h) each program writes
    BK = min(triton.next_power_of_2(D), max(16, 8192 // BT))
    _norm_route_kernel[(P, n_tiles)](
        x2, res, h, y, norm.weight, norm.eps, down.weight, down.bias, z, up.weight, up.bias, keep, keepf, live, tickets,
        M, D, R, G, CW, HAS_RES=residual is not None, LIVE=n_tiles == 1, BT=BT, RB=RB,
        BK=BK, RP=RP, BG=BG, CWP=triton.next_power_of_2(CW), ONE_PASS=BK >= D, DECIDE=decide,
        num_warps=8, **pdl_args(x.device))  # wide chunks: the loop over D is latency-bound, so few long iterations
    normed = y.view(x.shape) if residual is None else (h.view(x.shape), y.view(x.shape))
    return normed, z, live if n_tiles == 1 else None


@triton.jit
def _residual_add(x, res, offs, ok, HAS_RES: tl.constexpr):
    # h = res + x, rounded to the model dtype as `x + a` is (or x alone)
    hv = tl.load(x + offs, mask=ok, other=0.0)
    if HAS_RES:
        hv = (tl.load(res + offs, mask=ok, other=0.0).to(tl.float32) + hv.to(tl.float32)).to(hv.dtype)
    return hv


@triton.jit
def _norm_route_kernel(x, res, h_out, y, nw, eps, wd, bd, z, wu, bu, keep, keepf, live, tickets, M, D, R, G,
                       CW, HAS_RES: tl.constexpr, LIVE: tl.constexpr, BT: tl.constexpr, RB: tl.constexpr,
                       BK: tl.constexpr, RP: tl.constexpr, BG: tl.constexpr, CWP: tl.constexpr, ONE_PASS: tl.constexpr,
                       DECIDE: tl.constexpr, PDL: tl.constexpr):
    """Residual add + RMSNorm + router for a tile of BT tokens. Grid (cdiv(R, RB), token tiles).

    Every program forms h = res + x for its tile's tokens (rounded to the model dtype as `x + a` is) and
    the router's first Linear for its RB ranks, z = h @ wd[r] + bd[r] in fp32, and writes h and RMSNorm(h)
    for its share of the columns. The last of a tile's programs to take the tile's ticket (the others' z
    are then visible) applies the second Linear and the rule of wide.Router, token by token: skip iff
    z_skip > z_exec, a tie executes; with one tile for the whole step (LIVE) it also writes the step's live
    list (the groups some token runs, ascending, after their count; then the others). It resets the
    ticket. Deterministic: each z is one program's fixed-order sum, and one program does the rest of a
    token. Under PDL the router's weights (nothing a kernel writes) are loaded before the wait, so their
    latency hides behind the previous kernel's last programs (ONE_PASS: the first Linear's rows fit one
    pass over D). DECIDE False (one token, norm_route_deferred): the kernel stops after z, h and RMSNorm(h); the
    decode GEMV that reads the mask applies the rule (kernels_gemv). Skips nothing. Twin: norm_route_ref."""
    pid, tile = tl.program_id(0), tl.program_id(1)
    r = pid * RB + tl.arange(0, RB)
    kk = tl.arange(0, BK)
    if ONE_PASS:
        w_first = tl.load(wd + r[:, None] * D + kk[None, :], mask=(r < R)[:, None] & (kk < D)[None, :], other=0.0)
    bias = tl.load(bd + r, mask=r < R, other=0.0)
    c = pid * CW + tl.arange(0, CWP)  # the columns of h and RMSNorm(h) this program writes
    cok = (c < D) & (c < pid * CW + CW)
    wt = tl.load(nw + c, mask=cok, other=0.0)
    # The second Linear's weights, loaded by every program: whichever program is last then has them at
    # hand instead of starting a dependent load.
    g = tl.arange(0, BG)
    rr = tl.arange(0, RP)
    if DECIDE:
        w_exec, w_skip, b_exec, b_skip = router_second_linear(wu, bu, g, G, rr, R)  # [BG, RP], [BG]
    prior_done(PDL)
    t = tile * BT + tl.arange(0, BT)
    tok = t < M
    # This program's slice of h, loaded and stored before the pass over D: its round trip overlaps the
    # pass's loads instead of following the reductions.
    ok_c, offs_c = tok[:, None] & cok[None, :], t[:, None].to(tl.int64) * D + c[None, :]
    hv_c = _residual_add(x, res, offs_c, ok_c, HAS_RES)
    if HAS_RES:
        tl.store(h_out + offs_c, hv_c, mask=ok_c)
    acc = tl.zeros([BT, RB, BK], tl.float32)
    ss = tl.zeros([BT], tl.float32)
    for k0 in range(0, D, BK):
        ok, offs = tok[:, None] & (k0 + kk < D)[None, :], t[:, None].to(tl.int64) * D + k0 + kk[None, :]
        hv = _residual_add(x, res, offs, ok, HAS_RES)
        hf = hv.to(tl.float32)
        ss += tl.sum(hf * hf, 1)
        if ONE_PASS:
            w = w_first
        else:
            w = tl.load(wd + r[:, None] * D + k0 + kk[None, :], mask=(r < R)[:, None] & (k0 + kk < D)[None, :],
                        other=0.0)
        acc += hf[:, None, :] * w[None, :, :]
    zt = tl.sum(acc, 2) + bias[None, :]
    tl.store(z + t[:, None] * R + r[None, :], zt, mask=tok[:, None] & (r < R)[None, :])
    # RMSNorm(h) for this program's slice of CW columns (every program has its tokens' sums of squares),
    # so the write-out is spread over the grid instead of one program's serial loop.
    n = (hv_c.to(tl.float32) * tl.rsqrt(ss / D + eps)[:, None]).to(hv_c.dtype)
    tl.store(y + offs_c, (wt.to(tl.float32)[None, :] * n.to(tl.float32)).to(y.dtype.element_ty), mask=ok_c)
    if DECIDE:  # (not: the decode GEMV after this launch decides, kernels_step.norm_route_deferred)
        tl.debug_barrier()  # every thread's z is stored before the ticket is taken (release)
        if tl.atomic_add(tickets + tile, 1) == tl.num_programs(0) - 1:  # the tile's last program: its z is complete
            tl.atomic_xchg(tickets + tile, 0)
            any_run = tl.zeros([BG], tl.int32)
            for m in range(tile * BT, tl.minimum(tile * BT + BT, M)):
                zr = tl.load(z + m * R + rr, mask=rr < R, other=0.0, cache_modifier=".cg")[None, :]
                run = router_rule(zr, w_exec, w_skip, b_exec, b_skip)
                tl.store(keep + m * G + g, run.to(tl.uint8), mask=g < G)
                tl.store(keepf + m * G + g, run.to(tl.float32), mask=g < G)
                any_run = any_run | run.to(tl.int32)
            if LIVE:
                store_live(live, any_run, g, G)  # once per router decision: gemm_k's decode tile visits only its groups


@triton.jit(do_not_specialize=["M"])  # chunk lengths: see Policy.warm_chunks
def _norm_route_part_kernel(x, res, h_out, wd, part_ss, part_z, M, D, R, HAS_RES: tl.constexpr, BT: tl.constexpr,
                            BK: tl.constexpr, DS: tl.constexpr, RP: tl.constexpr, PREC: tl.constexpr,
                            PDL: tl.constexpr):
    """A prefill chunk's norm + router, first half: one D-slice of one tile of tokens. Grid (cdiv(M, BT),
    cdiv(D, DS)).

    Program (tile, s) forms h = res + x on its BT tokens and DS columns (rounded to the model dtype, as `x + a`
    is) and writes it, then the slice's share of what needs all of D: each token's sum of squares, part_ss[s],
    and of the router's first Linear, part_z[s] = h[:, slice] @ wd[:, slice].T (fp32-accurate dots, config PREC:
    the reference router runs in fp32). Splitting D is what spreads a short chunk over the GPU: the row tiles
    alone are few programs, each a long serial loop over D. No bias, no rule: _norm_route_finish_kernel adds
    the slices up. Skips nothing. Twin: norm_route_ref."""
    tile, s = tl.program_id(0), tl.program_id(1)
    t = tile * BT + tl.arange(0, BT)
    tok = t < M
    kk = tl.arange(0, BK)
    rr = tl.arange(0, RP)
    if BK == DS:  # one step per slice: its router weights (no kernel writes them) load before the wait, so
        # under PDL their latency hides behind the previous kernel's last programs
        w_slice = tl.load(wd + rr[:, None] * D + s * DS + kk[None, :],
                          mask=(rr < R)[:, None] & (s * DS + kk < D)[None, :], other=0.0)
    prior_done(PDL)
    z = tl.zeros([BT, RP], tl.float32)
    ss = tl.zeros([BT], tl.float32)
    for k0 in range(s * DS, s * DS + DS, BK):
        ok, offs = tok[:, None] & (k0 + kk < D)[None, :], t[:, None].to(tl.int64) * D + k0 + kk[None, :]
        hv = _residual_add(x, res, offs, ok, HAS_RES)
        if HAS_RES:
            tl.store(h_out + offs, hv, mask=ok)
        hf = hv.to(tl.float32)
        ss += tl.sum(hf * hf, 1)
        if BK == DS:
            w = w_slice
        else:
            w = tl.load(wd + rr[:, None] * D + k0 + kk[None, :], mask=(rr < R)[:, None] & (k0 + kk < D)[None, :],
                        other=0.0)
        z = tl.dot(hf, tl.trans(w), z, input_precision=PREC)
    tl.store(part_ss + s * M + t, ss, mask=tok)
    tl.store(part_z + (s * M + t)[:, None] * RP + rr[None, :], z, mask=tok[:, None])


@triton.jit(do_not_specialize=["M"])  # chunk lengths: see Policy.warm_chunks
def _norm_route_finish_kernel(h, y, nw, eps, bd, wu, bu, part_ss, part_z, keep, keepf, M, D, R, G, S,
                              BT: tl.constexpr, BK: tl.constexpr, DS: tl.constexpr, RP: tl.constexpr,
                              BG: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    """A prefill chunk's norm + router, second half. Grid (cdiv(M, BT), S + 1) for the first half's S slices.

    Program (tile, s < S) adds its tokens' S partial sums of squares up in slice order and writes RMSNorm(h)
    for D-slice s (h as the first half wrote it, or x without a residual; rounded as the norm kernel does).
    Program (tile, S) adds the partial first Linear up in slice order, adds its bias, and applies the second
    Linear and wide.Router's rule (skip iff z_skip > z_exec; a tie executes) to the tile: a program of its
    own, so the rule's dependent loads and dots run beside the slices' write-out, not after one of them.
    Deterministic: fixed-order sums, no atomics, every output written by one program. Skips nothing.
    Twin: norm_route_ref."""
    tile, s = tl.program_id(0), tl.program_id(1)
    t = tile * BT + tl.arange(0, BT)
    tok = t < M
    prior_done(PDL)
    if s < S:
        ss = tl.zeros([BT], tl.float32)
        for i in range(0, S):
            ss += tl.load(part_ss + i * M + t, mask=tok, other=0.0)
        inv = tl.rsqrt(ss / D + eps)
        kk = tl.arange(0, BK)
        for k0 in range(s * DS, s * DS + DS, BK):
            ok, offs = tok[:, None] & (k0 + kk < D)[None, :], t[:, None].to(tl.int64) * D + k0 + kk[None, :]
            hv = tl.load(h + offs, mask=ok, other=0.0)
            n = (hv.to(tl.float32) * inv[:, None]).to(hv.dtype)
            wt = tl.load(nw + k0 + kk, mask=k0 + kk < D, other=0.0)
            tl.store(y + offs, (wt.to(tl.float32)[None, :] * n.to(tl.float32)).to(y.dtype.element_ty), mask=ok)
    else:  # the router's decision for the tile
        rr = tl.arange(0, RP)
        g = tl.arange(0, BG)
        z = tl.zeros([BT, RP], tl.float32)
        for i in range(0, S):
            z += tl.load(part_z + (i * M + t)[:, None] * RP + rr[None, :], mask=tok[:, None], other=0.0)
        z += tl.load(bd + rr, mask=rr < R, other=0.0)[None, :]
        wm = (g < G)[:, None] & (rr < R)[None, :]
        w_exec = tl.load(wu + (2 * g)[:, None] * R + rr[None, :], mask=wm, other=0.0)  # [BG, RP]
        w_skip = tl.load(wu + (2 * g + 1)[:, None] * R + rr[None, :], mask=wm, other=0.0)
        z_exec = tl.dot(z, tl.trans(w_exec), input_precision=PREC) + tl.load(bu + 2 * g, mask=g < G,
                                                                             other=0.0)[None, :]
        z_skip = tl.dot(z, tl.trans(w_skip), input_precision=PREC) + tl.load(bu + 2 * g + 1, mask=g < G,
                                                                             other=0.0)[None, :]
        run = z_skip <= z_exec  # a tie executes
        km = tok[:, None] & (g < G)[None, :]
        tl.store(keep + t[:, None] * G + g[None, :], run.to(tl.uint8), mask=km)
        tl.store(keepf + t[:, None] * G + g[None, :], run.to(tl.float32), mask=km)
