"""
The small fused kernels of an inference step (engine.py), each after its PyTorch twin:

  rms_norm        RMSNorm (with the residual add) where there is no router (kernels_route.py: with one); its output as fp8 rows if asked
  rope_and_store  RoPE on q and k, and k, v written into the static KV cache at each token's slot
  swiglu_rows     silu(gate) * up of a library GEMM's output, the pruned channel groups' zeros in the same launch
  quantize_rows   a linear's input as fp8 rows (per-token e4m3 codes and scale) for kernels.scaled_mm; the
                  SwiGLU product and the pruned channel groups' zeros in the same launch

They skip nothing; they exist so that a decode step is a short list of launches that a CUDA graph
replays. Same contract as kernels.py: Triton on a GPU or under TRITON_INTERPRET=1, or a clear error.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import FP8, Fp8Rows, quantize_fp8
from kernels_base import check_device, empty, pdl_args, prior_done
from model import apply_rope


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


@triton.jit(do_not_specialize=["T"])  # chunk lengths: see engine.warm_chunks
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
