"""
What every kernel file shares: the interpreter switch, the block sizes, and the small host-side helpers the launches use (output buffers, the device check, the
programs-per-SM count). The kernel files import from here and from nowhere above them.
"""
import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

from cli import UserError

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LONG_K = 8192  # decode gemm_k with at least this reduction length splits its groups over programs

# Block sizes. Picked on an H200 by python -m bench.tune (every variant's time: results/kernels_h200_tune.md
# and results/kernels_h200_tune_fp8.md); the interpreter gets tiny fixed ones.
# Read-only: a caller that wants other sizes (the tuning sweep) passes `config=` to the op.
CONFIGS = {
    "block_m": 128,  # layout tile (gemm_mn token tile, gemm_k atomic token tile)
    "gemm_mn": dict(BN=128, BK=64, num_warps=8, num_stages=4),
    "gemm_mn_fused": dict(BN=128, BK=64, num_warps=8, num_stages=4),
    # One token. gate+up (two weights per step) streams best with more programs; Q with K and V (one
    # weight, a third of the bytes) with fewer, longer ones.
    "gemv_mn_1_fused": dict(BN=4, BK=1024, num_warps=4, num_stages=1, programs_per_sm=4),
    "gemv_mn_1": dict(BN=4, BK=2048, num_warps=4, num_stages=1, programs_per_sm=3),
    "gemv_mn": dict(BN=16, BK=256, num_warps=4, num_stages=1, programs_per_sm=2),
    # fp8 codes are half the bytes per element: longer K slices per step than the bf16 keys'. gate+up: config
    # PIPE (lane sums, 4 tiles in flight), picked on an H100 (results/kernels_h100_tune_pipe.md; the step with and
    # without it: e2e_h100_apick.md against e2e_h100_abase.md), not yet timed on an H200.
    "gemv_mn_1_fused_fp8": dict(BN=16, BK=512, programs_per_sm=2, PIPE=4, num_warps=4, num_stages=4),
    "gemv_mn_1_fp8": dict(BN=8, BK=1024, num_warps=4, num_stages=1, programs_per_sm=4),
    "gemm_k": dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3),
    # Decode O projection (K = 4096, 8 groups), 2 to 16 tokens: split over 4 programs too. One token (the _1
    # keys): no split, so no partials and no ticket, but a program per 4 output rows, one-row FMAs (config FMA)
    # with 4 slices in flight (PIPE); judged in the step (bench.tune --in-step), where the split lost for O and
    # won for down (long K): results/kernels_h100_tune_o1_all.md, kernels_h100_tune_down1.md.
    "gemm_k_small": dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=6, SPLIT=4),
    "gemm_k_small_1": dict(BM=16, BN=4, BK=512, SPLIT=1, FMA=True, PIPE=4, num_warps=4, num_stages=4),
    "gemm_k_small_1_fp8": dict(BM=16, BN=4, BK=512, SPLIT=1, FMA=True, PIPE=4, num_warps=4, num_stages=4),
    # Decode with a long reduction (the down projection, K >= 8192): split each tile's live groups
    # over 4 programs so more weight bytes are in flight.
    "gemm_k_small_long_k": dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=6, SPLIT=4),
    "gemm_k_small_fp8": dict(BM=16, BN=32, BK=128, num_warps=4, num_stages=6, SPLIT=4),
    "gemm_k_small_long_k_fp8": dict(BM=16, BN=128, BK=128, num_warps=4, num_stages=6, SPLIT=8),
    "gemm_k_atomic": dict(BN=128, BK=64, num_warps=8, num_stages=3),
    "attn_prefill": dict(BM=128, BN=64, num_warps=8, num_stages=3),
    # Decode attention: a work list of about programs_per_sm x SMs (row, KV head, chunk) items, at most
    # max_chunks per (row, KV head), merged in turn: merging all chunks at once was slower (the merge's
    # registers cost the whole kernel occupancy).
    "attn_decode": dict(BN=128, programs_per_sm=4, max_chunks=16, num_warps=8, num_stages=2),
    # A prefill chunk's norm + router (two launches): tiles of BT tokens, D in slices of DS columns, a program
    # per (tile, slice) in each launch. BK, num_warps, num_stages: the first half's (sums of squares and the
    # router's first Linear); FINISH_BK, finish_warps: the second's, which only streams h into RMSNorm(h) and
    # wants wider steps. PREC: the router's dots as three tf32 tensor-core products (fp32-accurate here: h is bf16,
    # exact in tf32); "ieee" (CUDA-core FMAs) was the slower: results/prefill_chunks_h100_ieee.md against
    # prefill_chunks_h100.md (the row-tile kernel before this one).
    "norm_route_parts": dict(BT=16, BK=32, DS=512, num_warps=2, num_stages=3, FINISH_BK=128, finish_warps=4,
                             PREC="tf32x3"),
}
if INTERPRET:  # few, big-ish programs: the interpreter pays per op, not per element
    LONG_K = 64  # so the small test shapes exercise both decode gemm_k variants
    CONFIGS.update({
        "block_m": 16,
        "gemm_mn": dict(BN=32, BK=32), "gemm_mn_fused": dict(BN=32, BK=32),
        "gemv_mn": dict(BN=16, BK=32, programs_per_sm=1), "gemv_mn_1": dict(BN=8, BK=32, programs_per_sm=1),
        "gemv_mn_1_fused": dict(BN=8, BK=32, programs_per_sm=1),
        "gemv_mn_1_fp8": dict(BN=8, BK=32, programs_per_sm=1), "gemv_mn_1_fused_fp8": dict(BN=8, BK=32, programs_per_sm=1),
        "gemm_k": dict(BM=16, BN=32, BK=16), "gemm_k_small": dict(BM=16, BN=32, BK=16, SPLIT=2),
        "gemm_k_small_long_k": dict(BM=16, BN=32, BK=16, SPLIT=2),
        "gemm_k_small_fp8": dict(BM=16, BN=32, BK=16, SPLIT=2), "gemm_k_small_long_k_fp8": dict(BM=16, BN=32, BK=16, SPLIT=2),
        "gemm_k_small_1": dict(BM=16, BN=8, BK=16, SPLIT=1, FMA=True, PIPE=2),
        "gemm_k_small_1_fp8": dict(BM=16, BN=8, BK=16, SPLIT=1, FMA=True, PIPE=2),
        "gemm_k_atomic": dict(BN=32, BK=16),
        "attn_prefill": dict(BM=16, BN=16), "attn_decode": dict(BN=16, programs_per_sm=4, max_chunks=4),
        "norm_route_parts": dict(BT=16, BK=16, DS=32, FINISH_BK=32, finish_warps=4),
    })


def empty(shape, dtype, device):
    # Every output and scratch buffer comes from here. Under the interpreter (the CPU tests) it starts
    # poisoned, NaN for floats and -1 for ints, so a slot that a kernel should write and does not fails
    # the comparison with the twin instead of passing on a lucky zero.
    if INTERPRET:
        return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def check_device(t):
    """Triton kernels run on CUDA tensors, or on the CPU under TRITON_INTERPRET=1; anything else fails here."""
    if not (t.is_cuda or INTERPRET):
        raise RuntimeError(f"the Triton kernels need a CUDA tensor (got one on {t.device}); on a CPU set "
                           "TRITON_INTERPRET=1 before starting Python, or call the *_ref twin")


def config_for(key, override):
    # The tuned block sizes of one kernel, with a caller's overrides (bench/tune.py's sweep) on top.
    return {**CONFIGS[key], **(override or {})}


@contextlib.contextmanager
def configs_tried(overrides):
    """Inside the block, CONFIGS[key] has overrides[key]'s sizes on top (every launch that takes no config=,
    so a whole engine and its CUDA graphs: bench.tune --in-step judges a variant in the decode step this way);
    the entries are restored after."""
    saved = {key: CONFIGS[key] for key in overrides}
    try:
        for key, sizes in overrides.items():
            CONFIGS[key] = {**saved[key], **sizes}
        yield
    finally:
        CONFIGS.update(saved)


def num_sms(device):
    if INTERPRET or device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


def pow2_divisor(n, cap):
    # The largest power of two <= cap that divides n (tiles must not straddle a group).
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def launch_args(cfg):
    return {k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg}


# Programmatic dependent launch (PDL: Hopper and newer, Triton's launch_pdl). A decode step is ~260 short
# launches; launched this way, a kernel's programs may start while the kernel before it on the stream still
# drains, so its launch and start-up overlap that kernel's tail instead of following it. The price is one
# rule, kept by every kernel that takes PDL: nothing that the previous kernel writes is read, and nothing
# at all is written, before `prior_done` (gdc_wait: the previous kernel has finished and its writes are
# visible). Every such kernel calls it on every path, and only then lets the next kernel start
# (gdc_launch_dependents), so a kernel that starts early always finds the one before its predecessor
# finished. Weights, which no kernel writes, may be read before the wait (norm_route does: their latency
# then hides behind the previous kernel's end), and so may what only kernels before the predecessor wrote
# (gemm_k's config PREFETCH: norm_route's live list); tests/test_pdl.py checks the rule on every kernel's
# source. CUDA graphs keep the overlap (programmatic edges). WIDE_PDL=0 turns it off.
PDL_MODES = {"0": 0, "exit": 1, "early": 2}


def pdl(device):
    """How kernels on `device` launch (CUDA, compute capability >= 9; else 0): WIDE_PDL = "0" (stream order),
    "exit" (the next kernel may launch once every program has exited, before its writes are flushed) or
    "early" (once every program has passed its wait)."""
    mode = os.environ.get("WIDE_PDL", "exit")
    if mode not in PDL_MODES:
        raise UserError(f"WIDE_PDL={mode!r}: use one of {', '.join(PDL_MODES)}")
    if INTERPRET or device.type != "cuda" or not PDL_MODES[mode]:
        return 0
    return PDL_MODES[mode] if _sm90(device.index if device.index is not None else torch.cuda.current_device()) else 0


@functools.lru_cache(maxsize=None)
def _sm90(index):
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(device, early=False):
    """The launch keywords of a kernel that takes PDL: its PDL constexpr and Triton's launch_pdl. early: this one
    launch lets the next kernel launch once its programs have passed their wait, whatever WIDE_PDL says (a
    config's choice, e.g. gemm_k's EARLY_NEXT; "0" still turns PDL off)."""
    mode = pdl(device)
    return dict(PDL=PDL_MODES["early"] if early and mode else mode, launch_pdl=mode > 0)


@contextlib.contextmanager
def pdl_off():
    """Launches inside run without PDL (the benchmarks' comparison); graphs captured inside keep that."""
    old = os.environ.get("WIDE_PDL")
    os.environ["WIDE_PDL"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["WIDE_PDL"]
        else:
            os.environ["WIDE_PDL"] = old


@triton.jit
def codes_f32(w, FP8: tl.constexpr):
    # Weights as fp32. e4m3 codes go through f16: exact (every e4m3 value is an f16 value), and one hardware
    # conversion per two codes, where a direct e4m3 -> fp32 (or -> bf16) conversion takes several instructions.
    if FP8:
        return w.to(tl.float16).to(tl.float32)
    return w.to(tl.float32)


@triton.jit
def prior_done(PDL: tl.constexpr):
    """PDL: wait until the previous kernel on the stream has finished (its writes visible), then let the
    next kernel launch. Without PDL (and under the interpreter) nothing: stream order already did it."""
    if PDL > 0:
        tl.extra.cuda.gdc_wait()
    if PDL > 1:
        tl.extra.cuda.gdc_launch_dependents()


# wide.Router's decision, shared by the two kernels that make it (norm_route's last program; with
# norm_route_deferred, the decode GEMV's programs), so that both apply it in the same order of operations.
@triton.jit
def router_second_linear(wu, bu, g, G, rr, R):
    # The second Linear's (execute, skip) rows [len(g), len(rr)] and biases: weights, so loadable before a PDL wait
    wm = (g < G)[:, None] & (rr < R)[None, :]
    w_exec = tl.load(wu + (2 * g)[:, None] * R + rr[None, :], mask=wm, other=0.0)
    w_skip = tl.load(wu + (2 * g + 1)[:, None] * R + rr[None, :], mask=wm, other=0.0)
    return w_exec, w_skip, tl.load(bu + 2 * g, mask=g < G, other=0.0), tl.load(bu + 2 * g + 1, mask=g < G, other=0.0)


@triton.jit
def router_rule(zr, w_exec, w_skip, b_exec, b_skip):
    # One token's groups from its first-Linear outputs zr [1, R]: skip iff z_skip > z_exec (a tie executes)
    return tl.sum(w_skip * zr, 1) + b_skip <= tl.sum(w_exec * zr, 1) + b_exec


@triton.jit
def store_live(live, on, g, G):
    # The live list of a decision (on: int32, 1 where some token runs group g): the number of such groups, those
    # groups ascending, then the others ascending
    on = tl.where(g < G, on, 0)
    off = tl.where(g < G, 1 - on, 0)
    n_on = tl.sum(on, 0)
    tl.store(live, n_on)
    tl.store(live + 1 + tl.cumsum(on, 0) - 1, g, mask=on > 0)
    tl.store(live + 1 + n_on + tl.cumsum(off, 0) - 1, g, mask=off > 0)
