"""
A lab for the prefill gate+up tile (kernels.gemm_mn with w_up): does one 2*BN-wide product per K step beat
the shipped kernel's two BN-wide ones? The shipped tile loads a [BN, BK] slice of gate and one of up and runs two
tensor-core products into two accumulators, so each K step reads the token tile from shared memory twice. Here
the weight is stored interleaved, row 2c = gate row c and row 2c + 1 = up row c (a group's gate and up rows are
then one contiguous block), so a program's [2 BN, BK] slice is one load and one product into a [BM, 2 BN]
accumulator whose column pairs (gate c, up c) split apart in the epilogue. The same layout (counts, perm, work
list) and the same routed skipping as the shipped kernel; cuBLAS on the same interleaved weight (every token,
every channel) is the dense side.

    python -m research.gate_up_lab                  # -> results/gate_up_lab_<gpu>.{json,md}
    TRITON_INTERPRET=1 python -m research.gate_up_lab   # the lab kernel against its twin on the CPU, small sizes

Config tuples: (BN, BK, num_warps, num_stages, gather); gather 0 reads each tile's tokens as consecutive rows
instead of through the layout's permutation (wrong values; it times what the gathered loads cost).
"""
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import cli
import kernels
import kernels_base
import kernels_layout
from bench.common import bench_ms
from research.lab import cells, lab_main, lab_row

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP else "cuda"


@triton.jit
def lab_gate_up(x, w, out, counts, perm, work, M, K, NT, sxm, som, GS: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, GATHER: tl.constexpr, IEEE: tl.constexpr):
    """out[t, c] = silu(x[t] . gate[c]) * (x[t] . up[c]) for the tokens t that run c's group, w interleaved
    [2 I, K]. Grid (len(work), GS // BN); dead tiles write zeros, as the shipped kernel's do."""
    item = tl.load(work + tl.program_id(0))
    g, tile = item // NT, item % NT
    count = tl.load(counts + g)
    p = tile * BM + tl.arange(0, BM)
    if GATHER:
        rows = tl.load(perm + g * M + p, mask=p < M, other=0).to(tl.int64)
    else:
        rows = (p % M).to(tl.int64)
    c0 = g * GS + tl.program_id(1) * BN
    cols = c0 + tl.arange(0, BN)
    optr = out + rows[:, None] * som + cols[None, :]
    if tile * BM >= count:
        tl.store(optr, tl.zeros([BM, BN], out.dtype.element_ty), mask=(p < M)[:, None])
        return
    ok = p < count
    kk = tl.arange(0, BK)
    wrows = (2 * c0 + tl.arange(0, 2 * BN)).to(tl.int64)
    xp = x + rows[:, None] * sxm + kk[None, :]
    wp = w + wrows[:, None] * K + kk[None, :]
    acc = tl.zeros([BM, 2 * BN], tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(xp + k0, mask=ok[:, None], other=0.0)
        b = tl.load(wp + k0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee" if IEEE else "tf32")
    gate, up = tl.split(tl.reshape(acc, [BM, BN, 2]))  # column 2c is gate c, 2c + 1 is up c
    y = tl.where(ok[:, None], gate / (1.0 + tl.exp(-gate)) * up, 0.0)
    tl.store(optr, y.to(out.dtype.element_ty), mask=(p < M)[:, None])


def interleave(gate, up):
    """[I, K] gate and up -> [2 I, K], row 2c = gate c, row 2c + 1 = up c."""
    return torch.stack([gate, up], 1).reshape(2 * gate.shape[0], gate.shape[1]).contiguous()


def run_lab(x, wi, lay, gs, cfg):
    BN, BK, nw, ns, gather = cfg
    M, K = x.shape
    out = torch.empty(M, wi.shape[0] // 2, device=x.device, dtype=x.dtype)
    NT = triton.cdiv(M, lay.block_m)
    G = wi.shape[0] // 2 // gs
    lab_gate_up[(G * NT, gs // BN)](x, wi, out, lay.counts, lay.perm, lay.work, M, K, NT, x.stride(0), out.stride(0),
                                    GS=gs, BM=lay.block_m, BN=BN, BK=BK, GATHER=gather,
                                    IEEE=x.dtype == torch.float32, num_warps=nw, num_stages=ns)
    return out


def problem(T, I, K, gs, skipped, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, K, device=DEV, dtype=dtype, generator=g)
    gate, up = (torch.randn(I, K, device=DEV, dtype=dtype, generator=g) / K ** 0.5 for _ in range(2))
    n = T * (I // gs)
    mask = (torch.randperm(n, device=DEV, generator=g) < round((1 - skipped) * n)).view(T, I // gs)
    return x, gate, up, mask


def check(T, I, K, gs, skipped, cfg, block_m):
    x, gate, up, mask = problem(T, I, K, gs, skipped, torch.float32 if INTERP else torch.bfloat16, seed=1)
    out = run_lab(x, interleave(gate, up), kernels_layout.layout(mask, block_m=block_m), gs, cfg)
    ref = kernels.gemm_mn_ref(x.float(), gate.float(), mask, gs, up.float())
    err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    assert err < (1e-5 if INTERP else 1e-2), (cfg, err)
    pruned = ~mask.repeat_interleave(gs, 1)
    assert (out[pruned] == 0).all(), "pruned outputs must be exactly zero"
    return err


CASES = [(2048, 0.25), (2048, 0.0), (4096, 0.5)]  # tokens, share of (token, group) pairs skipped
CONFIGS = [(128, 64, 8, 3, 1), (128, 64, 8, 4, 1), (64, 64, 8, 4, 1), (64, 64, 4, 4, 1), (128, 32, 8, 5, 1),
           (64, 128, 8, 3, 1), (128, 64, 8, 3, 0)]


def sweep():
    I, K, gs = 14336, 4096, 128  # Llama-3.1-8B's FFN, the engine's FFN groups
    rows = []
    for T, skipped in CASES:
        x, gate, up, mask = problem(T, I, K, gs, skipped, torch.bfloat16)
        wi, wgu = interleave(gate, up), torch.cat([gate, up])
        flops = 2 * T * 2 * I * K * (1 - skipped)  # the live products
        timed = [("cuBLAS, every token and channel", None, lambda: F.linear(x, wi)),
                 ("shipped (two products per step)", None, lambda: kernels.gemm_mn(
                     x, wgu[:I], kernels_layout.layout(mask), gs, w_up=wgu[I:]))]
        timed += [(f"lab {cfg}", cfg, lambda cfg=cfg: run_lab(x, wi, kernels_layout.layout(mask), gs, cfg))
                  for cfg in CONFIGS]
        def measure(cfg, fn):
            if cfg is not None and cfg[4]:  # (gather 0 computes the wrong rows on purpose)
                check(T, I, K, gs, skipped, cfg, kernels_base.CONFIGS["block_m"])
            us = bench_ms(False, fn) * 1e3
            return dict(us=us, tflops=flops / us / 1e6)
        rows += [lab_row(dict(tokens=T, skipped=skipped), name, lambda: measure(cfg, fn)) for name, cfg, fn in timed]
    return rows


def markdown(meta, rows):
    lines = [f"# Prefill gate+up lab on {meta['gpu']}", "", f"torch {meta['torch']}, triton {meta['triton']}, "
             f"{meta['date']}, `{meta['command']}`. Llama-3.1-8B's FFN (14336 channels in groups of 128, K 4096), "
             "bf16, random (token, group) masks; do_bench medians, L2 flushed, the layout included. TFLOP/s: the live "
             "products (cuBLAS: all of them) per second. Lab config: (BN, BK, num_warps, num_stages, gather).", "",
             "| tokens | skipped | kernel | us | TFLOP/s of live products |", "|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['skipped']:.0%} | {r['kernel']} | " + " | ".join(cells(r, ("us", ".1f"), (
        "tflops", ".0f"))) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def on_cpu():
    for skipped in (0.0, 0.5, 1.0):
        print(skipped, check(40, 64, 64, 32, skipped, (16, 32, 4, 2, 1), 16))


def main(argv=None):
    lab_main(argv, __doc__, "gate_up_lab", on_cpu, sweep, markdown)


if __name__ == "__main__":
    cli.run(main)
