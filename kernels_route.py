"""
A sublayer's start for the tokens of a step, after its PyTorch twin: the residual add, RMSNorm and the
wide.Router decision in one kernel (norm_route), so the routers cost no launches of their own, and the live
list of the groups some token runs, which the decode kernels read instead of scanning the mask.

  decode steps (up to NORM_ROUTE_SPLIT_MAX_TOKENS tokens)   _norm_route_kernel: the router's ranks split over
                                                            programs, so a few tokens still spread over the GPU
  prefill chunks                                            the D-split pair: _norm_route_part_kernel, then
                                                            _norm_route_finish_kernel

They skip nothing. Same contract as kernels.py: Triton on a GPU or under TRITON_INTERPRET=1, or a clear error.
"""
import torch
import triton
import triton.language as tl

from kernels_base import INTERPRET, check_device, config_for, empty, launch_args, pdl_args, prior_done
from kernels_step import rms_norm_ref
from policy import NORM_ROUTE_SPLIT_MAX_TOKENS, NORM_ROUTE_TILE

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
            BG=max(16, triton.next_power_of_2(G)), SC=min(8, triton.next_power_of_2(S)), PREC=prec,
            num_warps=cfg["finish_warps"], **pdl_args(x.device))
        normed = y.view(x.shape) if residual is None else (h.view(x.shape), y.view(x.shape))
        return normed, keep.view(torch.bool).view(B, T, G), keepf.view(B, T, G), None
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
        BK=BK, RP=RP, BG=BG, CWP=triton.next_power_of_2(CW), ONE_PASS=BK >= D,
        num_warps=8, **pdl_args(x.device))  # wide chunks: the loop over D is latency-bound, so few long iterations
    normed = y.view(x.shape) if residual is None else (h.view(x.shape), y.view(x.shape))
    return normed, keep.view(torch.bool).view(B, T, G), keepf.view(B, T, G), live if n_tiles == 1 else None


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
                       PDL: tl.constexpr):
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
    pass over D). Skips nothing. Twin: norm_route_ref."""
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
    wm = (g < G)[:, None] & (rr < R)[None, :]
    w_exec = tl.load(wu + (2 * g)[:, None] * R + rr[None, :], mask=wm, other=0.0)  # [BG, RP]
    w_skip = tl.load(wu + (2 * g + 1)[:, None] * R + rr[None, :], mask=wm, other=0.0)
    b_exec = tl.load(bu + 2 * g, mask=g < G, other=0.0)
    b_skip = tl.load(bu + 2 * g + 1, mask=g < G, other=0.0)
    prior_done(PDL)
    t = tile * BT + tl.arange(0, BT)
    tok = t < M
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
    # h and RMSNorm(h) for this program's slice of CW columns (every program has its tokens' sums of
    # squares), so the write-out is spread over the grid instead of one program's serial loop.
    ok, offs = tok[:, None] & cok[None, :], t[:, None].to(tl.int64) * D + c[None, :]
    hv = _residual_add(x, res, offs, ok, HAS_RES)
    if HAS_RES:
        tl.store(h_out + offs, hv, mask=ok)
    n = (hv.to(tl.float32) * tl.rsqrt(ss / D + eps)[:, None]).to(hv.dtype)
    tl.store(y + offs, (wt.to(tl.float32)[None, :] * n.to(tl.float32)).to(y.dtype.element_ty), mask=ok)
    tl.debug_barrier()  # every thread's z is stored before the ticket is taken (release)
    if tl.atomic_add(tickets + tile, 1) == tl.num_programs(0) - 1:  # the tile's last program: its z is complete
        tl.atomic_xchg(tickets + tile, 0)
        any_run = tl.zeros([BG], tl.int32)
        for m in range(tile * BT, tl.minimum(tile * BT + BT, M)):
            zr = tl.load(z + m * R + rr, mask=rr < R, other=0.0, cache_modifier=".cg")[None, :]
            run = tl.sum(w_skip * zr, 1) + b_skip <= tl.sum(w_exec * zr, 1) + b_exec  # a tie executes
            tl.store(keep + m * G + g, run.to(tl.uint8), mask=g < G)
            tl.store(keepf + m * G + g, run.to(tl.float32), mask=g < G)
            any_run = any_run | run.to(tl.int32)
        if LIVE:
            # The live list, built once per router decision: gemm_k's decode tile visits only its groups
            on = tl.where(g < G, any_run, 0)
            off = tl.where(g < G, 1 - any_run, 0)
            n_live = tl.sum(on, 0)
            tl.store(live, n_live)
            tl.store(live + 1 + tl.cumsum(on, 0) - 1, g, mask=on > 0)
            tl.store(live + 1 + n_live + tl.cumsum(off, 0) - 1, g, mask=off > 0)


@triton.jit(do_not_specialize=["M"])  # chunk lengths: see engine.warm_chunks
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
        w = tl.load(wd + rr[:, None] * D + k0 + kk[None, :], mask=(rr < R)[:, None] & (k0 + kk < D)[None, :],
                    other=0.0)
        z = tl.dot(hf, tl.trans(w), z, input_precision=PREC)
    tl.store(part_ss + s * M + t, ss, mask=tok)
    tl.store(part_z + (s * M + t)[:, None] * RP + rr[None, :], z, mask=tok[:, None])


@triton.jit(do_not_specialize=["M"])  # chunk lengths: see engine.warm_chunks
def _norm_route_finish_kernel(h, y, nw, eps, bd, wu, bu, part_ss, part_z, keep, keepf, M, D, R, G, S,
                              BT: tl.constexpr, BK: tl.constexpr, DS: tl.constexpr, RP: tl.constexpr,
                              BG: tl.constexpr, SC: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    """A prefill chunk's norm + router, second half. Grid (cdiv(M, BT), S + 1) for the first half's S slices.

    Program (tile, s < S) adds its tokens' S partial sums of squares up and writes RMSNorm(h) for D-slice s
    (h as the first half wrote it, or x without a residual; rounded as the norm kernel does). Program (tile, S)
    adds the partial first Linear up, adds its bias, and applies the second Linear and wide.Router's rule (skip
    iff z_skip > z_exec; a tie executes) to the tile: a program of its own, so the rule's dependent loads and
    dots run beside the slices' write-out, not after one of them. The partial sums come SC slices per load: a
    load per slice in turn was a chain of dependent latencies as long as the slices are many. Deterministic:
    fixed-order sums, no atomics, every output written by one program. Skips nothing. Twin: norm_route_ref."""
    tile, s = tl.program_id(0), tl.program_id(1)
    t = tile * BT + tl.arange(0, BT)
    tok = t < M
    sc = tl.arange(0, SC)
    prior_done(PDL)
    if s < S:
        ss = tl.zeros([BT], tl.float32)
        for i in range(0, S, SC):
            ss += tl.sum(tl.load(part_ss + (i + sc)[:, None] * M + t[None, :],
                                 mask=(i + sc < S)[:, None] & tok[None, :], other=0.0), 0)
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
        for i in range(0, S, SC):
            part = part_z + (((i + sc) * M)[:, None, None] + t[None, :, None]) * RP + rr[None, None, :]
            z += tl.sum(tl.load(part, mask=(i + sc < S)[:, None, None] & tok[None, :, None], other=0.0), 0)
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

