"""
The block-size sweep behind kernels_base.CONFIGS: every variant of a kernel's sizes checked (every group
live and 50% skipped) and timed as bench/ops.py times that op (decode-sized ops on CUDA-graph replay).

    python -m bench.tune              # every CONFIGS key below -> results/kernels_h200_tune.{json,md}
    python -m bench.tune --only fp8   # only the keys whose name contains "fp8"
    python -m bench.tune --only fp8,gemm_k_small   # ... "fp8" or "gemm_k_small"
    python -m bench.tune --only gemv_mn_1 --having PIPE   # ... and of their variants only those with PIPE
    python -m bench.tune --only gemv_mn_1,gemm_k_small --having PIPE,FMA   # ... any of the names
    TRITON_INTERPRET=1 python -m bench.tune --smoke   # each key's first and last variant on the CPU (CI)

The variants are passed to the ops as config= (CONFIGS itself is never rewritten); a key's first row is
its current setting. fp8 keys time the same op on e4m3 weights (kernels.quantize_fp8); their dense
column is stock fp8 (the input quantized per token, then torch._scaled_mm), so their speedup is against that.
"""
import functools

import cli
import kernels_base
from bench.cases import (case_decode_attention, case_gate_up, case_k, case_norm_route, case_prefill_attention, case_q,
                         check, command_line, rand_mask)
from bench.common import bench_ms, graph_ms, meta, save


# CONFIGS key -> (case, block-size variants). Each variant goes to the op as config= (and block_m to the
# layout); kernels_base.CONFIGS itself is never changed, and its current entry is always timed first. Copy a
# winner into CONFIGS by hand.
def tune_table(s):
    M, FFN = s.prefill_m, s.FFN
    v = lambda warps, stages, **sizes: dict(sizes, num_warps=warps, num_stages=stages)
    # gemm_k at one token as a one-row FMA tile (config FMA; BM then applies from 2 tokens on)
    # (PIPE: the K loop pipelined through shared memory, which a loop without tl.dot is not unless asked)
    fma = [v(4, 3, BM=16, BN=16, BK=128, SPLIT=4, FMA=True), v(4, 3, BM=16, BN=8, BK=128, SPLIT=8, FMA=True),
           v(8, 3, BM=16, BN=32, BK=128, SPLIT=4, FMA=True),
           *[v(4, 4, BM=16, BN=bn, BK=bk, SPLIT=split, FMA=True, PIPE=4)
             for bn, bk, split in ((16, 128, 4), (32, 128, 8), (64, 128, 8), (32, 256, 4), (16, 512, 8))]]
    # One token on the 16-row tensor-core tile (config DOT): the codes as f16, the products on tensor cores
    dot = [v(4, 1, BN=16, BK=256, programs_per_sm=2, DOT=True), v(4, 1, BN=32, BK=256, programs_per_sm=2, DOT=True),
           v(4, 1, BN=16, BK=512, programs_per_sm=2, DOT=True), v(4, 1, BN=64, BK=128, programs_per_sm=2, DOT=True),
           v(8, 1, BN=32, BK=512, programs_per_sm=1, DOT=True), v(4, 1, BN=16, BK=256, programs_per_sm=4, DOT=True),
           v(4, 3, BN=32, BK=256, programs_per_sm=2, DOT=True), v(8, 1, BN=64, BK=256, programs_per_sm=1, DOT=True)]
    # One token with config PIPE: [BN, BK] lane sums, PIPE tiles in flight through shared memory
    pipe = lambda warps, stages, bn, bk, per_sm: v(warps, stages, BN=bn, BK=bk, programs_per_sm=per_sm, PIPE=stages)
    pipe_fused = [pipe(4, 4, 16, 256, 2), pipe(4, 4, 32, 256, 1), pipe(4, 4, 32, 256, 2), pipe(4, 4, 16, 512, 2),
                  pipe(4, 4, 8, 512, 4)]
    pipe_one = [pipe(4, 4, 16, 512, 2), pipe(4, 4, 32, 512, 1), pipe(4, 4, 16, 256, 2), pipe(4, 4, 8, 512, 4),
                pipe(4, 4, 32, 256, 2)]
    # decode attention: block sizes, warps, programs per SM and the most chunks per pair; 64-key blocks at 4 warps
    # (programs_per_sm only moves steps with more keys than programs_per_sm x SMs x BN: batch 1 sits at BN-key
    # chunks or max_chunks per pair, while a big batch's live pairs get chunks of about all keys / that many items)
    attn = [v(8, 2, BN=128, programs_per_sm=8), v(8, 2, BN=128, max_chunks=16), v(8, 3, BN=128, programs_per_sm=2),
            v(4, 3, BN=128, programs_per_sm=4), v(4, 2, BN=64, programs_per_sm=4, max_chunks=16),
            v(8, 2, BN=128, programs_per_sm=1), v(8, 2, BN=128, programs_per_sm=2), v(4, 2, BN=128, programs_per_sm=1),
            v(4, 2, BN=128, programs_per_sm=2), v(4, 3, BN=64, programs_per_sm=1), v(4, 3, BN=64, programs_per_sm=2)]
    # PREFETCH: the current config with the first live slice's weights loaded before the PDL wait
    pre = lambda key: dict(kernels_base.CONFIGS[key], PREFETCH=True)
    return {
        "gemm_mn_fused": (lambda: case_gate_up(s, M), [v(8, 2, block_m=128, BN=128, BK=128),
                                                       v(8, 4, block_m=256, BN=64, BK=64)]),
        "gemv_mn_1_fused": (lambda: case_gate_up(s, 1), [v(4, 1, BN=4, BK=1024, programs_per_sm=7),
                                                         v(4, 1, BN=4, BK=1024, programs_per_sm=3),
                                                         v(4, 1, BN=4, BK=2048, programs_per_sm=2),
                                                         v(4, 1, BN=2, BK=2048, programs_per_sm=8),
                                                         v(4, 1, BN=8, BK=1024, programs_per_sm=4), *pipe_fused]),
        "gemm_k": (lambda: case_k(s, M, FFN, s.ffn_gs, "down"), [v(8, 4, BM=128, BN=128, BK=64)]),
        "gemv_mn_1": (lambda: case_q(s, 1, True), [v(4, 1, BN=4, BK=1024, programs_per_sm=4),
                                                   v(4, 1, BN=4, BK=2048, programs_per_sm=2),
                                                   v(4, 1, BN=2, BK=2048, programs_per_sm=4),
                                                   v(4, 1, BN=8, BK=1024, programs_per_sm=2), *pipe_one]),
        "gemm_k_small_long_k": (lambda: case_k(s, 1, FFN, s.ffn_gs, "down"), [
            v(4, 6, BM=16, BN=64, BK=128, SPLIT=8), v(4, 4, BM=16, BN=128, BK=128, SPLIT=8),
            v(4, 6, BM=16, BN=64, BK=64, SPLIT=8), v(4, 6, BM=16, BN=128, BK=128, SPLIT=4), *fma,
            pre("gemm_k_small_long_k")]),
        "gemm_k_small": (lambda: case_k(s, 1, s.H * s.HD, s.attn_gs, "o_proj"), [
            v(4, 6, BM=16, BN=32, BK=128), v(4, 6, BM=16, BN=32, BK=128, SPLIT=2),
            v(4, 6, BM=16, BN=64, BK=128, SPLIT=8), v(4, 6, BM=16, BN=32, BK=128, SPLIT=8), *fma,
            pre("gemm_k_small")]),
        # fp8 codes: the one-token GEMVs want longer K slices; gemm_k's FMA rows skip the bf16 conversion
        # a 16-row tl.dot makes of every code (kernels._gemm_k_block).
        "gemv_mn_1_fused_fp8": (lambda: case_gate_up(s, 1, fp8=True), [
            v(4, 1, BN=8, BK=1024, programs_per_sm=2), v(4, 1, BN=2, BK=4096, programs_per_sm=2),
            v(4, 1, BN=4, BK=2048, programs_per_sm=4), v(4, 1, BN=16, BK=1024, programs_per_sm=2),
            v(8, 1, BN=8, BK=2048, programs_per_sm=2), v(4, 1, BN=8, BK=1024, programs_per_sm=3),
            v(8, 1, BN=16, BK=1024, programs_per_sm=2), v(4, 1, BN=8, BK=512, programs_per_sm=4), *dot, *pipe_fused]),
        "gemv_mn_1_fp8": (lambda: case_q(s, 1, True, fp8=True), [
            v(8, 1, BN=8, BK=2048, programs_per_sm=2), v(4, 1, BN=4, BK=1024, programs_per_sm=4),
            v(4, 1, BN=16, BK=1024, programs_per_sm=2), v(4, 1, BN=8, BK=1024, programs_per_sm=3), *dot, *pipe_one]),
        # F16 (gemm_k's tensor-core tile on fp8 codes): 0 codes -> bf16, 1 codes -> f16 -> bf16 (the default),
        # 2 codes and activations as f16
        "gemm_k_small_long_k_fp8": (lambda: case_k(s, 1, FFN, s.ffn_gs, "down", fp8=True), [
            v(4, 6, BM=16, BN=128, BK=128, SPLIT=8, F16=0), v(4, 6, BM=16, BN=128, BK=128, SPLIT=8, F16=2),
            v(4, 6, BM=16, BN=64, BK=128, SPLIT=4), v(4, 6, BM=16, BN=64, BK=128, SPLIT=4, F16=2),
            v(4, 6, BM=16, BN=64, BK=128, SPLIT=8), v(4, 4, BM=16, BN=128, BK=128, SPLIT=16, F16=2),
            v(4, 4, BM=16, BN=256, BK=128, SPLIT=16, F16=2), v(8, 4, BM=16, BN=256, BK=128, SPLIT=8, F16=2),
            pre("gemm_k_small_long_k_fp8"), *fma]),
        "gemm_k_small_fp8": (lambda: case_k(s, 1, s.H * s.HD, s.attn_gs, "o_proj", fp8=True), [
            v(4, 6, BM=16, BN=32, BK=128, SPLIT=2), v(4, 6, BM=16, BN=32, BK=128, SPLIT=4, F16=0),
            v(4, 6, BM=16, BN=32, BK=128, SPLIT=4, F16=2), v(4, 6, BM=16, BN=64, BK=128, SPLIT=4),
            v(4, 4, BM=16, BN=64, BK=256, SPLIT=8, F16=2), v(4, 4, BM=16, BN=32, BK=256, SPLIT=8, F16=2),
            v(4, 6, BM=16, BN=16, BK=128, SPLIT=8, F16=2), pre("gemm_k_small_fp8"), *fma]),
        "attn_prefill": (lambda: case_prefill_attention(s), [v(8, 2, BM=128, BN=128)]),
        # a prefill chunk's norm + router: the D-split pair's tiles, slices and warps (first half; FINISH_BK and
        # finish_warps the second's) and dot precision, and the split kernel in tiles of 16 instead
        **{f"norm_route_parts {T}": (lambda T=T: case_norm_route(s, T, s.FFN // s.ffn_gs), [
            v(2, 3, BT=16, BK=32, DS=128, FINISH_BK=128, finish_warps=4, PREC="tf32x3"),
            v(2, 3, BT=16, BK=32, DS=256, FINISH_BK=128, finish_warps=4, PREC="tf32x3"),
            v(2, 3, BT=16, BK=32, DS=512, FINISH_BK=256, finish_warps=4, PREC="tf32x3"),
            # one load per program (BK = DS): no serial loop over the slice (wider slices spill registers)
            v(4, 1, BT=16, BK=128, DS=128, FINISH_BK=128, finish_warps=4, PREC="tf32x3"),
            v(4, 1, BT=16, BK=256, DS=256, FINISH_BK=256, finish_warps=4, PREC="tf32x3"),
            v(2, 3, BT=32, BK=32, DS=256, FINISH_BK=256, finish_warps=4, PREC="tf32x3"),
            v(4, 3, BT=64, BK=32, DS=512, FINISH_BK=256, finish_warps=8, PREC="tf32x3"),
            dict(SPLIT_TILE=16)])
            for T in ((20,) if s.smoke else (100, 256, 512, 1024, 2048))},
        "attn_decode": (lambda: case_decode_attention(s), attn),
        # batch 1, a 1k cache: a few items per live KV head, so latency (the merge's round trips), not bytes
        "attn_decode 1x1024": (lambda: case_decode_attention(s, 1, 64 if s.smoke else 1024), attn),
        # serving's saturated decode: batch 32, 8k, at the 75/25 profile's share of heads (a third item: the share
        # of groups skipped where it is not 50%)
        "attn_decode 32x8192 75%": (lambda: case_decode_attention(s, 2 if s.smoke else 32, 64 if s.smoke else 8192),
                                    attn, 0.75),
    }


def run_tune(s, args, argv):
    """Every variant checked (all groups on and 50% skipped) and timed as the kernel table times it."""
    results = {}
    for key, (factory, variants, *skip) in tune_table(s).items():
        if args.only and not any(w in key for w in args.only):
            continue
        case = factory()
        half, full = rand_mask(s, case.mask_shape, skip[0] if skip else 0.5), rand_mask(s, case.mask_shape, 0.0)
        # Decode-sized ops, and a prefill chunk's norm + router (microseconds, launched from the chunk's CUDA
        # graph as served), on graph replay: 16 calls in one graph for an op on one copy of its data
        graphed = case.decode or key.startswith("norm_route")
        repeat = 1 if case.copies > 1 else 16
        time_it = ((lambda mask, cfg: graph_ms(s.smoke, [functools.partial(case.sparse, mask, i % case.copies, cfg)
                                                         for i in range(case.copies * repeat)]))
                   if graphed else
                   (lambda mask, cfg: bench_ms(s.smoke, functools.partial(case.sparse, mask, 0, cfg))))
        dense_fns = case.dense[case.baseline[0]]
        dense_ms = graph_ms(s.smoke, dense_fns * repeat) if graphed else bench_ms(s.smoke, dense_fns[0])
        print(f"{key} ({case.op}, {case.tokens} tokens): dense {dense_ms * 1e3:.1f} us, "
              f"current {kernels_base.CONFIGS[key.split()[0]]}", flush=True)
        # the case's other baselines too (a norm + router against the dense model's plain norm)
        others = {name: graph_ms(s.smoke, fns * repeat) if graphed else bench_ms(s.smoke, fns[0])
                  for name, fns in case.dense.items() if name != case.baseline[0]}
        results[key] = dict(op=case.op, tokens=case.tokens, timing="cuda_graph" if graphed else "do_bench",
                            dense_ms=dense_ms, baseline=case.baseline[0], others_ms=others,
                            current=kernels_base.CONFIGS[key.split()[0]], variants=[])
        current = kernels_base.CONFIGS[key.split()[0]]
        todo = [dict(current)] + [v for v in variants if v != current and
                                  (not args.having or any(name in v for name in args.having))]
        for v in todo[:1] + todo[-1:] if s.smoke else todo:  # --smoke: the code path (first, last), not the width
            try:
                checks = [check(case, full, v), check(case, half, v)]
                ms, all_ms = time_it(half, v), time_it(full, v)
                results[key]["variants"].append(dict(config=v, ms=ms, speedup=dense_ms / ms, all_active_ms=all_ms,
                                                     rel_err=max(c["rel_err"] for c in checks)))
                print(f"  {v}: {ms * 1e3:.1f} us ({dense_ms / ms:.2f}x), all groups on {all_ms * 1e3:.1f} us",
                      flush=True)
            except Exception as e:  # e.g. out of shared memory: the next variant may fit
                results[key]["variants"].append(dict(config=v, failed=f"{type(e).__name__}: {str(e)[:200]}"))
                print(f"  {v}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        del case
    m = meta(s.smoke, "-m bench.tune", argv, l2_MB=s.l2_bytes / 2 ** 20)
    lines = [f"# Block-size sweep on {m['gpu']}", "", f"torch {m['torch']}, triton {m['triton']}, {m['date']}, "
             f"`{m['command']}`. 50% of groups skipped (or the share a key names); decode-sized ops timed on "
             "CUDA-graph replay.", "",
             "| CONFIGS key | op | tokens | config | us | speedup | all groups on, us |", "|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        base = ", ".join(f"{name} {ms * 1e3:.1f} us" for name, ms in {r["baseline"]: r["dense_ms"], **r["others_ms"]}.items())
        lines.append(f"| {key} | {r['op']} | {r['tokens']} | baselines: {base} | | | |")
        for v in r["variants"]:
            cells = ("failed", "", "") if "failed" in v else (f"{v['ms'] * 1e3:.1f}", f"{v['speedup']:.2f}x",
                                                               f"{v['all_active_ms'] * 1e3:.1f}")
            lines.append(f"| {key} | {r['op']} | {r['tokens']} | `{v['config']}` | " + " | ".join(cells) + " |")
    save(args.out, dict(meta=m, results=results), "\n".join(lines) + "\n")
    print("\n".join(lines) + f"\n\nwritten: {args.out}.json, {args.out}.md")
    return results


def main(argv=None):
    args, argv, s = command_line(__doc__, "-m bench.tune", "kernels_h200_tune", "CONFIGS keys", argv, having=True)
    return run_tune(s, args, argv)


if __name__ == "__main__":
    cli.run(main)
