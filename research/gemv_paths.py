"""
Where WIDE's one-token gate+up loses to its bytes: the shipped GEMV (kernels.gemm_mn) at equal bytes through its
mask path and through its dense tail (the dense model's path: no mask, no list), and with the mask made in the
GEMV from the router's first Linear (the WIDE step's path) or given.

    python -m research.gemv_paths                        # Llama-3.1-8B's gate+up, bf16 -> results/gemv_paths_<gpu>
    TRITON_INTERPRET=1 python -m research.gemv_paths --smoke   # every path against its twin on the CPU

In the decode step WIDE's gate+up streams its live bytes slower than dense's gate+up streams all of them
(results/decode_profile_*.md). Each row is CUDA-graph replay over rotated weight copies (L2 holds none between
two uses of a copy), us per call. Read it as: dense tail at half the rows against mask at half the groups = what
the mask path costs at equal bytes; random against contiguous groups = the access pattern; made against given =
the router's rule in the GEMV's prologue; half against all = how the time scales with the bytes.
"""
import math
import sys

import torch

import cli
import kernels
import kernels_step
import wide
from bench.common import graph_ms, meta, parser, prepare, save

SCRIPT = "-m research.gemv_paths"


def paths(D, I, GS, dev):
    """(name, live groups, fn(w), twin(w)) of each path; w = [gate; up] rows, [2I, D]."""
    G = I // GS
    x = torch.randn(1, D, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    none = torch.zeros(1, 0, dtype=torch.bool, device=dev)
    gen = torch.Generator().manual_seed(0)

    def groups(live):
        m = torch.zeros(1, G, dtype=torch.bool)
        m[0, live] = True
        return m.to(dev)

    def masked(m):
        return (lambda w: kernels.gemm_mn(x, w[:I], m, GS, w_up=w[I:]),
                lambda w: kernels.gemm_mn_ref(x, w[:I], m, GS, w_up=w[I:]))

    def tail(rows):
        return (lambda w: kernels.gemm_mn(x, w[:rows], none, GS, w_up=w[I:I + rows], dense_tail=rows),
                lambda w: kernels.gemm_mn_ref(x, w[:rows], none, GS, w_up=w[I:I + rows], dense_tail=rows))

    # A wide.Router (about half its groups run for h): the GEMV makes the mask from its first Linear's z, as the
    # WIDE step does after norm_route_deferred; the twin takes the router's own rule
    torch.manual_seed(0)
    router = wide.Router(D, G, 32).to(dev).eval()
    h = torch.randn(1, D, device=dev)
    with torch.no_grad():
        z = router.down(h)
    keep = torch.zeros(1, 1, G, dtype=torch.bool, device=dev)
    keepf, live = torch.zeros(1, 1, G, device=dev), torch.zeros(1 + G, dtype=torch.int32, device=dev)
    dec = kernels_step.Decision(keep, keepf, live, z, router.up.weight.detach(), router.up.bias.detach())
    rule = kernels_step.route_ref(router, h)[0]  # [1, G]
    n = int(rule.sum())
    half = G // 2
    return [("dense tail, every row", G) + tail(I),
            ("dense tail, half the rows", half) + tail(half * GS),
            ("mask, every group", G) + masked(groups(torch.arange(G))),
            ("mask, half the groups, contiguous", half) + masked(groups(torch.arange(half))),
            ("mask, half the groups at random", half) + masked(groups(torch.randperm(G, generator=gen)[:half])),
            (f"mask made in the GEMV from z ({n} groups)", n,
             lambda w: kernels.gemm_mn(x, w[:I], keep.view(1, G), GS, w_up=w[I:], decision=dec),
             lambda w: kernels.gemm_mn_ref(x, w[:I], rule, GS, w_up=w[I:])),
            (f"the same mask, given ({n} groups)", n) + masked(rule.clone())]


def run(args, argv):
    D, I, GS = (64, 256, 16) if args.smoke else (4096, 14336, 128)
    dev = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    full = 2 * I * D * torch.finfo(dtype).bits // 8
    copies = 1 if args.smoke else 1 + math.ceil(3 * 60e6 / full)  # L2 (60 MB at most) holds none between two uses
    ws = [(torch.randn(2 * I, D, device=dev) / math.sqrt(D)).to(dtype) for _ in range(copies)]
    rows = []
    for name, live, fn, twin in paths(D, I, GS, dev):
        out, ref = fn(ws[0]).float(), twin(ws[0]).float()
        err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        if not err <= 1e-2:  # a wrong kernel is not timed
            cli.fail(f"correctness check failed, nothing timed past it: {name}: relative error {err:.2e} against "
                     "its twin")
        us = graph_ms(args.smoke, [lambda w=w, fn=fn: fn(w) for w in ws]) * 1e3
        mb = full * live / (I // GS) / 1e6
        rows.append(dict(path=name, live_groups=live, MB=mb, us=us, GBps=mb / us * 1e3, rel_err=err))
        print(f"{name:45s} {us:8.2f} us {mb:7.1f} MB {mb / us * 1e3:6.0f} GB/s", flush=True)
    m = meta(args.smoke, SCRIPT, argv, shape=dict(D=D, I=I, group_size=GS), copies=copies)
    save(args.out, dict(meta=m, rows=rows), markdown(m, rows))
    print(f"written: {args.out}.json, {args.out}.md")
    return rows


def markdown(m, rows):
    s = m["shape"]
    lines = [f"# The one-token gate+up GEMV by path on {m['gpu']}", "",
             f"torch {m['torch']}, triton {m['triton']}, {m['date']}, `{m['command']}`. gate and up [{s['I']}, "
             f"{s['D']}] each, groups of {s['group_size']} rows, one token; CUDA-graph replay over {m['copies']} "
             "weight copies; MB = the live rows' bytes.", "",
             "| path | live groups | MB | us | GB/s |", "|---|---|---|---|---|"]
    lines += [f"| {r['path']} | {r['live_groups']} | {r['MB']:.1f} | {r['us']:.2f} | {r['GBps']:.0f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser(__doc__, SCRIPT, "gemv_paths_<gpu>").parse_args(argv)
    gpu = "h200" if not args.smoke and torch.cuda.is_available() and "H200" in torch.cuda.get_device_name() else "h100"
    prepare(args, SCRIPT, argv, f"gemv_paths_{gpu}")
    return run(args, argv)


if __name__ == "__main__":
    cli.run(main)
