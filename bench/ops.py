"""
Kernel speed: every WIDE op against the best dense op we can build, Llama-3.1-8B shapes, bf16.

  python -m bench.ops              # correctness at every sparsity, then timings -> results/kernels_h200.{json,md}
  python -m bench.ops --only gate  # only the ops whose name contains "gate"
  TRITON_INTERPRET=1 python -m bench.ops --smoke   # the same code on the CPU: tiny fp32 shapes (CI)

The cases are bench/cases.py's (bench/tune.py sweeps block sizes over them). For every op:
 1) Correctness first, at every sparsity then timed (every group live, 25%, 50%, 75% skipped): relative
    error against the fp32 twin <= 1e-2, pruned output slots exactly 0, no NaN. A failed check stops the run.
 2) Prefill rows: triton.testing.do_bench medians (L2 flushed). Decode-sized rows (<= DECODE_TOKENS):
    CUDA-graph replay over rotating copies, since under do_bench a microsecond kernel mostly measures its
    host launch. Both times are stored.
 3) The dense side at its best: fused gate+up (and with SwiGLU) and QKV GEMMs, SDPA's default backend.
    Sparse times include the layout (mask reordering) and the zeroing of pruned outputs.
 4) The sparse kernel with every group live: against dense it shows kernel quality, against its own
    sparse runs how well skipping turns into time.
"""
import functools

import torch

import cli
import kernels_base
from bench.cases import DECODE_TOKENS, CheckFailed, all_cases, check, command_line, rand_mask
from bench.common import COPY_GBS, MATMUL_TFLOPS, bench_ms, graph_ms, meta, save


def measure(s, case):
    """The rows of one case: one per timed sparsity, all checked first, dense and all-active shared."""
    run = lambda mask: [functools.partial(case.sparse, mask, i) for i in range(case.copies)]
    dense = {name: bench_ms(s.smoke, fns[0]) for name, fns in case.dense.items()}
    dense_graph = {name: graph_ms(s.smoke, fns) for name, fns in case.dense.items()} if case.decode else {}
    full = rand_mask(s, case.mask_shape, 0.0)
    full_check = check(case, full)
    all_ms = bench_ms(s.smoke, run(full)[0])
    all_graph_ms = graph_ms(s.smoke, run(full)) if case.decode else None
    best = min(case.baseline, key=dense.get)
    rows = []
    for sp in s.sparsities:
        mask = rand_mask(s, case.mask_shape, sp)
        active = mask.float().mean().item()
        ok = check(case, mask)
        sparse_ms = bench_ms(s.smoke, run(mask)[0])
        share = 1 - case.prunable + case.prunable * active  # of the dense op's bytes (or FLOPs) still needed
        row = dict(op=case.op, tokens=case.tokens, batch=case.batch, context=case.context, sparsity=sp,
                   realized_active=round(active, 4), timing="cuda_graph" if case.decode else "do_bench",
                   dense_baseline=best, dense_ms=dense[best], sparse_ms=sparse_ms, speedup=dense[best] / sparse_ms,
                   ideal_speedup=1 / share, all_active_ms=all_ms, **ok,
                   all_active_rel_err=full_check["rel_err"], copies=case.copies)
        for name, ms in dense.items():
            if name != "dense":
                row[f"{name}_ms"] = ms
            if name not in case.baseline:
                row[f"speedup_vs_{name}"] = ms / sparse_ms
        judged_dense, judged_sparse = dense[best], sparse_ms
        if case.decode:
            sparse_graph = graph_ms(s.smoke, run(mask))
            row.update(dense_graph_ms=dense_graph[best], sparse_graph_ms=sparse_graph,
                       graph_speedup=dense_graph[best] / sparse_graph, all_active_graph_ms=all_graph_ms,
                       reuse_bytes=round((case.copies - 1) * share * case.bytes), l2_bytes=s.l2_bytes)
            for name, ms in dense_graph.items():
                if name not in case.baseline:
                    row[f"{name}_graph_ms"] = ms
                    row[f"graph_speedup_vs_{name}"] = ms / sparse_graph
            judged_dense, judged_sparse = dense_graph[best], sparse_graph
        row["judged_speedup"] = judged_dense / judged_sparse
        if case.decode:  # rates from the judged (graph) times
            row["dense_GBps"] = case.bytes / judged_dense / 1e6
            row["sparse_useful_GBps"] = share * case.bytes / judged_sparse / 1e6
        else:
            row["dense_TFLOPs"] = case.flops / judged_dense / 1e9
            row["sparse_useful_TFLOPs"] = share * case.flops / judged_sparse / 1e9
        rows.append(row)
        print(f"  {sp:.0%} skipped: rel err {ok['rel_err']:.1e}; dense {judged_dense * 1e3:.1f} us, WIDE "
              f"{judged_sparse * 1e3:.1f} us ({row['timing']}): {row['judged_speedup']:.2f}x, do_bench "
              f"{row['speedup']:.2f}x, ideal {row['ideal_speedup']:.2f}x", flush=True)
    return rows


# The kernel speed targets, at 50% of the groups skipped: (text, op prefix, tokens, row key, goal[, unit]).
TARGETS = [
    ("gate+up fused, 1 token, CUDA graph", "gate+up", 1, "graph_speedup", 1.85),
    ("down (gemm_k), 1 token, CUDA graph", "down (gemm_k", 1, "graph_speedup", 1.80),
    ("decode attention B16 L8192, CUDA graph", "attention decode", 1, "graph_speedup", 1.85),
    ("causal prefill attention 16k vs SDPA default", "attention prefill", "prefill_t", "speedup", 1.80),
    ("gate+up fused, 4096 tokens, vs cuBLAS", "gate+up", "prefill_m", "speedup", 1.75),
    ("gate+up fused, 4096 tokens, vs cuBLAS + SwiGLU", "gate+up", "prefill_m", "speedup_vs_dense_swiglu", 1.85),
    # fp8 weights, one token: the live bytes per second of WIDE's GEMVs against the copy ceiling
    ("fp8 gate+up, 1 token, live bytes", "fp8 gate+up", 1, "sparse_useful_GBps", 3400, " GB/s"),
    ("fp8 down, 1 token, live bytes", "fp8 down", 1, "sparse_useful_GBps", 3400, " GB/s"),
    ("fp8 Q, K, V, 1 token, live bytes", "fp8 Q/K/V", 1, "sparse_useful_GBps", 3400, " GB/s"),
    ("fp8 O, 1 token, live bytes", "fp8 o_proj", 1, "sparse_useful_GBps", 3400, " GB/s"),
]


def target_lines(s, rows):
    out = ["| target (50% of groups skipped) | measured | goal | |", "|---|---|---|---|"]
    for text, op, tokens, key, goal, *unit in TARGETS:
        tokens, unit = getattr(s, tokens) if isinstance(tokens, str) else tokens, unit[0] if unit else "x"
        r = next((r for r in rows if r["op"].startswith(op) and r["tokens"] == tokens
                  and r["sparsity"] == 0.5 and key in r), None)
        got = (f"{r[key]:.0f}" if unit != "x" else f"{r[key]:.2f}") + unit if r else "not measured"
        verdict = ("met" if r[key] >= goal else "missed") if r else ""
        out.append(f"| {text} | {got} | >= {goal}{unit} | {verdict} |")
    return out


def markdown(s, m, rows):
    us = lambda ms: f"{ms * 1e3:.1f}"
    out = [f"# WIDE kernels on {m['gpu']}", "",
           f"torch {m['torch']}, triton {m['triton']}, {m['date']}, `{m['command']}`. {m['about']}", "",
           "| op | tokens | batch | context | sparsity | judged by | dense us | WIDE us | speedup | ideal | "
           "do_bench speedup | vs other dense | all groups on, us | useful rate | copies | rel err |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r["timing"] == "cuda_graph"
        d, w, a = ((r["dense_graph_ms"], r["sparse_graph_ms"], r["all_active_graph_ms"]) if g
                   else (r["dense_ms"], r["sparse_ms"], r["all_active_ms"]))
        prefix = "graph_speedup_vs_" if g else "speedup_vs_"
        other = ", ".join(f"{k[len(prefix):]} {v:.2f}x" for k, v in r.items() if k.startswith(prefix))
        rate = (f"{r['sparse_useful_GBps']:.0f} GB/s" if "sparse_useful_GBps" in r
                else f"{r['sparse_useful_TFLOPs']:.0f} TFLOP/s")
        out.append(f"| {r['op']} | {r['tokens']} | {r['batch']} | {r['context']} | {r['sparsity']:.2f} | "
                   f"{'CUDA graph' if g else 'do_bench'} | {us(d)} | {us(w)} | {r['judged_speedup']:.2f}x | "
                   f"{r['ideal_speedup']:.2f}x | {r['speedup']:.2f}x | {other} | {us(a)} | {rate} | "
                   f"{r['copies']} | {r['rel_err']:.1e} |")
    return "\n".join(out + ["", "Targets:", ""] + target_lines(s, rows)) + "\n"


ABOUT = ("{dtype}, shapes D {D}, {H} q / {HKV} kv heads of {HD}, FFN {FFN}; random group masks (sparsity = "
         "share of groups skipped), checked against the fp32 twin at every sparsity before timing. Decode-sized "
         "rows (<= {dt} tokens) are judged on CUDA-graph replay over 'copies' rotating weight/KV copies "
         "(sparse bytes read between two uses of a copy >= 2x the {l2:.0f} MB L2); their do_bench speedup "
         "is shown too. Larger rows: do_bench medians, L2 flushed. WIDE times include the layout and output "
         "zeroing. Dense: one cuBLAS GEMM over the fused weight (gate+up [2I, D]; Q/K/V [(H+2Hkv)d, D]), SDPA's "
         "default backend for attention. fp8 rows: e4m3 weights with per-channel scales (a byte per weight in "
         "the bytes), WIDE's decode kernels against stock fp8, the input quantized per token then torch._scaled_mm "
         "(the faster of its per-row and per-tensor scaling; bf16 cuBLAS beside it). 'ideal' = dense bytes "
         "(decode) or FLOPs (prefill) / the share still needed; 'useful rate' = that share / WIDE time (copy "
         "ceiling {copy} GB/s, bf16 matmul {mm} TFLOP/s).")


def run_kernels(s, args, argv):
    rows = []
    for name, factory in all_cases(s):
        if args.only and not any(w in name for w in args.only):
            continue
        case = factory()
        print(f"{case.op}: tokens {case.tokens}, batch {case.batch}, context {case.context}, "
              f"{case.copies} copies", flush=True)
        rows += measure(s, case)
        del case
        if not s.smoke:
            torch.cuda.empty_cache()
    about = ABOUT.format(dtype=str(s.dtype).replace("torch.", ""), D=s.D, H=s.H, HKV=s.HKV, HD=s.HD, FFN=s.FFN,
                         dt=DECODE_TOKENS, l2=s.l2_bytes / 2 ** 20, copy=COPY_GBS, mm=MATMUL_TFLOPS)
    m = meta(s.smoke, "-m bench.ops", argv, about=about, configs=kernels_base.CONFIGS, l2_MB=s.l2_bytes / 2 ** 20,
             ceilings=dict(copy_GBps=COPY_GBS, bf16_matmul_TFLOPs=MATMUL_TFLOPS))
    md = markdown(s, m, rows)
    save(args.out, dict(meta=m, rows=rows), md)
    print(md + f"\nwritten: {args.out}.json, {args.out}.md")
    return rows


def main(argv=None):
    args, argv, s = command_line(__doc__, "-m bench.ops", "kernels_h200", "ops", argv)
    try:
        return run_kernels(s, args, argv)
    except CheckFailed as e:
        cli.fail(f"correctness check failed, nothing timed past it: {e}")


if __name__ == "__main__":
    cli.run(main)
