"""
The block-size sweep behind kernels_base.CONFIGS: every variant of a kernel's sizes checked (every group
live and 50% skipped) and timed as bench/ops.py times that op (decode-sized ops on CUDA-graph replay).

    python -m bench.tune              # every CONFIGS key below -> results/kernels_h200_tune.{json,md}
    python -m bench.tune --only fp8   # only the keys whose name contains "fp8"
    python -m bench.tune --only fp8,gemm_k_small   # ... "fp8" or "gemm_k_small"
    python -m bench.tune --only gemv_mn_1 --having PIPE   # ... and of their variants only those with PIPE
    python -m bench.tune --only gemv_mn_1,gemm_k_small --having PIPE,FMA   # ... any of the names
    python -m bench.tune --only gemm_k_small_1 --in-step --out results/kernels_h100_tune_o1_all   # judged in the step
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
    # ... and without the split (no partials, no ticket), or a smaller one: a program per few output rows
    fma1 = [v(4, 4, BM=16, BN=bn, BK=bk, SPLIT=1, FMA=True, PIPE=4) for bn, bk in ((4, 512), (8, 256), (8, 512), (16, 256))]
    fma1 += [v(4, 4, BM=16, BN=4, BK=1024, SPLIT=1, FMA=True, PIPE=4), v(4, 4, BM=16, BN=8, BK=512, SPLIT=2, FMA=True, PIPE=4)]
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
    # EARLY_NEXT: the current config letting the next kernel (a norm, which loads router weights before its wait)
    # launch once gemm_k's programs have passed their PDL wait (judge it --in-step: a single op has no next kernel)
    early = lambda key: dict(kernels_base.CONFIGS[key], EARLY_NEXT=True)
    # prefill gate+up: block_m tokens x BN channels of gate and of up per program (two accumulators; PAIRED: one
    # product over both, research/gate_up_lab.py). Weight tiles by TMA and a warp-specialized K loop did no better
    # (kernels_h100_tune_gu2, git 8f52495)
    paired = [v(8, 4, block_m=128, BN=128, BK=64, PAIRED=True), v(8, 3, block_m=128, BN=128, BK=64, PAIRED=True),
              v(8, 5, block_m=128, BN=128, BK=32, PAIRED=True), v(8, 4, block_m=128, BN=64, BK=64, PAIRED=True)]
    prefill_gu = [v(8, 3, block_m=128, BN=128, BK=64), v(8, 5, block_m=128, BN=128, BK=32),
                  v(8, 4, block_m=128, BN=64, BK=64), v(8, 6, block_m=128, BN=64, BK=64),
                  v(4, 4, block_m=128, BN=64, BK=64), v(4, 4, block_m=64, BN=128, BK=64),
                  v(8, 4, block_m=64, BN=128, BK=64), v(4, 6, block_m=64, BN=128, BK=64),
                  v(8, 3, block_m=256, BN=64, BK=64), v(8, 4, block_m=256, BN=64, BK=64),
                  v(8, 2, block_m=128, BN=128, BK=128), v(4, 4, block_m=64, BN=64, BK=128), *paired]
    return {
        "gemm_mn_fused": (lambda: case_gate_up(s, M), prefill_gu),
        # a served 2048-token chunk at the 75/25 profile's FFN share
        "gemm_mn_fused 2048 25%": (lambda: case_gate_up(s, 64 if s.smoke else 2048), prefill_gu, 0.25),
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
            v(4, 6, BM=16, BN=64, BK=64, SPLIT=8), v(4, 6, BM=16, BN=128, BK=128, SPLIT=4), *fma, *fma1,
            early("gemm_k_small_long_k"), pre("gemm_k_small_long_k")]),
        "gemm_k_small_1": (lambda: case_k(s, 1, s.H * s.HD, s.attn_gs, "o_proj"), [
            v(4, 6, BM=16, BN=64, BK=128, SPLIT=4), v(4, 6, BM=16, BN=32, BK=128, SPLIT=2),
            v(4, 6, BM=16, BN=64, BK=128, SPLIT=8), v(4, 6, BM=16, BN=32, BK=128, SPLIT=8), *fma, *fma1,
            early("gemm_k_small_1"), pre("gemm_k_small_1")]),
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
            early("gemm_k_small_long_k_fp8"), pre("gemm_k_small_long_k_fp8"), *fma, *fma1]),
        "gemm_k_small_1_fp8": (lambda: case_k(s, 1, s.H * s.HD, s.attn_gs, "o_proj", fp8=True), [
            v(4, 6, BM=16, BN=32, BK=128, SPLIT=4), *fma1,
            v(4, 6, BM=16, BN=32, BK=128, SPLIT=2), v(4, 6, BM=16, BN=32, BK=128, SPLIT=4, F16=0),
            v(4, 6, BM=16, BN=32, BK=128, SPLIT=4, F16=2), v(4, 6, BM=16, BN=64, BK=128, SPLIT=4),
            v(4, 4, BM=16, BN=64, BK=256, SPLIT=8, F16=2), v(4, 4, BM=16, BN=32, BK=256, SPLIT=8, F16=2),
            v(4, 6, BM=16, BN=16, BK=128, SPLIT=8, F16=2), early("gemm_k_small_1_fp8"), pre("gemm_k_small_1_fp8"), *fma]),
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
        share = skip[0] if skip else 0.5
        half, full = rand_mask(s, case.mask_shape, share), rand_mask(s, case.mask_shape, 0.0)
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
                            dense_ms=dense_ms, baseline=case.baseline[0], others_ms=others, skipped=share,
                            live=half.float().mean().item(),
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


# The keys a decode step launches with their own sizes, so --in-step can judge them there; a key naming a batch and
# context ("attn_decode 32x8192 75%") is judged in that step, the others in batch 1's at a 1k context.
STEP_KEYS = ("gemv_mn_1", "gemm_k_small", "attn_decode")


def run_in_step(s, args, argv):
    """Every variant judged in the decode step rather than as one op (the op harness ranked designs unlike the
    step more than once: results/README.md): the 8B-shaped model of bench.e2e (routers calibrated to skip half),
    WIDE's step and dense's (routers off, the same kernels with every group live) timed with the variant in
    CONFIGS (kernels_base.configs_tried), between two runs of the current CONFIGS, which the variant's ratio is
    against. fp8 keys time fp8 weights."""
    from bench.common import calibrate_routers, random_model, with_engine
    from bench.e2e import E2ESetup, smoke_run, time_decode
    from policy import Policy
    run = smoke_run() if s.smoke else E2ESetup()
    table = {key: spec for key, spec in tune_table(s).items() if key.startswith(STEP_KEYS)
             and (not args.only or any(w in key for w in args.only))}
    if not table:
        cli.fail(f"--in-step: no decode key matches --only {','.join(args.only)}; the decode keys start with "
                 f"{', '.join(STEP_KEYS)}")

    def shape(key):  # [batch, context] of the step that judges a key (its routers' masks: about half skipped)
        words = key.split()
        batch, context = map(int, words[1].split("x")) if len(words) > 1 else (1, 1024)
        return [min(batch, 2), 24] if s.smoke else [batch, context]
    m, _ = random_model(run, max_seq_len=max(c for _, c in map(shape, table)) + run.steps + run.warmup + 64)
    calibrate_routers(m, 0.5, run.calibrate_tokens)

    def step(key, sizes, routers):
        batch, context = shape(key)
        with kernels_base.configs_tried({key.split()[0]: sizes}):
            return with_engine(m, routers, Policy(), lambda e: time_decode(run, e, batch, context, run.steps)[0],
                               "fp8" if "fp8" in key else "bf16")

    results = {}
    for key, (_, variants, *_) in table.items():
        current = kernels_base.CONFIGS[key.split()[0]]
        todo = [v for v in variants if v != current and (not args.having or any(name in v for name in args.having))]
        base = [step(key, {}, True)]
        dense_base = step(key, {}, False)
        results[key] = dict(current=current, step=shape(key), weights="fp8" if "fp8" in key else "bf16",
                            wide_ms=base[0], dense_ms=dense_base, variants=[])
        print(f"{key} (step {shape(key)}): WIDE {base[0]:.4f} ms, dense {dense_base:.4f} ms, current {current}",
              flush=True)
        for v in todo[:1] if s.smoke else todo:
            try:
                wide, dense = step(key, v, True), step(key, v, False)
            except Exception as e:  # e.g. out of shared memory: the next variant may fit
                results[key]["variants"].append(dict(config=v, failed=f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            base.append(step(key, {}, True))
            ref = (base[-2] + base[-1]) / 2
            results[key]["variants"].append(dict(config=v, wide_ms=wide, dense_ms=dense, wide_base_ms=ref,
                                                 ratio=wide / ref))
            print(f"  {v}: WIDE {wide:.4f} ms ({wide / ref:.3f} of the current's {ref:.4f}), dense {dense:.4f}",
                  flush=True)
            write_in_step(s, args, argv, results)  # after every variant: a sweep cut short keeps what it measured
        write_in_step(s, args, argv, results)
    return results


def write_in_step(s, args, argv, results):
    m_ = meta(s.smoke, "-m bench.tune", argv)
    lines = [f"# Block sizes judged in the decode step on {m_['gpu']}", "",
             f"torch {m_['torch']}, triton {m_['triton']}, {m_['date']}, `{m_['command']}`. bench.e2e's model "
             "(Llama-3.1-8B shape, random weights, routers calibrated to skip half); ms per CUDA-graph decode step "
             "with the variant in CONFIGS; 'of current' = against the mean of the current CONFIGS' steps just "
             "before and after it (their drift over the run is the noise floor).", "",
             "| CONFIGS key | step (batch x context) | weights | config | WIDE ms | of current | dense ms |",
             "|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        b, c = r["step"]
        lines.append(f"| {key} | {b}x{c} | {r['weights']} | current `{r['current']}` | {r['wide_ms']:.4f} | | "
                     f"{r['dense_ms']:.4f} |")
        for v in r["variants"]:
            cells = ("failed", "", "") if "failed" in v else (f"{v['wide_ms']:.4f}", f"{v['ratio']:.3f}",
                                                               f"{v['dense_ms']:.4f}")
            lines.append(f"| {key} | {b}x{c} | {r['weights']} | `{v['config']}` | " + " | ".join(cells) + " |")
    save(args.out, dict(meta=m_, results=results), "\n".join(lines) + "\n")
    print(f"written: {args.out}.json, {args.out}.md", flush=True)


def main(argv=None):
    args, argv, s = command_line(__doc__, "-m bench.tune", "kernels_h200_tune", "CONFIGS keys", argv, having=True,
                                 in_step=True)
    return run_in_step(s, args, argv) if args.in_step else run_tune(s, args, argv)


if __name__ == "__main__":
    cli.run(main)
