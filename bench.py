"""
GPU speed tables (BENCH.md protocol). Run on a CUDA machine:

  python bench.py kernels   # every WIDE kernel vs cuBLAS / SDPA, Llama-3.1-8B shapes, bf16
  python bench.py tune      # sweep the block sizes of kernels.CONFIGS on the target shapes

`kernels` first checks each op against its fp32 reference (fresh random inputs, NaN-poisoned
outputs, pruned slots exactly zero, rel err <= 1e-2), then times with triton.testing.do_bench
medians (L2 flushed between reps). Sparse times include everything the sparse path needs: the
layout (mask reordering) and the output zeroing. Decode-sized rows are also timed as CUDA-graph
replays over 4 rotating copies of the weights / KV cache (nothing stays in L2, no launch gaps).
Results: results/kernels_h200.json and results/kernels_h200.md.
"""
import argparse
import datetime
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

import kernels

# Llama-3.1-8B
D, H, HKV, HD, FFN = 4096, 32, 8, 128, 14336
FFN_GS, ATTN_HEADS_PER_GROUP = 128, 4  # 112 channel groups; one attention group = one KV head
DT = torch.bfloat16
DEVICE = "cuda"
PREFILL_M, PREFILL_T, DECODE_B, DECODE_L = 4096, 16384, 16, 8192  # the target shapes
COPY_GBS, MATMUL_TFLOPS = 4220, 692  # BENCH.md ceilings on the H200


def do_bench(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_bench(fns, reps=20):
    # One CUDA graph that calls fns[0..n-1] (each on its own copy of the data), replayed `reps` times.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / reps / len(fns)


def rand_mask(shape, sparsity):
    # Uniformly random (token, group) decisions with exactly round((1-s) * n) of them active.
    n = math.prod(shape)
    flat = torch.zeros(n, dtype=torch.bool, device=DEVICE)
    flat[torch.randperm(n, device=DEVICE)[:round((1 - sparsity) * n)]] = True
    return flat.view(shape)  # True = the group executes


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


class poisoned:
    # Outputs allocated by the kernels start as NaN while correctness is checked.
    def __enter__(self):
        self.orig = kernels._empty
        kernels._empty = lambda shape, dtype, device: torch.full(
            shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)

    def __exit__(self, *exc):
        kernels._empty = self.orig


def check(name, out, ref, keep):
    err = rel_err(out, ref)
    zeros_ok = bool((out[~keep] == 0).all()) if keep is not None else True
    nan_free = not bool(torch.isnan(out).any())
    ok = err <= 1e-2 and zeros_ok and nan_free
    print(f"  check {name}: rel err {err:.2e}, pruned zeros {zeros_ok}, no NaN {nan_free}", flush=True)
    assert ok, f"{name}: correctness check failed"
    return err


# ----------------------------------------------------------------------------------- op cases
# Each case: (op, tokens, batch, context, make) where make(sparsity) returns a dict with
# dense (callable), sparse (callable), check (callable: asserts), flops/bytes of the dense op,
# active fraction, and optionally graph variants (lists of callables over rotating copies).
def linear_weights(n, k, copies=1):
    return [torch.randn(n, k, device=DEVICE, dtype=DT) / math.sqrt(k) for _ in range(copies)]


def case_gate_up(T):
    copies = 4 if T <= 16 else 1
    wg, wu = linear_weights(FFN, D, copies), linear_weights(FFN, D, copies)
    wgu = [torch.cat([a, b]) for a, b in zip(wg, wu)]
    x = torch.randn(T, D, device=DEVICE, dtype=DT)

    def make(s):
        mask = rand_mask((T, FFN // FFN_GS), s)
        keep = mask.repeat_interleave(FFN_GS, 1)
        dense = [lambda i=i: F.linear(x, wgu[i]) for i in range(copies)]
        sparse = [lambda i=i: kernels.gemm_mn(x, wg[i], mask, FFN_GS, w_up=wu[i]) for i in range(copies)]

        def chk():
            ref = kernels.gemm_mn_ref(x.float(), wg[0].float(), mask, FFN_GS, wu[0].float())
            return check("gate+up", sparse[0](), ref, keep)
        return dict(dense=dense, sparse=sparse, check=chk, active=mask.float().mean().item(),
                    flops=2 * T * 2 * FFN * D, bytes=2 * (2 * FFN * D + T * D + T * 2 * FFN),
                    extra=dict(dense_swiglu_ms=lambda: do_bench(
                        lambda: (lambda y: F.silu(y[:, :FFN]) * y[:, FFN:])(dense[0]()))))
    return make


def case_mn(T, N, gs, name):
    copies = 4 if T <= 16 else 1
    w = linear_weights(N, D, copies)
    x = torch.randn(T, D, device=DEVICE, dtype=DT)

    def make(s):
        mask = rand_mask((T, N // gs), s)
        dense = [lambda i=i: F.linear(x, w[i]) for i in range(copies)]
        sparse = [lambda i=i: kernels.gemm_mn(x, w[i], mask, gs) for i in range(copies)]

        def chk():
            ref = kernels.gemm_mn_ref(x.float(), w[0].float(), mask, gs)
            return check(name, sparse[0](), ref, mask.repeat_interleave(gs, 1))
        return dict(dense=dense, sparse=sparse, check=chk, active=mask.float().mean().item(),
                    flops=2 * T * N * D, bytes=2 * (N * D + T * D + T * N))
    return make


def case_k(T, Kdim, gs, name, method="tile"):
    copies = 4 if T <= 16 else 1
    w = linear_weights(D, Kdim, copies)
    a = torch.randn(T, Kdim, device=DEVICE, dtype=DT)

    def make(s):
        mask = rand_mask((T, Kdim // gs), s)
        dense = [lambda i=i: F.linear(a, w[i]) for i in range(copies)]
        sparse = [lambda i=i: kernels.gemm_k(a, w[i], mask, gs, method=method) for i in range(copies)]

        def chk():
            ref = kernels.gemm_k_ref(a.float(), w[0].float(), mask, gs)
            return check(name, sparse[0](), ref, None)
        return dict(dense=dense, sparse=sparse, check=chk, active=mask.float().mean().item(),
                    flops=2 * T * D * Kdim, bytes=2 * (D * Kdim + T * D + T * Kdim))
    return make


def case_decode(B, L):
    copies = 4
    q = torch.randn(B, H, 1, HD, device=DEVICE, dtype=DT)
    kv = [(torch.randn(B, HKV, L, HD, device=DEVICE, dtype=DT),
           torch.randn(B, HKV, L, HD, device=DEVICE, dtype=DT)) for _ in range(copies)]
    kv_len = torch.full((B,), L, device=DEVICE, dtype=torch.int32)
    G = H // ATTN_HEADS_PER_GROUP

    def make(s):
        mask = rand_mask((B, G), s)
        dense = [lambda i=i: F.scaled_dot_product_attention(q, kv[i][0], kv[i][1], enable_gqa=True)
                 for i in range(copies)]
        sparse = [lambda i=i: kernels.attention_decode(q, kv[i][0], kv[i][1], mask, kv_len)
                  for i in range(copies)]

        def chk():
            ref = kernels.attention_decode_ref(q.float(), kv[0][0].float(), kv[0][1].float(), mask, kv_len)
            keep = mask.repeat_interleave(ATTN_HEADS_PER_GROUP, 1)[:, :, None, None].expand_as(ref)
            return check("decode attention", sparse[0](), ref, keep)
        return dict(dense=dense, sparse=sparse, check=chk, active=mask.float().mean().item(),
                    flops=4 * B * H * L * HD, bytes=2 * (2 * B * HKV * L * HD + 2 * B * H * HD))
    return make


def case_prefill(B, T):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(B, H, T, HD, device=DEVICE, dtype=DT)
    k, v = (torch.randn(B, HKV, T, HD, device=DEVICE, dtype=DT) for _ in range(2))
    G = H // ATTN_HEADS_PER_GROUP

    def sdpa(backend=None, expand=False):
        kk, vv = (k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)) if expand else (k, v)

        def run():
            if backend is None:
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not expand)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not expand)
        return run

    def make(s):
        mask = rand_mask((B, T, G), s)
        sparse = [lambda: kernels.attention_prefill(q, k, v, mask)]

        def chk():
            ref = kernels.attention_prefill_ref(q.float(), k.float(), v.float(), mask)
            keep = mask.repeat_interleave(ATTN_HEADS_PER_GROUP, -1).permute(0, 2, 1)[..., None].expand_as(ref)
            return check("prefill attention", sparse[0](), ref, keep)

        def best_default():
            return min(do_bench(sdpa()), do_bench(sdpa(expand=True)))
        return dict(dense=None, dense_ms=best_default, sparse=sparse, check=chk,
                    active=mask.float().mean().item(), flops=4 * B * H * T * T * HD // 2,
                    bytes=2 * B * T * HD * (2 * H + 2 * HKV),
                    extra=dict(dense_flash_ms=lambda: do_bench(sdpa(SDPBackend.FLASH_ATTENTION)),
                               dense_gqa_default_ms=lambda: do_bench(sdpa()),
                               dense_expanded_default_ms=lambda: do_bench(sdpa(expand=True))))
    return make


def all_cases():
    return [
        ("gemm_mn gate+up (fused silu*up)", 1, 1, 0, lambda: case_gate_up(1)),
        ("gemm_mn gate+up (fused silu*up)", PREFILL_M, 1, 0, lambda: case_gate_up(PREFILL_M)),
        ("gemm_mn q_proj (512-ch groups)", 1, 1, 0, lambda: case_mn(1, D, 512, "q")),
        ("gemm_mn q_proj (512-ch groups)", PREFILL_M, 1, 0, lambda: case_mn(PREFILL_M, D, 512, "q")),
        ("gemm_k down (128-ch groups, tile)", 1, 1, 0, lambda: case_k(1, FFN, FFN_GS, "down")),
        ("gemm_k down (128-ch groups, tile)", PREFILL_M, 1, 0, lambda: case_k(PREFILL_M, FFN, FFN_GS, "down")),
        ("gemm_k down (128-ch groups, atomic)", PREFILL_M, 1, 0,
         lambda: case_k(PREFILL_M, FFN, FFN_GS, "down atomic", "atomic")),
        ("gemm_k o_proj (512-ch groups, tile)", 1, 1, 0, lambda: case_k(1, D, 512, "o")),
        ("gemm_k o_proj (512-ch groups, tile)", PREFILL_M, 1, 0, lambda: case_k(PREFILL_M, D, 512, "o")),
        ("gemm_k o_proj (512-ch groups, atomic)", PREFILL_M, 1, 0,
         lambda: case_k(PREFILL_M, D, 512, "o atomic", "atomic")),
        ("attention decode (GQA, split-KV)", 1, DECODE_B, DECODE_L, lambda: case_decode(DECODE_B, DECODE_L)),
        ("attention prefill (causal, GQA)", PREFILL_T, 1, PREFILL_T, lambda: case_prefill(1, PREFILL_T)),
    ]


def run_kernels(args):
    rows = []
    for op, tokens, batch, context, factory in all_cases():
        if args.only and args.only not in op:
            continue
        make = factory()
        print(f"{op}: tokens {tokens}, batch {batch}, context {context}", flush=True)
        with poisoned():
            c = make(0.5)
            err = c["check"]()
        dense_ms = c["dense_ms"]() if c["dense"] is None else do_bench(c["dense"][0])
        full = make(0.0)
        all_active_ms = do_bench(full["sparse"][0])
        extra = {k: f() for k, f in c.get("extra", {}).items()}
        for s in (0.25, 0.5, 0.75):
            c = make(s)
            sparse_ms = do_bench(c["sparse"][0])
            memory_bound = tokens <= 16 or "decode" in op
            row = dict(op=op, tokens=tokens, batch=batch, context=context, sparsity=s,
                       realized_active=round(c["active"], 4), dense_ms=dense_ms, sparse_ms=sparse_ms,
                       speedup=dense_ms / sparse_ms, ideal_speedup=1 / max(c["active"], 1e-9),
                       all_active_ms=all_active_ms, rel_err_50=err, **extra)
            if memory_bound:
                row["dense_GBps"] = c["bytes"] / dense_ms / 1e6
                row["sparse_useful_GBps"] = c["active"] * c["bytes"] / sparse_ms / 1e6
            else:
                row["dense_TFLOPs"] = c["flops"] / dense_ms / 1e9
                row["sparse_useful_TFLOPs"] = c["active"] * c["flops"] / sparse_ms / 1e9
            if memory_bound and c["dense"] is not None and len(c["dense"]) > 1:
                row["dense_graph_ms"] = graph_bench(c["dense"])
                row["sparse_graph_ms"] = graph_bench(c["sparse"])
                row["graph_speedup"] = row["dense_graph_ms"] / row["sparse_graph_ms"]
            rows.append(row)
            print("  " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                   for k, v in row.items() if k != "op"), flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python " + " ".join(sys.argv), configs=kernels.CONFIGS,
                timing="triton.testing.do_bench median (L2 flushed); graph: CUDA-graph replay over 4 rotating copies",
                ceilings=dict(copy_GBps=COPY_GBS, bf16_matmul_TFLOPs=MATMUL_TFLOPS))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(meta, rows))
    print(markdown(meta, rows))


def markdown(meta, rows):
    out = [f"# WIDE kernels on {meta['gpu']}",
           "",
           f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, `{meta['command']}`. "
           "bf16, Llama-3.1-8B shapes, random group masks (sparsity = fraction of groups skipped). "
           "Times are do_bench medians with L2 flushed; sparse times include the layout and output "
           "zeroing. Dense = F.linear (cuBLAS) / SDPA default backend. 'rate' is the useful work of "
           f"the sparse kernel (GB/s vs copy {COPY_GBS}, TFLOP/s vs matmul {MATMUL_TFLOPS}).",
           "",
           "| op | tokens | batch | context | sparsity | dense ms | sparse ms | speedup | ideal | all-active ms | rate | graph speedup |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rate = (f"{r['sparse_useful_GBps']:.0f} GB/s" if "sparse_useful_GBps" in r
                else f"{r['sparse_useful_TFLOPs']:.0f} TFLOP/s")
        graph = f"{r['graph_speedup']:.2f}x" if "graph_speedup" in r else ""
        out.append(f"| {r['op']} | {r['tokens']} | {r['batch']} | {r['context']} | {r['sparsity']:.2f} | "
                   f"{r['dense_ms']:.4f} | {r['sparse_ms']:.4f} | {r['speedup']:.2f}x | "
                   f"{r['ideal_speedup']:.2f}x | {r['all_active_ms']:.4f} | {rate} | {graph} |")
    keys = ("dense_swiglu_ms", "dense_flash_ms", "dense_gqa_default_ms", "dense_expanded_default_ms")
    extras = [f"- {r['op']} (tokens {r['tokens']}): " + ", ".join(f"{k} {r[k]:.4f}" for k in keys if k in r)
              for r in rows if r["sparsity"] == 0.5 and any(k in r for k in keys)]
    graph = [f"- {r['op']} (tokens {r['tokens']}, batch {r['batch']}, sparsity {r['sparsity']:.2f}): "
             f"dense {r['dense_graph_ms'] * 1e3:.1f} us, sparse {r['sparse_graph_ms'] * 1e3:.1f} us"
             for r in rows if "graph_speedup" in r]
    targets = []
    for op, tokens, goal in TARGETS:
        r = next((r for r in rows if r["op"].startswith(op) and r["tokens"] == tokens and r["sparsity"] == 0.5), None)
        if r:
            g = f", CUDA graph {r['graph_speedup']:.2f}x" if "graph_speedup" in r else ""
            targets.append(f"| {r['op']} | {tokens} | {r['speedup']:.2f}x{g} | >= {goal}x | "
                           f"{'met' if r['speedup'] >= goal else 'missed'} |")
    return "\n".join(out + ["", "Targets at 50% sparsity:", "", "| op | tokens | measured | target | |",
                            "|---|---|---|---|---|"] + targets
                     + ["", "Other dense baselines (ms):"] + extras
                     + ["", "CUDA-graph replay over 4 rotating weight / KV copies (per call):"] + graph) + "\n"


TARGETS = [("gemm_mn gate+up", 1, 1.9), ("gemm_mn gate+up", PREFILL_M, 1.9),
           ("gemm_k down (128-ch groups, tile)", PREFILL_M, 1.8), ("attention decode", 1, 1.9),
           ("attention prefill", PREFILL_T, 1.8)]


# ----------------------------------------------------------------------------------- tuning
TUNE = {
    "gemm_mn_fused": (lambda: case_gate_up(PREFILL_M), [
        dict(block_m=128, BN=128, BK=64, num_warps=8, num_stages=4),
        dict(block_m=128, BN=128, BK=128, num_warps=8, num_stages=2),
        dict(block_m=256, BN=64, BK=64, num_warps=8, num_stages=4)]),
    "gemv_mn_1": (lambda: case_gate_up(1), [
        dict(BN=4, BK=1024, num_warps=4, num_stages=1, programs_per_sm=4),
        dict(BN=4, BK=1024, num_warps=4, num_stages=1, programs_per_sm=6),
        dict(BN=4, BK=1024, num_warps=4, num_stages=1, programs_per_sm=7),
        dict(BN=8, BK=512, num_warps=4, num_stages=1, programs_per_sm=4),
        dict(BN=2, BK=1024, num_warps=4, num_stages=1, programs_per_sm=8),
        dict(BN=4, BK=512, num_warps=4, num_stages=1, programs_per_sm=6)]),
    "gemm_k": (lambda: case_k(PREFILL_M, FFN, FFN_GS, "down"), [
        dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3),
        dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=4),
        dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=4)]),
    "gemm_k_small": (lambda: case_k(1, FFN, FFN_GS, "down"), [
        dict(BM=16, BN=32, BK=128, num_warps=4, num_stages=4),
        dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3),
        dict(BM=16, BN=16, BK=128, num_warps=4, num_stages=6)]),
    "attn_prefill": (lambda: case_prefill(1, PREFILL_T), [
        dict(BM=128, BN=64, num_warps=8, num_stages=3),
        dict(BM=128, BN=128, num_warps=8, num_stages=2),
        dict(BM=128, BN=64, num_warps=8, num_stages=4)]),
    "attn_decode": (lambda: case_decode(DECODE_B, DECODE_L), [
        dict(BN=128, SPLIT=2048, num_warps=8, num_stages=2),
        dict(BN=128, SPLIT=1024, num_warps=8, num_stages=2),
        dict(BN=64, SPLIT=2048, num_warps=4, num_stages=4),
        dict(BN=128, SPLIT=4096, num_warps=8, num_stages=2)]),
}


def run_tune(args):
    results = {}
    for shape in [(PREFILL_M, FFN // FFN_GS), (1, PREFILL_T, H // ATTN_HEADS_PER_GROUP)]:
        mask = rand_mask(shape, 0.5)
        print(f"layout {shape}: {do_bench(lambda: kernels.layout(mask)) * 1e3:.1f} us", flush=True)
    for key, (factory, variants) in TUNE.items():
        if args.only and args.only not in key:
            continue
        make = factory()
        base, base_bm = dict(kernels.CONFIGS[key]), kernels.CONFIGS["block_m"]
        c = make(0.5)
        dense_ms = c["dense_ms"]() if c["dense"] is None else do_bench(c["dense"][0])
        print(f"{key}: dense {dense_ms:.4f} ms", flush=True)
        results[key] = dict(dense_ms=dense_ms, variants=[])
        for v in variants:
            v = dict(v)
            bm = v.pop("block_m", None)
            kernels.CONFIGS[key] = v
            if bm:
                kernels.CONFIGS["block_m"] = bm
            try:
                with poisoned():
                    c["check"]()
                ms, all_ms = do_bench(c["sparse"][0]), do_bench(make(0.0)["sparse"][0])
                print(f"  {v} block_m={bm}: {ms:.4f} ms ({dense_ms / ms:.2f}x), all-active {all_ms:.4f}",
                      flush=True)
                results[key]["variants"].append(dict(cfg=v, block_m=bm, ms=ms, all_active_ms=all_ms))
            except Exception as e:  # e.g. out of shared memory
                print(f"  {v}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            kernels.CONFIGS[key] = base
            kernels.CONFIGS["block_m"] = base_bm
    with open(args.out + "_tune.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["kernels", "tune"])
    p.add_argument("--out", default="results/kernels_h200", help="output path prefix (.json, .md)")
    p.add_argument("--only", default="", help="run only the ops whose name contains this")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.py needs a CUDA GPU (the kernels' correctness tests run on CPU: pytest)")
    torch.manual_seed(0)
    {"kernels": run_kernels, "tune": run_tune}[args.what](args)
