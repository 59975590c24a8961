"""
A lab for the one-token decode GEMV: one weight [N, K] (bf16, or e4m3 codes with per-row scales), half of its
row groups live, y = w[live rows] . x, timed on CUDA-graph replay with enough weight copies rotated that L2 holds
none of them, against the shipped kernel (kernels.gemm_mn) on the same weights and mask.

    python -m research.gemv_lab                 # tiles: TMA (tensor descriptors) vs pointer loads, bf16 and fp8
    python -m research.gemv_lab --grid modes    # fp8, pointer loads: fp32 lane sums / f16 products / loads only
    python -m research.gemv_lab --grid words    # fp8: per-code work against loads of whole words
    TRITON_INTERPRET=1 python -m research.gemv_lab   # the kernels against their twin on the CPU, small sizes

The lab kernel walks a flat loop over (live chunk of BN rows, BK slice of K) steps, whole chunks per program,
with Triton's software pipeline keeping `stages` tiles in flight through shared memory, and sums products lane by
lane in a [BN, BK] accumulator reduced once per chunk. Config tuples: (BN, BK, stages, programs per SM,
num_warps, mode); mode 1 fp32 lane sums, 2 f16 products and lane sums (x scaled into [-1, 1] first), 3 loads
only (codes summed as integers, one add per code), 4 loads only (the codes' int32 words summed: one add per four
codes), 5 fp32 lane sums with each code made fp32 by integer ops (no conversion instruction). -> results/gemv_lab_<gpu>_<grid>.json
"""
import argparse
import datetime
import json
import math
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import cli
import kernels
from bench.common import graph_ms

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP else "cuda"


@triton.jit
def lab_gemv(x, w, s, out, lst, NLIVE, K, GS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr,
             STAGES: tl.constexpr, MODE: tl.constexpr, TMA: tl.constexpr):
    """out[live rows] = (w[live rows] . x) * s over a flat loop of (chunk of BN live rows, BK slice of K) steps,
    whole chunks per program, STAGES tiles in flight (Triton's software pipeline), [BN, BK] lane sums reduced once
    per chunk. TMA: w is a tensor descriptor (tiles by TMA), else a pointer (tiles by cp.async). MODE 1 fp32 lane
    sums, 2 f16 products and lane sums (x scaled into [-1, 1] first), 3 loads only (codes summed as integers), 4
    loads only (int32 words of four codes summed), 5 fp32 lane sums of codes made fp32 by integer ops."""
    pid, P = tl.program_id(0), tl.num_programs(0)
    KS = K // BK
    CPG: tl.constexpr = GS // BN
    C = NLIVE * CPG
    begin, end = pid * C // P * KS, (pid + 1) * C // P * KS
    kk = tl.arange(0, BK)
    nn = tl.arange(0, BN)
    if MODE == 2:
        kx = tl.arange(0, 4096)
        xm = tl.max(tl.abs(tl.load(x + kx, mask=kx < K, other=0.0).to(tl.float32)), 0)
        xs = tl.exp2(tl.ceil(tl.log2(tl.maximum(xm, 1e-30))))
        acc = tl.zeros([BN, BK], tl.float16)
    elif MODE == 3:
        xs = 1.0
        acc = tl.zeros([BN, BK], tl.int32)
    elif MODE >= 4:  # w: the codes as int32 words, four per word
        xs = 1.0
        acc = tl.zeros([BN, BK // 4], tl.int32 if MODE == 4 else tl.float32)
        kw = tl.arange(0, BK // 4)
    else:
        xs = 1.0
        acc = tl.zeros([BN, BK], tl.float32)
    for step in tl.range(begin, end, num_stages=STAGES):
        c = step // KS
        ks = step - c * KS
        g = tl.load(lst + c // CPG)
        row = g * GS + (c % CPG) * BN
        if TMA:
            wt = w.load([row, ks * BK])
        elif MODE >= 4:
            wt = tl.load(w + (row + nn)[:, None] * (K // 4) + ks * (BK // 4) + kw[None, :])
        else:
            wt = tl.load(w + (row + nn)[:, None] * K + ks * BK + kk[None, :])
        if MODE == 4:
            acc += wt
        elif MODE == 5:
            # code j of each word to fp32 by integer ops alone: its sign to bit 31, its exponent and mantissa
            # to bits 20-26 (the exponent lands in the fp32 exponent's low bits: the value times 2^-120, e4m3's
            # subnormals fp32 subnormals), so no conversion instruction; the 2^120 goes back on the sum
            for j in tl.static_range(4):
                xj = tl.load(x + ks * BK + 4 * kw + j).to(tl.float32)
                bits = ((wt << (24 - 8 * j)) >> 4) & -2014314496  # 0x87F00000 as int32
                acc += bits.to(tl.float32, bitcast=True) * xj[None, :]
        elif MODE == 3:
            acc += wt.to(tl.int8, bitcast=True).to(tl.int32)
        elif MODE == 2:
            xv = (tl.load(x + ks * BK + kk).to(tl.float32) / xs).to(tl.float16)
            acc += wt.to(tl.float16) * xv[None, :]
        else:
            xv = tl.load(x + ks * BK + kk).to(tl.float32)
            acc += wt.to(tl.float32) * xv[None, :]
        if ks == KS - 1:
            r = tl.sum(acc.to(tl.float32), 1) * xs
            if MODE == 5:
                r = r * 1.329227995784916e36  # 2^120
            rows = row + nn
            if FP8:
                r = r * tl.load(s + rows)
            tl.store(out + rows, r.to(out.dtype.element_ty))
            acc = tl.zeros_like(acc)


def nsm():
    return 4 if INTERP else torch.cuda.get_device_properties(0).multi_processor_count


def run_lab(kind, x, w, s, out, lst, nlive, gs, cfg):
    BN, BK, ST, pps, nw, mode = cfg
    tma = kind == "tma"
    wd = TensorDescriptor.from_tensor(w, [BN, BK]) if tma else (w.view(torch.int32) if mode >= 4 else w)
    return lambda: lab_gemv[(pps * nsm(),)](x, wd, s, out, lst, nlive, w.shape[1], GS=gs, BN=BN, BK=BK,
                                            FP8=w.dtype == torch.float8_e4m3fn, STAGES=ST, MODE=int(mode), TMA=tma,
                                            num_warps=nw)


def problem(N, K, gs, fp8, copies, seed=0):
    torch.manual_seed(seed)
    ws, ss = [], []
    for _ in range(copies):
        w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16) / math.sqrt(K)
        if fp8:
            q, sc = kernels.quantize_fp8(w)
            ws.append(q), ss.append(sc.float().contiguous())
        else:
            ws.append(w), ss.append(torch.ones(N, device=DEV))
    x = torch.randn(1, K, device=DEV, dtype=torch.bfloat16)
    G = N // gs
    mask = torch.zeros(1, G, dtype=torch.bool, device=DEV)
    mask[0, torch.randperm(G, device=DEV)[:G // 2]] = True
    lst = mask[0].nonzero().flatten().to(torch.int32)
    return x, ws, ss, mask, lst


def ref(x, w, s, mask, gs):
    wf = w.float() * (s[:, None] if w.dtype == torch.float8_e4m3fn else 1)
    y = x.float() @ wf.t()
    return y * mask.repeat_interleave(gs, 1)


def check(kind, N, K, gs, fp8, cfg):
    x, ws, ss, mask, lst = problem(N, K, gs, fp8, 1, seed=1)
    out = torch.zeros(1, N, device=DEV, dtype=torch.float32)
    run_lab(kind, x, ws[0], ss[0], out, lst, lst.numel(), gs, cfg)()
    r = ref(x, ws[0], ss[0], mask, gs)
    err = ((out - r).abs().max() / r.abs().max()).item()
    if cfg[5] not in (3, 4):
        assert err < (3e-3 if cfg[5] == 2 else 1e-3), (kind, cfg, err)
    return err


SHAPES = {  # name: N, K, group size (rows of one group): one weight as gate+up's and Q, K, V's
    "gate+up": (28672, 4096, 128),
    "qkv": (6144, 4096, 512),
}


def grid_of(name, fp8):
    """(kinds, configs) of one sweep: 'tiles' (TMA and pointer loads, fp32 lane sums) or 'modes' (fp8, pointer
    loads, the three lane-sum modes)."""
    if name == "modes":
        return ("ptr",), [(bn, bk, 4, pps, nw, mode) for mode in (1, 2, 3) for bn in (16, 32, 64) for bk in (256, 512)
                          for pps in (1, 2, 4) for nw in (4, 8) if bn * bk <= 16384]
    if name == "words":
        return ("ptr",), [(bn, bk, 4, pps, 4, mode) for mode in (1, 3, 4, 5) for bn in (16, 32) for bk in (512, 1024)
                          for pps in (1, 2) if bn * bk <= 32768]
    bks = (256,) if fp8 else (128, 256)
    return ("tma", "ptr"), [(bn, bk, st, pps, 4, 1) for bn in (8, 16, 32) for bk in bks for st in (4, 8)
                            for pps in (1, 2)]


def sweep(grid):
    rows = []
    for name, (N, K, gs) in SHAPES.items():
        for fp8 in ((True,) if grid in ("modes", "words") else (True, False)):
            copies = max(2, math.ceil(2 * 60e6 / (N * K * (1 if fp8 else 2) / 2)) + 1)
            x, ws, ss, mask, lst = problem(N, K, gs, fp8, copies)
            live_bytes = lst.numel() * gs * K * (1 if fp8 else 2)
            outs = [torch.zeros(1, N, device=DEV, dtype=torch.bfloat16) for _ in ws]
            fns = [lambda i=i: kernels.gemm_mn(x, ws[i], mask, gs, w_scale=ss[i] if fp8 else None)
                   for i in range(copies)]
            t = graph_ms(False, fns) * 1e3
            rows.append(dict(shape=name, fp8=fp8, kind="shipped", cfg=None, us=t, tbs=live_bytes / t / 1e6))
            kinds, cfgs = grid_of(grid, fp8)
            for kind in kinds:
                for cfg in cfgs:
                    if kind == "ptr" and cfg[2] != 4:
                        continue
                    try:
                        check(kind, N, K, gs, fp8, cfg)
                        fns = [run_lab(kind, x, ws[i], ss[i], outs[i], lst, lst.numel(), gs, cfg)
                               for i in range(copies)]
                        t = graph_ms(False, fns) * 1e3
                        row = dict(shape=name, fp8=fp8, kind=kind, cfg=cfg, us=t, tbs=live_bytes / t / 1e6)
                    except Exception as e:  # noqa: BLE001  (a tile that does not fit: the next may)
                        row = dict(shape=name, fp8=fp8, kind=kind, cfg=cfg, err=str(e)[:200])
                    print(row, flush=True)
                    rows.append(row)
            del ws
            torch.cuda.empty_cache()
    return rows


def markdown(meta, rows):
    """The three fastest of each (shape, format, kernel and mode), against the shipped kernel."""
    lines = [f"# One-token GEMV lab on {meta['gpu']}", "", f"torch {meta['torch']}, triton {meta['triton']}, "
             f"{meta['date']}, `{meta['command']}`. One weight, half its row groups live; live bytes / time. "
             "Config: (BN, BK, stages, programs per SM, num_warps, mode); mode 1 fp32 lane sums, 2 f16 products, "
             "3 loads only" + (", 4 loads only by words, 5 integer-op conversion" if "words" in meta["command"] else "")
             + ". " + meta.get("note", ""), "",
             "| shape | weights | kernel | config | us | live TB/s |", "|---|---|---|---|---|---|"]
    for name in SHAPES:
        for fp8 in (True, False):
            mine = [r for r in rows if r["shape"] == name and r["fp8"] == fp8 and "us" in r]
            labels = sorted({r["kind"] + ("" if r["cfg"] is None else f" mode {int(r['cfg'][5])}") for r in mine})
            for label in sorted(labels, key=lambda v: v != "shipped"):
                best = sorted([r for r in mine if r["kind"] + ("" if r["cfg"] is None else
                                                               f" mode {int(r['cfg'][5])}") == label],
                              key=lambda r: r["us"])[:3]
                for r in best:
                    lines.append(f"| {name} | {'fp8' if fp8 else 'bf16'} | {label} | "
                                 f"{'' if r['cfg'] is None else tuple(r['cfg'])} | {r['us']:.1f} | {r['tbs']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", choices=("tiles", "modes", "words"), default="tiles")
    args = p.parse_args(argv)
    if not INTERP and not torch.cuda.is_available():
        raise cli.UserError("research.gemv_lab times kernels on a CUDA GPU; on a CPU run it with TRITON_INTERPRET=1 "
                            "(the kernels against their twin, no timing)")
    if INTERP:  # the kernels against their twin, every mode, both weight formats
        for kind in ("tma", "ptr"):
            for fp8 in (False, True):
                for mode in ((1,) if kind == "tma" else (1, 2, 5) if fp8 else (1, 2)):
                    err = check(kind, 512, 512, 128, fp8, (16, 128, 2, 1, 4, mode))
                    print(kind, "fp8" if fp8 else "bf16", mode, err)
        return
    rows = sweep(args.grid)
    gpu = torch.cuda.get_device_name()
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python -m research.gemv_lab" + (f" --grid {args.grid}" if args.grid != "tiles" else ""))
    out = f"results/gemv_lab_{'h200' if 'H200' in gpu else 'h100'}_{args.grid}"
    json.dump(dict(meta=meta, rows=rows), open(out + ".json", "w"), indent=1)
    open(out + ".md", "w").write(markdown(meta, rows))
    print(markdown(meta, rows))


if __name__ == "__main__":
    cli.run(main)
