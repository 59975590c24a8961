"""
WIDE kernels: compute only the (token, group) blocks that the routers run.

Every op has two implementations driven by the same bool mask (True = the group is live for the token):
a PyTorch reference twin (`*_ref`: compute dense, zero the pruned slots; the meaning of the op and the
tests' ground truth) and Triton kernels that skip the pruned work: block skip (a tile with no live token
exits before any load, once the layout has made each group's live tokens contiguous) and intra-block skip
(rows that skip, inside a live tile, are predicated off). The ops launch their kernels (a CUDA tensor, or
TRITON_INTERPRET=1 on the CPU) or fail; nothing falls back to a twin. Pruned outputs are exactly 0.

  gemm_mn(x[M,K], w[N,K], mask, group_size)  -> [M,N]  Q proj; gate+up fused with silu(gate)*up
  gemm_k(a[M,K], w[N,K], mask, group_size)   -> [M,N]  O proj, down proj: (a * mask) @ w.T
  (the layout: kernels_layout.py; attention over the live head groups: kernels_attention.py)
fp8 weights (e4m3, one fp32 scale per output channel, `quantize_fp8`; or GPTQ's codes, `gptq_fp8`, and for a
model `calibrate_fp8`): the kernels read the live groups' codes, sum in fp32 and apply the channel's scale in
the epilogue; the twins dequantize first. A linear that skips nothing can instead run on fp8 tensor cores
(`scaled_mm`: torch._scaled_mm) with its input quantized per token (`Fp8Rows`, made by
kernels_step.quantize_rows): weights and activations in e4m3.
"""
import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import cli
from kernels_base import LONG_K, check_device, codes_f32, config_for, empty, launch_args, pdl_args, pow2_divisor, prior_done
from kernels_gemv import gemv_mn
from kernels_layout import as_layout, flat_mask
from policy import GEMV_MAX_TOKENS


# ---------------------------------------------------------------------------------------------
# fp8 weights: per-output-channel absmax scaling, done once at load time
# ---------------------------------------------------------------------------------------------
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value


def quantize_fp8(w):
    """w [N, K] -> (wq [N, K] float8_e4m3fn, scale [N] fp32) with w ~ wq * scale[:, None]: each output
    channel's largest |w| maps to 448. An all-zero row gets scale 1 (its codes are 0 anyway)."""
    absmax = w.detach().float().abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    return (w.detach().float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.contiguous()


def dequantize_fp8(wq, scale, dtype=torch.float32):
    """The values an fp8 weight stands for, in `dtype`: wq * scale[:, None], rounded once."""
    return (wq.float() * scale[:, None]).to(dtype)


@torch.no_grad()
def gptq_fp8(w, hessian, damp=0.01, block=128):
    """quantize_fp8 with GPTQ's rounding (Frantar et al., 2022): (codes [N, K], scale [N]), the same scales,
    but the columns rounded one at a time, each rounding's error moved onto the columns not yet rounded as
    the inputs correlate (hessian: E[x x^T] over inputs like the ones served, [K, K]), so that x @ w.T moves
    least rather than each weight. A row's largest weight keeps the code +-448, so quantize_fp8 of the
    dequantized weights gives back these codes: every fp8 path reads them as it reads any weight's."""
    N, K = w.shape
    _, scale = quantize_fp8(w)
    w64, s64 = w.detach().double().clone(), scale.double()
    top = w64.abs().argmax(dim=1)
    top_code = torch.sign(w64.gather(1, top[:, None]))[:, 0] * FP8_MAX
    # fp64: a pretrained model's activations span many decades (a few channels are 1000x the rest), and the
    # factorization of their hessian fails in fp32.
    h = hessian.detach().double().clone()
    if not torch.isfinite(h).all():  # inf/NaN activations on a calibration batch: no rounding can follow them
        raise cli.UserError("gptq_fp8: the hessian has inf or NaN entries (the calibration activations overflowed); "
                            "use --weights fp8 (codes rounded to nearest), or calibrate a float32 copy of the model")
    idle = h.diagonal() == 0  # an input always 0 (even every input, behind groups skipped on every calibration token)
    h[idle, idle] = 1.0
    h += damp * h.diagonal().mean() * torch.eye(K, dtype=h.dtype, device=h.device)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.empty(N, K, dtype=FP8, device=w.device)
    for c0 in range(0, K, block):  # errors move within a block one column at a time, onto later blocks at once
        c1 = min(K, c0 + block)
        wb, err = w64[:, c0:c1], torch.empty(N, c1 - c0, dtype=w64.dtype, device=w64.device)
        for j in range(c1 - c0):
            c = (wb[:, j] / s64).clamp(-FP8_MAX, FP8_MAX).float().to(FP8)
            c = torch.where(top == c0 + j, top_code.to(FP8), c)
            codes[:, c0 + j] = c
            err[:, j] = (wb[:, j] - c.double() * s64) / u[c0 + j, c0 + j]
            wb[:, j:] -= err[:, j:j + 1] * u[c0 + j, c0 + j:c1]
        w64[:, c1:] -= err @ u[c0:c1, c1:]
    return codes, scale


class _Reached(Exception):
    """Stops a calibration forward once the layer being calibrated has seen its inputs."""


@torch.no_grad()
def calibrate_fp8(model, batches):
    """GPTQ for the fp8 codes, in place: layer by layer, each prunable linear's weights rounded by gptq_fp8
    so that its outputs on these token batches ([B, T] each) move least, with the layers before it already
    rounded. quantize_fp8 then reads GPTQ's codes wherever fp8 runs (engine.Engine, engine.fp8_model)."""
    for layer in model.layers:
        a, f = layer.self_attn, layer.mlp
        sites = {a.q_proj: (a.q_proj, a.k_proj, a.v_proj), a.o_proj: (a.o_proj,),
                 f.gate_proj: (f.gate_proj, f.up_proj), f.down_proj: (f.down_proj,)}
        sums = {}

        def take(lin, args):  # x^T x of the linear's inputs, summed in fp64
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            h, n = sums.get(lin, (0.0, 0))
            sums[lin] = (h + x.T @ x, n + len(x))

        def reached(*_):
            raise _Reached

        hooks = [lin.register_forward_pre_hook(take) for lin in sites] + [layer.register_forward_hook(reached)]
        try:
            for idx in batches:
                with contextlib.suppress(_Reached):
                    model(idx)
        finally:
            for hook in hooks:
                hook.remove()
        for site, lins in sites.items():
            h, n = sums[site]
            for lin in lins:
                lin.weight.copy_(dequantize_fp8(*gptq_fp8(lin.weight, h / n), lin.weight.dtype))
    return model


class Fp8Rows(NamedTuple):
    """Activations as fp8: each row's e4m3 codes and its scale (quantize_fp8's rule, per token), as
    torch._scaled_mm reads them. Made in the step by kernels_step.quantize_rows (or rms_norm(fp8=True))."""
    codes: torch.Tensor  # [M, K] float8_e4m3fn
    scale: torch.Tensor  # [M] fp32


def scaled_mm_ref(a, w, w_scale, dtype):
    """Twin of scaled_mm: the codes' products summed in fp32, times the row's scale and the output
    channel's weight scale, rounded once to dtype."""
    return ((a.codes.float() @ w.float().t()) * a.scale[:, None] * w_scale[None, :]).to(dtype)


def scaled_mm(a, w, w_scale, dtype, tensorwise=False):
    """a (Fp8Rows [M, K]) @ w.T for fp8 weight codes w [N, K] with per-channel scales w_scale [N]: fp8 tensor
    cores through torch._scaled_mm, one scale per row on each side, the result in dtype. Per-row scales on a
    GPU need a bf16 result: another dtype gets that one, converted. tensorwise (one row): the library's
    per-tensor path instead, with the row's scale and an fp32 result, then the channels' scales and one rounding
    here: the twin's arithmetic, through the path a GPU library may run faster for a single token."""
    if tensorwise:
        assert a.codes.shape[0] == 1, "tensorwise: one row (its scale is then the tensor's)"
        y = torch._scaled_mm(a.codes, w.t(), scale_a=a.scale.reshape(()), scale_b=w_scale.new_ones(()),
                             out_dtype=torch.float32)
        return (y * w_scale[None, :]).to(dtype)
    out = torch.bfloat16 if a.codes.is_cuda else dtype
    y = torch._scaled_mm(a.codes, w.t(), scale_a=a.scale[:, None], scale_b=w_scale[None, :], out_dtype=out)
    return y if y.dtype == dtype else y.to(dtype)


def _dequantized(x, w, w_scale):
    # The twins compute with the dequantized weight in x's dtype.
    return w if w_scale is None else dequantize_fp8(w, w_scale, x.dtype)


# ---------------------------------------------------------------------------------------------
# gemm_mn: output-channel groups pruned (Q projection; gate+up with a silu(gate)*up epilogue)
# ---------------------------------------------------------------------------------------------
def gemm_mn_ref(x, w, mask, group_size, w_up=None, dense_tail=0, w_scale=None, w_up_scale=None):
    """Dense x @ w.T (or silu(x @ w.T) * (x @ w_up.T)), then the pruned groups' outputs set to 0.
    The last dense_tail output channels belong to no group: they are always computed.
    fp8 weights (w_scale, w_up_scale given): dequantized first."""
    w = _dequantized(x, w, w_scale)
    w_up = w_up if w_up is None else _dequantized(x, w_up, w_up_scale)
    m = flat_mask(mask)
    if dense_tail:
        m = torch.cat([m, m.new_ones(m.shape[0], dense_tail // group_size)], dim=1)
    y = x @ w.t()
    if w_up is not None:
        y = F.silu(y) * (x @ w_up.t())
    keep = m.repeat_interleave(group_size, dim=1)
    return torch.where(keep, y, torch.zeros((), dtype=y.dtype, device=y.device))


@triton.jit
def _x_slice(xp, k0, kk, K, ok, EVEN_K: tl.constexpr):
    # the token tile's [BM, BK] slice at k0: rows past the group's count (and K past its end) read as zeros
    if EVEN_K:
        a = tl.load(xp + k0, mask=ok[:, None], other=0.0)
    else:
        a = tl.load(xp + k0, mask=ok[:, None] & (k0 + kk < K)[None, :], other=0.0)
    return a


@triton.jit
def _w_slice(wp, k0, kk, K, EVEN_K: tl.constexpr):
    # a weight tile's slice at k0 (K past its end reads as zeros)
    if EVEN_K:
        b = tl.load(wp + k0)
    else:
        b = tl.load(wp + k0, mask=(k0 + kk < K)[None, :], other=0.0)
    return b


@triton.jit(do_not_specialize=["M", "NT"])  # token counts: see Policy.warm_chunks
def _gemm_mn_kernel(x, w, w_up, out, counts, perm, work, M, N, K, NT, sxm, swn, som,
                    GS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    FUSED: tl.constexpr, ZERO: tl.constexpr, EVEN_K: tl.constexpr,
                    IEEE: tl.constexpr, PAIRED: tl.constexpr):
    """out[t, n] = x[t] . w[n] (or silu(x.w[n]) * x.w_up[n]) for the tokens t that run n's group.

    Grid (len(work), GS // BN). Program = one work item (group g, tile of BM tokens in g's sorted
    order) x one BN slice of g's output channels. Tiles past count[g] hold no live token: they
    exit before loading x or w (block skip) and only write zeros (ZERO). In the boundary tile the
    rows past count[g] are predicated off in the x loads (intra-block skip) and stored as zeros.
    PAIRED (gate+up): one [2 BN, BK] weight tile per K step, its rows gate's and up's channels in turns, so one
    tensor-core product 2 BN wide reads the token tile once (two BN-wide ones read it twice); its column pairs
    split into gate and up in the epilogue. Twin: gemm_mn_ref.
    """
    item = tl.load(work + tl.program_id(0))
    g, tile = item // NT, item % NT
    count = tl.load(counts + g)
    p = tile * BM + tl.arange(0, BM)
    rows = tl.load(perm + g * M + p, mask=p < M, other=0).to(tl.int64)
    cols = g * GS + tl.program_id(1) * BN + tl.arange(0, BN)
    optr = out + rows[:, None] * som + cols[None, :]
    # WIDE skip: a dead tile (no token here runs group g) returns before any load of x or w
    if tile * BM >= count:
        if ZERO:
            tl.store(optr, tl.zeros([BM, BN], out.dtype.element_ty), mask=(p < M)[:, None])
        return
    ok = p < count
    kk = tl.arange(0, BK)
    xp = x + rows[:, None] * sxm + kk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    if PAIRED:  # tile row 2j: gate's channel cols[j]; 2j + 1: up's
        j = tl.arange(0, 2 * BN)
        wrow = (g * GS + tl.program_id(1) * BN + j // 2).to(tl.int64)[:, None] * swn + kk[None, :]
        wp = tl.where((j % 2 == 0)[:, None], w + wrow, w_up + wrow)
        acc2 = tl.zeros([BM, 2 * BN], tl.float32)
        for k0 in range(0, K, BK):
            a, b = _x_slice(xp, k0, kk, K, ok, EVEN_K), _w_slice(wp, k0, kk, K, EVEN_K)
            acc2 = tl.dot(a, tl.trans(b), acc2, input_precision="ieee" if IEEE else "tf32")
        acc, acc_up = tl.split(tl.reshape(acc2, [BM, BN, 2]))
    else:
        wp = w + cols[:, None].to(tl.int64) * swn + kk[None, :]
        up = w_up + cols[:, None].to(tl.int64) * swn + kk[None, :]
        for k0 in range(0, K, BK):
            a, b = _x_slice(xp, k0, kk, K, ok, EVEN_K), _w_slice(wp, k0, kk, K, EVEN_K)
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee" if IEEE else "tf32")
            if FUSED:
                acc_up = tl.dot(a, tl.trans(_w_slice(up, k0, kk, K, EVEN_K)), acc_up,
                                input_precision="ieee" if IEEE else "tf32")
    if FUSED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up, in fp32
    acc = tl.where(ok[:, None], acc, 0.0)
    tl.store(optr, acc.to(out.dtype.element_ty), mask=(p < M if ZERO else ok)[:, None])


# The Triton kernel gemm_mn's prefill tiles launch, by a public name (research.sass builds it on its own).
GEMM_MN_KERNEL = _gemm_mn_kernel


def gemm_mn(x, w, mask_or_layout, group_size, w_up=None, zero_pruned=True, config=None, dense_tail=0,
            w_scale=None, w_up_scale=None, rope=None, decision=None):
    """Masked linear with output-channel groups: x[M,K], w[N,K], mask [M, N/group_size] -> [M,N].

    With w_up it is the fused SwiGLU input silu(x @ w.T) * (x @ w_up.T) (w = gate).
    zero_pruned=False skips writing the pruned slots (the kernel then only writes live tiles);
    only gemm_k with the same mask may consume such an output, since it never reads those slots.
    config overrides the tuned block sizes (CONFIGS) of the kernel this call launches.
    dense_tail: the last rows of w are always computed (decode only: Q with K and V after it in one
    weight stream, mask [M, (N - dense_tail) / group_size]). With dense_tail = N and a mask [M, 0] every
    row is computed: the dense model through the same kernel.
    w_scale [N] (and w_up_scale for w_up): w (and w_up) are float8_e4m3fn with these per-row scales.
    The decode GEMV reads the fp8 bytes; more tokens dequantize to x's dtype and run the sorted tiles.
    rope (kernels_gemv.Rope, decode GEMV only): w is [Q; K; V]; RoPE and the KV-cache write happen in the
    kernel's epilogue and the result is Q alone, rotated.
    decision (kernels_step.Decision, one token): the mask is decision.keep, still to be made from the router's
    first Linear; the decode GEMV makes it and writes keep, keepf and the live list (kernels_step.norm_route_deferred).
    """
    check_device(x)
    M, K = x.shape
    N = w.shape[0]
    G, GE = (N - dense_tail) // group_size, dense_tail // group_size
    assert (G + GE) * group_size == N and group_size % 16 == 0, "group_size must divide N and be a multiple of 16"
    assert not dense_tail or M <= GEMV_MAX_TOKENS, "dense_tail is for the decode GEMV"
    fused = w_up is not None
    fp8 = w_scale is not None
    assert not fused or fp8 == (w_up_scale is not None), "fp8 gate and up need a scale each"
    if fp8 and M > GEMV_MAX_TOKENS:  # only the decode GEMV reads fp8; the tiles get the values it stands for
        w = dequantize_fp8(w, w_scale, x.dtype)
        w_up = dequantize_fp8(w_up, w_up_scale, x.dtype) if fused else None
        fp8 = False
    x, w = x.contiguous(), w.contiguous()
    w_up = w_up.contiguous() if fused else w
    ws = w_scale.contiguous() if fp8 else x  # (a placeholder pointer when there are no scales)
    wus = w_up_scale.contiguous() if fp8 and fused else ws
    out = empty((M, N), x.dtype, x.device)
    ieee = x.dtype == torch.float32
    if M <= GEMV_MAX_TOKENS:  # decode: the GEMV of kernels_gemv.py, straight from the mask or the live list
        return gemv_mn(x, w, w_up, ws, wus, out, flat_mask(mask_or_layout).view(torch.uint8), group_size, G, GE,
                       config=config, rope=rope, decision=decision)
    assert decision is None, "decision: the decode GEMV only"
    assert rope is None, "rope: the decode GEMV only"
    lay = as_layout(mask_or_layout)
    cfg = config_for("gemm_mn_fused" if fused else "gemm_mn", config)
    BN = pow2_divisor(group_size, cfg["BN"])
    NT = triton.cdiv(M, lay.block_m)
    grid = (G * NT, group_size // BN)
    _gemm_mn_kernel[grid](x, w, w_up, out, lay.counts, lay.perm, lay.work, M, N, K, NT,
                          x.stride(0), w.stride(0), out.stride(0), GS=group_size, BM=lay.block_m,
                          BN=BN, BK=cfg["BK"], FUSED=fused, ZERO=zero_pruned,
                          EVEN_K=K % cfg["BK"] == 0, IEEE=ieee, PAIRED=fused and bool(cfg.get("PAIRED")),
                          **launch_args(cfg))
    return out


# ---------------------------------------------------------------------------------------------
# gemm_k: reduction groups pruned (O projection, down projection)
# ---------------------------------------------------------------------------------------------
def gemm_k_ref(a, w, mask, group_size, residual=None, w_scale=None):
    """(a with the pruned groups' columns set to 0) @ w.T (+ residual). Pruned inputs are never read.
    fp8 weights (w_scale given): dequantized first."""
    w = _dequantized(a, w, w_scale)
    keep = flat_mask(mask).repeat_interleave(group_size, dim=1)
    y = torch.where(keep, a, torch.zeros((), dtype=a.dtype, device=a.device)) @ w.t()
    return y if residual is None else residual + y


@triton.jit
def _gemm_k_block(acc, a, w, mask, rows, rok, cols, cok, g, step, G, sam, swn,
                 GS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, F16: tl.constexpr):
    # One BK slice of group g: a-rows of tokens that do not run g are predicated off
    # (intra-block skip; those slots are never read, so garbage there is harmless).
    # BM == 1 (one token, config FMA): fp32 multiply-adds instead of a 16-row tensor-core tile, which
    # would convert every weight (fp8 codes too) for 15 rows of padding; acc is then [BN, BK] lane sums,
    # reduced once after the loop rather than every step.
    k0 = g * GS + step * BK
    kk = tl.arange(0, BK)
    on = tl.load(mask + rows * G + g, mask=rok, other=0) > 0
    at = tl.load(a + rows[:, None].to(tl.int64) * sam + k0 + kk[None, :], mask=on[:, None], other=0.0)
    wt = tl.load(w + cols[:, None].to(tl.int64) * swn + k0 + kk[None, :], mask=cok[:, None], other=0.0)
    return _gemm_k_math(acc, at, wt, BM, IEEE, F16)


@triton.jit
def _gemm_k_first(acc, a, wt, mask, rows, rok, g, step, G, sam, GS: tl.constexpr, BM: tl.constexpr,
                  BK: tl.constexpr, IEEE: tl.constexpr, F16: tl.constexpr):
    # _gemm_k_block with its weight slice already loaded (PREFETCH: before the PDL wait)
    k0 = g * GS + step * BK
    kk = tl.arange(0, BK)
    on = tl.load(mask + rows * G + g, mask=rok, other=0) > 0
    at = tl.load(a + rows[:, None].to(tl.int64) * sam + k0 + kk[None, :], mask=on[:, None], other=0.0)
    return _gemm_k_math(acc, at, wt, BM, IEEE, F16)


@triton.jit
def _gemm_k_math(acc, at, wt, BM: tl.constexpr, IEEE: tl.constexpr, F16: tl.constexpr):
    if BM == 1:
        acc += codes_f32(wt, F16 > 0) * at.to(tl.float32)
    elif F16 == 2:  # fp8 codes and activations as f16 (exact for bf16 values within f16's range, |a| < 65504)
        acc = tl.dot(at.to(tl.float16), tl.trans(wt.to(tl.float16)), acc)
    elif F16 == 1:  # fp8 codes -> f16 (exact, and one conversion per two codes) -> the activations' dtype (exact)
        acc = tl.dot(at, tl.trans(wt.to(tl.float16).to(at.dtype)), acc, input_precision="ieee" if IEEE else "tf32")
    else:
        acc = tl.dot(at, tl.trans(wt.to(at.dtype)), acc, input_precision="ieee" if IEEE else "tf32")
    return acc


@triton.jit
def _gemm_k_kernel(a, w, ws, out, res, part, tickets, mask, live, live_list, M, N, K, G, sam, swn, som,
                   GS: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, GROUP_M: tl.constexpr, SPLIT: tl.constexpr, HAS_RES: tl.constexpr,
                   FP8: tl.constexpr, IEEE: tl.constexpr, F16: tl.constexpr, HAS_LIVE: tl.constexpr,
                   PREFETCH: tl.constexpr, PIPE: tl.constexpr, PDL: tl.constexpr):
    """out[t, n] = sum over the groups g that token t runs of a[t, g-slice] . w[n, g-slice].

    Grid (cdiv(M,BM) * cdiv(N,BN),), L2-grouped. Tokens stay in their original order, so the
    accumulator holds whole output rows and partial sums never leave registers: no atomics, and
    the result is deterministic (fixed summation order). The K loop visits only the groups that
    some token of the tile runs (block skip: other groups' weights are never read); inside, the
    a-rows of skipped tokens are predicated off (intra-block skip: pruned slots are never read,
    so garbage there is harmless). With M <= 16 this is the decode GEMV; there a tile has too few
    rows to keep the memory system busy, so SPLIT > 1 programs (grid axis 1) share a tile's live
    groups, each writing an fp32 partial [SPLIT, M, N]; the last of them to take the tile's ticket
    sums the partials in a fixed order (still deterministic) and writes the result. HAS_RES: the
    epilogue adds a residual, rounded as `res + (a @ w.T)` is. FP8: w holds e4m3 codes (the skipped
    groups' bytes are still never read); the fp32 sum is multiplied by output channel n's scale ws[n]
    before the residual add. HAS_LIVE (decode, one token tile): the groups come from the router's live list
    (norm_route) instead of the tile's own scan of the mask. PREFETCH (with HAS_LIVE): before the PDL wait the
    program reads the live list and loads its first weight slice, so its weight stream starts while the
    kernel before it drains. That list must be no output of the kernel just before this one (norm_route, or the
    Q, K, V GEMV that applied the rule, two or more launches earlier; not down's list that gate+up wrote: the
    host leaves PREFETCH off there), and a kernel that starts early always finds the one before its predecessor
    finished (kernels_base.prior_done). PIPE > 0: the K loop keeps PIPE
    slices in flight through shared memory (for the one-row FMA tile, which has no tl.dot for the compiler to
    pipeline by itself). PDL: see kernels_base.prior_done (config EARLY_NEXT: the next kernel, e.g. the norm
    whose router weights it loads before its own wait, may launch once these programs have passed theirs).
    Twin: gemm_k_ref.
    """
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    first = pid // (GROUP_M * n_n) * GROUP_M
    size = tl.minimum(n_m - first, GROUP_M)
    pid_m = first + (pid % (GROUP_M * n_n)) % size
    pid_n = (pid % (GROUP_M * n_n)) // size
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rok, cok = rows < M, cols < N
    STEPS: tl.constexpr = GS // BK
    split = tl.program_id(1)
    if PREFETCH:  # this program's first (group, slice) of the live list, and its weight columns
        per0 = tl.cdiv(tl.load(live), SPLIT)
        lo0, hi0 = split * per0 * STEPS, tl.minimum(split * per0 + per0, tl.load(live)) * STEPS
        g0 = tl.load(live + 1 + tl.minimum(lo0 // STEPS, G - 1))  # (a listed group even where lo0 >= hi0)
        kk0 = tl.arange(0, BK)
        w0 = tl.load(w + cols[:, None].to(tl.int64) * swn + g0 * GS + (lo0 % STEPS) * BK + kk0[None, :],
                     mask=cok[:, None] & (lo0 + kk0 * 0 < hi0)[None, :], other=0.0)
    prior_done(PDL)
    if HAS_LIVE:  # the router's live list (the tile holds every token of the step): its groups, at once
        n_live = tl.load(live)
        lst = live + 1
    else:
        gg = tl.arange(0, GP)
        bits = tl.load(mask + rows[:, None] * G + gg[None, :], mask=rok[:, None] & (gg < G)[None, :],
                       other=0).to(tl.int32)
        on = (tl.max(bits, 0) > 0).to(tl.int32)  # the groups some token of this tile runs
        n_live = tl.sum(on, 0)
        lst = live_list + (pid * SPLIT + split) * GP
        if n_live < G:  # compact the live groups once into this program's scratch row
            tl.store(lst + tl.cumsum(on, 0) - 1, gg, mask=on > 0)
            tl.debug_barrier()
    if BM == 1:  # lane sums (_gemm_k_math)
        acc = tl.zeros([BN, BK], tl.float32)
    else:
        acc = tl.zeros([BM, BN], tl.float32)
    if n_live == G:  # every group is live (the usual case at random masks): plain K loop
        per = tl.cdiv(G, SPLIT)
        lo, hi = split * per * STEPS, tl.minimum(split * per + per, G) * STEPS
        if PREFETCH:  # the first slice is at hand (all live: the list is 0, 1, ..., so g0 == lo // STEPS)
            if lo < hi:
                acc = _gemm_k_first(acc, a, w0, mask, rows, rok, g0, lo % STEPS, G, sam, GS, BM, BK, IEEE, F16)
            lo += 1
        if PIPE > 0:  # (a loop without a tl.dot is pipelined only when asked)
            for it in tl.range(lo, hi, num_stages=PIPE):
                acc = _gemm_k_block(acc, a, w, mask, rows, rok, cols, cok, it // STEPS, it % STEPS, G,
                                   sam, swn, GS, BM, BK, IEEE, F16)
        else:
            for it in range(lo, hi):
                acc = _gemm_k_block(acc, a, w, mask, rows, rok, cols, cok, it // STEPS, it % STEPS, G,
                                   sam, swn, GS, BM, BK, IEEE, F16)
    else:
        # WIDE skip: only the listed groups (some token of the tile runs them) are visited; a dead group's
        # weight columns are never read
        per = tl.cdiv(n_live, SPLIT)
        lo, hi = split * per * STEPS, tl.minimum(split * per + per, n_live) * STEPS
        if PREFETCH:
            if lo < hi:
                acc = _gemm_k_first(acc, a, w0, mask, rows, rok, g0, lo % STEPS, G, sam, GS, BM, BK, IEEE, F16)
            lo += 1
        if PIPE > 0:
            for it in tl.range(lo, hi, num_stages=PIPE):
                acc = _gemm_k_block(acc, a, w, mask, rows, rok, cols, cok, tl.load(lst + it // STEPS),
                                   it % STEPS, G, sam, swn, GS, BM, BK, IEEE, F16)
        else:
            for it in range(lo, hi):
                acc = _gemm_k_block(acc, a, w, mask, rows, rok, cols, cok, tl.load(lst + it // STEPS),
                                   it % STEPS, G, sam, swn, GS, BM, BK, IEEE, F16)
    if BM == 1:
        acc = tl.sum(acc, 1)[None, :]
    ok = rok[:, None] & cok[None, :]
    offs = rows[:, None] * som + cols[None, :]
    if SPLIT > 1:
        tl.store(part + split * M * N + offs, acc, mask=ok)
        tl.debug_barrier()  # this program's partial is stored before its ticket is taken (release)
        if tl.atomic_add(tickets + pid, 1) != SPLIT - 1:
            return
        tl.atomic_xchg(tickets + pid, 0)  # the last of the tile's SPLIT programs: reset, then reduce
        acc = tl.load(part + offs, mask=ok, other=0.0, cache_modifier=".cg")
        for s in range(1, SPLIT):
            acc += tl.load(part + s * M * N + offs, mask=ok, other=0.0, cache_modifier=".cg")
    if FP8:
        acc = acc * tl.load(ws + cols, mask=cok, other=0.0)[None, :]
    y = acc.to(out.dtype.element_ty)
    if HAS_RES:
        y = (tl.load(res + offs, mask=ok, other=0.0).to(tl.float32) + y.to(tl.float32)).to(out.dtype.element_ty)
    tl.store(out + offs, y, mask=ok)


@triton.jit
def _gemm_k_atomic_kernel(a, w, out32, counts, perm, work, M, N, NT, sam, swn,
                          GS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          IEEE: tl.constexpr):
    """The authors' gemm_k scheme, kept for comparison (gemm_k(method="atomic")).

    Grid (len(work), cdiv(N,BN)). Program = one group's sorted token tile x BN outputs; it sums
    that group's GS columns only (exact FLOP skipping) and atomically adds the partial into an
    fp32 buffer. Every live (token, group) pair costs N atomic adds, (1-s)*G*M*N in all, and
    the summation order (so the rounding) depends on scheduling: not deterministic.
    Twin: gemm_k_ref.
    """
    item = tl.load(work + tl.program_id(0))
    g, tile = item // NT, item % NT
    count = tl.load(counts + g)
    if tile * BM >= count:  # dead tile: return before any load (as in _gemm_mn_kernel)
        return
    p = tile * BM + tl.arange(0, BM)
    ok = p < count
    rows = tl.load(perm + g * M + p, mask=ok, other=0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, GS, BK):
        at = tl.load(a + rows[:, None] * sam + g * GS + k0 + kk[None, :], mask=ok[:, None], other=0.0)
        wt = tl.load(w + cols[:, None].to(tl.int64) * swn + g * GS + k0 + kk[None, :],
                     mask=(cols < N)[:, None], other=0.0)
        acc = tl.dot(at, tl.trans(wt), acc, input_precision="ieee" if IEEE else "tf32")
    tl.atomic_add(out32 + rows[:, None] * N + cols[None, :], acc,
                  mask=ok[:, None] & (cols < N)[None, :], sem="relaxed")


def gemm_k(a, w, mask_or_layout, group_size, method="tile", config=None, residual=None, tickets=None,
           w_scale=None, live=None, live_fresh=False):
    """Masked linear with reduction groups: a[M,K], w[N,K], mask [M, K/group_size] -> [M,N].

    residual [M, N]: return residual + (that result), the add fused into the kernel ("tile" only).
    tickets: int32 zeros, one per output tile, for the decode split (the kernel leaves them zero, so a
    CUDA graph can replay it; an engine keeps one buffer); None allocates them.
    w_scale [N]: w is float8_e4m3fn with these per-row scales ("tile" reads the fp8 bytes at any M;
    "atomic" dequantizes first).
    live: the router's live list of this mask (kernels_step.norm_route), int32 [1 + G]; a decode step's
    tile (all its tokens) reads it instead of scanning the mask. live_fresh: the launch just before this one
    wrote it (the decode GEMV that applied the router's rule), so config PREFETCH cannot read it early.

    method="tile" (default): deterministic, no atomics (see _gemm_k_kernel).
    method="atomic": per-group sorted tiles + fp32 atomics (the authors' scheme; not deterministic).
    Which is faster at prefill sizes with random masks: "tile", though neither beats cuBLAS. Every
    tile of per-token masks needs nearly every group, so "tile" skips no FLOPs (only pruned a-slots go
    unread); "atomic" skips them but pays fp32 atomic adds per output element. Both are timed in
    results/kernels_h200.md ("down" and "o_proj" rows, tile and atomic).
    """
    check_device(a)
    M, K = a.shape
    N = w.shape[0]
    G = K // group_size
    assert G * group_size == K and group_size % 16 == 0, "group_size must divide K and be a multiple of 16"
    if w_scale is not None and method == "atomic" and M > GEMV_MAX_TOKENS:
        w, w_scale = dequantize_fp8(w, w_scale, a.dtype), None
    a, w = a.contiguous(), w.contiguous()
    ieee = a.dtype == torch.float32
    if method == "atomic" and M > GEMV_MAX_TOKENS:
        lay = as_layout(mask_or_layout)
        cfg = config_for("gemm_k_atomic", config)
        out32 = torch.zeros((M, N), dtype=torch.float32, device=a.device)  # atomics need zeros
        NT = triton.cdiv(M, lay.block_m)
        grid = (G * NT, triton.cdiv(N, cfg["BN"]))
        _gemm_k_atomic_kernel[grid](a, w, out32, lay.counts, lay.perm, lay.work, M, N, NT,
                                    a.stride(0), w.stride(0), GS=group_size, BM=lay.block_m,
                                    BN=cfg["BN"], BK=pow2_divisor(group_size, cfg["BK"]),
                                    IEEE=ieee, **launch_args(cfg))
        return out32.to(a.dtype) if residual is None else residual + out32.to(a.dtype)
    assert method in ("tile", "atomic"), "method must be 'tile' or 'atomic'"
    m = flat_mask(mask_or_layout).view(torch.uint8)
    small = ("gemm_k_small_long_k" if K >= LONG_K else "gemm_k_small_1" if M == 1 else "gemm_k_small") + \
        ("_fp8" if w_scale is not None else "")
    cfg = config_for(small if M <= GEMV_MAX_TOKENS else "gemm_k", config)
    split = cfg.get("SPLIT", 1)
    BM = 1 if M == 1 and cfg.get("FMA") else cfg["BM"]  # FMA: one token as a one-row tile, no tl.dot
    out = empty((M, N), a.dtype, a.device)
    # With SPLIT > 1 the programs write fp32 partials over the live groups; the last one reduces them.
    part = empty((split, M, N), torch.float32, a.device) if split > 1 else out
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, cfg["BN"]), split)
    if tickets is None:
        tickets = torch.zeros(grid[0], dtype=torch.int32, device=a.device)
    assert tickets.numel() >= grid[0], "one ticket per output tile"
    if residual is not None:
        residual = residual.contiguous()
    GP = max(2, triton.next_power_of_2(G))
    assert live is None or (M <= BM and live.numel() == 1 + G), "live: one tile's list, the count then G groups"
    live_list = empty((grid[0] * split, GP) if live is None else (1,), torch.int32, a.device)
    ws = w_scale.contiguous() if w_scale is not None else out  # (a placeholder pointer without scales)
    _gemm_k_kernel[grid](a, w, ws, out, residual if residual is not None else out, part, tickets, m,
                         m if live is None else live, live_list,
                         M, N, K, G, a.stride(0), w.stride(0), N, GS=group_size, GP=GP, BM=BM,
                         BN=cfg["BN"], BK=pow2_divisor(group_size, cfg["BK"]), GROUP_M=8, SPLIT=split,
                         HAS_RES=residual is not None, FP8=w_scale is not None, IEEE=ieee,
                         F16=0 if w_scale is None else min(cfg.get("F16", 1), 1 if ieee else 2),
                         HAS_LIVE=live is not None,
                         PREFETCH=bool(cfg.get("PREFETCH")) and live is not None and not live_fresh,
                         PIPE=cfg.get("PIPE", 0), **launch_args(cfg), **pdl_args(a.device, cfg.get("EARLY_NEXT", False)))
    return out
