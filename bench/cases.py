"""
The op cases the kernel benchmarks time (bench/ops.py) and sweep (bench/tune.py): each WIDE op at one
shape with its dense rivals, its fp32 twin and the check every mask passes before it is timed.

A Setup is the Llama-3.1-8B shapes in bf16 on the GPU, or tiny fp32 shapes on the CPU under the Triton
interpreter (--smoke). A Case holds the rotating copies of its weights / KV cache (rotation()): between two
uses of one copy, the others' sparse bytes are at least 2x the L2, so nothing stays cached.
"""
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from bench import common
from kernels_attention import attention_decode, attention_decode_ref, attention_prefill, attention_prefill_ref
from kernels_layout import layout
from kernels_step import live_ref, norm_route, norm_route_ref, quantize_rows, rms_norm
from model import RMSNorm
from policy import GEMV_MAX_TOKENS, NORM_ROUTE_TILE
from wide import Router

DECODE_TOKENS = GEMV_MAX_TOKENS      # rows with at most this many tokens are decode-sized: judged on graphs


@dataclass
class Setup:
    """Shapes, device and dtype of a run: Llama-3.1-8B in bf16 on the GPU, or tiny fp32 shapes on the
    CPU under the Triton interpreter (--smoke: every check, row and writer runs; times mean nothing)."""
    D: int = 4096
    H: int = 32
    HKV: int = 8
    HD: int = 128
    FFN: int = 14336
    ffn_gs: int = 128        # channels per FFN group
    prefill_m: int = 4096    # tokens of the prefill-sized linear rows
    prefill_t: int = 16384   # tokens of the causal prefill attention row
    decode_b: int = 16       # decode attention: batch ...
    decode_l: int = 8192     # ... and cached tokens
    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"
    l2_bytes: int = 60 << 20
    smoke: bool = False
    sparsities: tuple = (0.25, 0.5, 0.75)
    max_rotation_bytes: float = 24e9  # at most this much memory for the rotating copies of one case

    @property
    def attn_gs(self):  # an attention group is one KV head's query heads: H / HKV heads of HD channels
        return self.H // self.HKV * self.HD


def gpu_setup():
    return Setup(l2_bytes=torch.cuda.get_device_properties(0).L2_cache_size)


def smoke_setup():
    # 4 attention groups (2 heads of 16 each, one KV head) and 4 FFN groups of 32 channels.
    return Setup(D=64, H=8, HKV=4, HD=16, FFN=128, ffn_gs=32, prefill_m=32, prefill_t=32, decode_b=2,
                 decode_l=64, dtype=torch.float32, device="cpu", l2_bytes=8 << 10, smoke=True)


# ----------------------------------------------------------------------------------- masks and errors
def rand_mask(s, shape, sparsity):
    # Uniformly random (token, group) decisions, exactly round((1 - sparsity) * n) live (True = runs).
    n = math.prod(shape)
    return (torch.randperm(n, device=s.device) < round((1 - sparsity) * n)).view(shape)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()



# ----------------------------------------------------------------------------------- op cases
@dataclass
class Case:
    """One op at one shape. dense: baseline name -> one callable per rotating copy. sparse(mask, copy,
    config) runs the WIDE op; reference(mask) is its fp32 twin; keep(mask) says where the output may be
    non-zero (None: everywhere). Outputs may be tuples (the QKV row). prunable: the share of the dense
    op's bytes (decode-sized) or FLOPs (prefill) that skipped groups save."""
    op: str
    tokens: int
    batch: int
    context: int
    mask_shape: tuple
    flops: float      # of the dense op
    bytes: float      # read and written by the dense op
    prunable: float
    copies: int       # rotating copies of the weights / KV (rotation())
    dense: dict
    sparse: object
    reference: object
    keep: object
    baseline: tuple = ("dense",)  # dense_ms = the best of these; the other entries get speedup_vs_<name>

    @property
    def decode(self):
        return self.tokens <= DECODE_TOKENS


def rotation(s, tokens, nbytes, prunable):
    """How many copies of the weights / KV to rotate: between two uses of one copy the others are read,
    (n - 1) * (sparse bytes of one call at the highest timed sparsity) >= 2 x L2. Prefill rows: 1
    (do_bench flushes the L2 itself)."""
    if tokens > DECODE_TOKENS:
        return 1
    least = nbytes * (1 - prunable * max(s.sparsities))
    n = math.ceil(2 * s.l2_bytes / least) + 1
    return max(2, min(n, int(s.max_rotation_bytes // nbytes)))


def weights(s, n, k, copies):
    return [torch.randn(n, k, device=s.device, dtype=s.dtype) / math.sqrt(k) for _ in range(copies)]


def with_layout(mask, config, tokens):
    # A tuning config may carry block_m, the layout's token tile; the rest goes to the op as config=.
    config = dict(config or {})
    block_m = config.pop("block_m", None)
    if block_m and tokens > DECODE_TOKENS:
        return layout(mask, block_m=block_m), config
    return mask, config


def router_lists(T):
    """mask -> what gemm_k's decode tile reads in the engine besides the mask: norm_route's live list of it, for a
    step of one token tile (else None). The router kernel writes it, so its time is the router's (the step
    profile's norm + router rows); here each mask's list is made once, outside the timed calls."""
    made = {}  # id(mask) -> (mask, list); holding the mask keeps its id from being reused

    def live(mask):
        if T > NORM_ROUTE_TILE:
            return None
        if id(mask) not in made:
            made[id(mask)] = (mask, live_ref(mask))
        return made[id(mask)][1]
    return live


def swiglu(y):
    half = y.shape[-1] // 2
    return F.silu(y[:, :half]) * y[:, half:]


def fp8_copies(ws, fp8):
    # fp8: each copy as (e4m3 codes, per-row scales); else (w, None).
    return [kernels.quantize_fp8(w) if fp8 else (w, None) for w in ws]


def fp8_dense(x, wq, fns):
    """The dense rivals of an fp8 case: stock fp8 (the input quantized per token, then torch._scaled_mm on the
    codes: kernels_step.quantize_rows, kernels.scaled_mm) first, the baseline (at one token the faster of its
    per-row and per-tensor paths); then the bf16 ones (fns)."""
    stock = [lambda i=i: kernels.scaled_mm(quantize_rows(x), *wq[i], x.dtype) for i in range(len(wq))]
    if x.shape[0] > 1:
        return dict(scaled_mm=stock, **fns), ("scaled_mm",)
    # one token: the library's per-tensor path too (kernels.scaled_mm(tensorwise=True)); the baseline is the faster
    tensorwise = [lambda i=i: kernels.scaled_mm(quantize_rows(x), *wq[i], x.dtype, True) for i in range(len(wq))]
    return dict(scaled_mm=stock, scaled_mm_tensorwise=tensorwise, **fns), ("scaled_mm", "scaled_mm_tensorwise")


def case_gate_up(s, T, fp8=False):
    e, I, D, gs = s.dtype.itemsize, s.FFN, s.D, s.ffn_gs
    ew = 1 if fp8 else e  # bytes per weight element
    nbytes = ew * 2 * I * D + e * (T * D + T * I)
    copies = rotation(s, T, nbytes, 2 * I * D * ew / nbytes)
    wgu = weights(s, 2 * I, D, copies)  # the dense side's fused [gate; up] weight; WIDE reads its halves
    wq = fp8_copies(wgu, fp8)
    x = torch.randn(T, D, device=s.device, dtype=s.dtype)

    def sparse(mask, i, config=None):
        m, cfg = with_layout(mask, config, T)
        (w, sc) = wq[i]
        return kernels.gemm_mn(x, w[:I], m, gs, w_up=w[I:], config=cfg, w_scale=None if sc is None else sc[:I],
                               w_up_scale=None if sc is None else sc[I:])

    def reference(mask):  # fp8: the twin dequantizes (to x's fp32)
        w, sc = wq[0]
        if fp8:
            return kernels.gemm_mn_ref(x.float(), w[:I], mask, gs, w[I:], w_scale=sc[:I], w_up_scale=sc[I:])
        return kernels.gemm_mn_ref(x.float(), w[:I].float(), mask, gs, w[I:].float())

    dense = {"dense": [lambda i=i: F.linear(x, wgu[i]) for i in range(copies)],
             "dense_swiglu": [lambda i=i: swiglu(F.linear(x, wgu[i])) for i in range(copies)]}
    dense, baseline = fp8_dense(x, wq, dense) if fp8 else (dense, ("dense",))
    return Case(("fp8 " if fp8 else "") + "gate+up (gemm_mn, fused silu*up)", T, 1, 0, (T, I // gs), 2 * T * 2 * I * D,
                nbytes, 2 * I * D * ew / nbytes, copies, dense=dense, sparse=sparse, reference=reference,
                keep=lambda mask: mask.repeat_interleave(gs, 1), baseline=baseline)


def case_q(s, T, with_kv, fp8=False):
    # Q alone: the kernel against cuBLAS. With K/V: the attention projections as the engine runs them,
    # Q through gemm_mn (pruned) and K/V one dense GEMM (never pruned: the cache stays complete), against
    # one dense GEMM over the fused [Q; K; V] weight.
    e, D, NQ, gs = s.dtype.itemsize, s.D, s.H * s.HD, s.attn_gs
    ew = 1 if fp8 else e
    N = NQ + (2 * s.HKV * s.HD if with_kv else 0)
    nbytes = ew * N * D + e * (T * D + T * N)
    copies = rotation(s, T, nbytes, NQ * D * ew / nbytes)
    w = weights(s, N, D, copies)
    wq = fp8_copies(w, fp8)
    x = torch.randn(T, D, device=s.device, dtype=s.dtype)
    assert not fp8 or (with_kv and T <= GEMV_MAX_TOKENS), "fp8: the decode stream (Q with K/V) only"

    def sparse(mask, i, config=None):
        m, cfg = with_layout(mask, config, T)
        if with_kv and T <= GEMV_MAX_TOKENS:  # decode: one stream, K/V as always-live groups (engine.py)
            qkv = kernels.gemm_mn(x, wq[i][0], m, gs, config=cfg, dense_tail=N - NQ, w_scale=wq[i][1])
            return qkv[:, :NQ], qkv[:, NQ:]
        q = kernels.gemm_mn(x, w[i][:NQ], m, gs, config=cfg)
        return (q, F.linear(x, w[i][NQ:])) if with_kv else q

    def reference(mask):
        w0 = kernels.dequantize_fp8(*wq[0]) if fp8 else w[0].float()
        q = kernels.gemm_mn_ref(x.float(), w0[:NQ], mask, gs)
        return (q, F.linear(x.float(), w0[NQ:])) if with_kv else q

    keep = lambda mask: (mask.repeat_interleave(gs, 1), None) if with_kv else mask.repeat_interleave(gs, 1)
    name = f"Q/K/V proj (Q pruned, {gs}-ch groups; K/V dense)" if with_kv else f"q_proj (gemm_mn, {gs}-ch groups)"
    # (decode: Q's live groups, K and V in one gemv_mn launch; prefill: gemm_mn for Q, cuBLAS for K/V)
    dense = {"dense": [lambda i=i: F.linear(x, w[i]) for i in range(copies)]}
    dense, baseline = fp8_dense(x, wq, dense) if fp8 else (dense, ("dense",))
    return Case(("fp8 " if fp8 else "") + name, T, 1, 0, (T, NQ // gs), 2 * T * N * D, nbytes, NQ * D * ew / nbytes,
                copies, dense=dense, sparse=sparse, reference=reference, keep=keep, baseline=baseline)


def case_k(s, T, K, gs, name, method="tile", fp8=False):
    e, D = s.dtype.itemsize, s.D
    ew = 1 if fp8 else e
    nbytes = ew * D * K + e * (T * D + T * K)
    copies = rotation(s, T, nbytes, D * K * ew / nbytes)
    w = weights(s, D, K, copies)
    wq = fp8_copies(w, fp8)
    a = torch.randn(T, K, device=s.device, dtype=s.dtype)
    tickets = torch.zeros(D, dtype=torch.int32, device=s.device)  # the engine keeps one zeroed buffer
    lives = router_lists(T)

    def sparse(mask, i, config=None):
        m, cfg = with_layout(mask, config, T) if method == "atomic" else (mask, config)
        live = lives(mask) if method == "tile" else None
        return kernels.gemm_k(a, wq[i][0], m, gs, method=method, config=cfg, w_scale=wq[i][1], live=live,
                              tickets=tickets)

    dense = {"dense": [lambda i=i: F.linear(a, w[i]) for i in range(copies)]}
    dense, baseline = fp8_dense(a, wq, dense) if fp8 else (dense, ("dense",))
    return Case(("fp8 " if fp8 else "") + f"{name} (gemm_k, {gs}-ch groups, {method})", T, 1, 0, (T, K // gs),
                2 * T * D * K, nbytes, D * K * ew / nbytes, copies, dense=dense, sparse=sparse,
                reference=lambda mask: kernels.gemm_k_ref(
                    a.float(), kernels.dequantize_fp8(*wq[0]) if fp8 else w[0].float(), mask, gs),
                keep=lambda mask: None, baseline=baseline)


def case_decode_attention(s, B=None, L=None):
    e, H, HKV, HD = s.dtype.itemsize, s.H, s.HKV, s.HD
    B, L = B or s.decode_b, L or s.decode_l
    nbytes = e * (2 * B * HKV * L * HD + 2 * B * H * HD)
    copies = rotation(s, 1, nbytes, 2 * B * HKV * L * HD * e / nbytes)
    q = torch.randn(B, H, 1, HD, device=s.device, dtype=s.dtype)
    kv = [(torch.randn(B, HKV, L, HD, device=s.device, dtype=s.dtype),
           torch.randn(B, HKV, L, HD, device=s.device, dtype=s.dtype)) for _ in range(copies)]
    kv_len = torch.full((B,), L, device=s.device, dtype=torch.int32)
    G, hpg = HKV, H // HKV

    def sparse(mask, i, config=None):
        return attention_decode(q, kv[i][0], kv[i][1], mask, kv_len, config=config)

    return Case("attention decode (GQA, split-KV)", 1, B, L, (B, G), 4 * B * H * L * HD, nbytes,
                2 * B * HKV * L * HD * e / nbytes, copies,
                dense={"dense": [lambda i=i: F.scaled_dot_product_attention(q, kv[i][0], kv[i][1], enable_gqa=True)
                                 for i in range(copies)]}, sparse=sparse,
                reference=lambda mask: attention_decode_ref(q.float(), kv[0][0].float(), kv[0][1].float(),
                                                            mask, kv_len),
                keep=lambda mask: mask.repeat_interleave(hpg, 1)[:, :, None, None].expand(B, H, 1, HD))


def case_norm_route(s, T, G):
    """A prefill chunk's residual add + RMSNorm + router (kernels_step.norm_route) for a G-group router: h,
    RMSNorm(h) and the decisions, checked against the twin (one flipped decision fails the check). A config goes
    to the D-split pair (norm_route_parts); SPLIT_TILE (a number of tokens) sends the chunk to the split kernel
    in tiles of that many instead. Dense: the engine's other path (the norm kernel, then the router module op by
    op) and the dense model's plain norm. The mask is not an input: the op makes it."""
    torch.manual_seed(0)
    D = s.D
    x, res = (torch.randn(1, T, D, device=s.device, dtype=s.dtype) for _ in range(2))
    router = Router(D, G, 32).to(s.device).eval()
    norm = RMSNorm(D, 1e-5).to(s.device, s.dtype)
    tickets = torch.zeros(4096, dtype=torch.int32, device=s.device)

    def sparse(mask, i, config=None):
        cfg = dict(config or {})
        tile = cfg.pop("SPLIT_TILE", None)
        (h, y), _, keepf, _ = (norm_route(x, norm, router, res, tickets, split_max_tokens=T, tile_tokens=tile)
                               if tile else norm_route(x, norm, router, res, tickets, config=cfg, split_max_tokens=0))
        return h, y, keepf

    def reference(mask):
        (h, y), _, keepf = norm_route_ref(x, norm, router, res)
        return h, y, keepf

    def router_module():
        h, y = rms_norm(x, norm, res)
        return y, router(h)

    flops = 2 * T * D * router.down.out_features
    return Case(f"norm_route ({G}-group router)", T, 1, 0, (T, 1), flops, 3 * s.dtype.itemsize * T * D,
                0.0, 1, dense={"router module": [router_module], "rms_norm": [lambda: rms_norm(x, norm, res)]},
                sparse=sparse, reference=reference, keep=lambda mask: (None, None, None),
                baseline=("router module",))


def case_prefill_attention(s):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    e, T, H, HKV, HD = s.dtype.itemsize, s.prefill_t, s.H, s.HKV, s.HD
    q = torch.randn(1, H, T, HD, device=s.device, dtype=s.dtype)
    k, v = (torch.randn(1, HKV, T, HD, device=s.device, dtype=s.dtype) for _ in range(2))
    kx, vx = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)  # GQA expanded once, untimed

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, kx, vx, is_causal=True)

    def sparse(mask, i, config=None):
        m, cfg = with_layout(mask, config, T)
        return attention_prefill(q, k, v, m, config=cfg)

    dense = {"sdpa_gqa": [lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)],
             "sdpa_expanded": [lambda: F.scaled_dot_product_attention(q, kx, vx, is_causal=True)]}
    if not s.smoke:  # the flash backend needs a GPU
        dense["sdpa_flash"] = [flash]
    return Case("attention prefill (causal, GQA)", T, 1, T, (1, T, HKV), 4 * H * T * T * HD // 2,
                e * T * HD * (2 * H + 2 * HKV), 1.0, 1, dense=dense, sparse=sparse,
                reference=lambda mask: attention_prefill_ref(q.float(), k.float(), v.float(), mask),
                keep=lambda mask: mask.repeat_interleave(H // HKV, -1).permute(0, 2, 1)[..., None].expand(1, H, T, HD),
                baseline=("sdpa_gqa", "sdpa_expanded"))


def all_cases(s):
    """(op name for --only, factory). Built one at a time, so only one case's copies live at once."""
    M, long_k = s.prefill_m, s.FFN
    return [
        ("gate+up", lambda: case_gate_up(s, 1)),
        ("gate+up", lambda: case_gate_up(s, 8)),
        ("gate+up", lambda: case_gate_up(s, M)),
        ("q_proj", lambda: case_q(s, 1, False)),
        ("q_proj", lambda: case_q(s, M, False)),
        ("qkv", lambda: case_q(s, 1, True)),
        ("qkv", lambda: case_q(s, M, True)),
        ("down", lambda: case_k(s, 1, long_k, s.ffn_gs, "down")),
        ("down", lambda: case_k(s, M, long_k, s.ffn_gs, "down")),
        ("down atomic", lambda: case_k(s, M, long_k, s.ffn_gs, "down", "atomic")),
        ("o_proj", lambda: case_k(s, 1, s.H * s.HD, s.attn_gs, "o_proj")),
        ("o_proj", lambda: case_k(s, M, s.H * s.HD, s.attn_gs, "o_proj")),
        ("o_proj atomic", lambda: case_k(s, M, s.H * s.HD, s.attn_gs, "o_proj", "atomic")),
        ("fp8 gate+up", lambda: case_gate_up(s, 1, fp8=True)),  # e4m3 weights against stock fp8 (_scaled_mm)
        ("fp8 qkv", lambda: case_q(s, 1, True, fp8=True)),
        ("fp8 down", lambda: case_k(s, 1, long_k, s.ffn_gs, "down", fp8=True)),
        ("fp8 o_proj", lambda: case_k(s, 1, s.H * s.HD, s.attn_gs, "o_proj", fp8=True)),
        ("attention decode", lambda: case_decode_attention(s)),
        ("attention prefill", lambda: case_prefill_attention(s)),
    ]


# ----------------------------------------------------------------------------------- measuring
class CheckFailed(RuntimeError):
    pass


def check(case, mask, config=None):
    """Correctness of one mask before it is timed: rel err vs the fp32 twin <= 1e-2, pruned slots
    exactly 0, no NaN (under the interpreter every output starts as NaN, so an unwritten slot fails)."""
    as_tuple = lambda t: t if isinstance(t, tuple) else (t,)
    outs, refs, keeps = as_tuple(case.sparse(mask, 0, config)), as_tuple(case.reference(mask)), as_tuple(case.keep(mask))
    err = max(rel_err(o, r) for o, r in zip(outs, refs))
    zeros = all(bool((o[~k] == 0).all()) for o, k in zip(outs, keeps) if k is not None)
    nan_free = not any(bool(torch.isnan(o).any()) for o in outs)
    if not (err <= 1e-2 and zeros and nan_free):
        raise CheckFailed(f"{case.op}, {case.tokens} tokens, {1 - mask.float().mean().item():.0%} skipped: "
                          f"rel err {err:.2e}, pruned slots zero {zeros}, no NaN {nan_free}")
    return dict(rel_err=err, pruned_zero=zeros, nan_free=nan_free)


def command_line(doc, script, results, only, argv=None, having=False, in_step=False):
    """The command line of bench/ops.py and bench/tune.py (--only, --out, --smoke; --having, --in-step: tune's),
    checked, then the device check: (args, argv, the Setup to run)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = common.parser(doc, script, results)
    p.add_argument("--only", type=lambda v: [w for w in v.split(",") if w], default=[],
                   help=f"only the {only} whose name contains one of these (comma-separated)")
    if having:
        p.add_argument("--having", type=lambda v: [w for w in v.split(",") if w], default=[],
                       help="only the variants whose config sets one of these names (comma-separated, e.g. "
                       "PIPE,FMA); the current config is always timed first")
    if in_step:
        p.add_argument("--in-step", action="store_true",
                       help="judge each decode key's variants in the whole decode step (bench.e2e's model, WIDE "
                       "and dense) instead of as one op")
    args = p.parse_args(argv)
    common.prepare(args, script, argv, results)
    return args, argv, smoke_setup() if args.smoke else gpu_setup()


