"""
GPU speed tables. Run on a CUDA machine:

  python bench.py kernels   # every WIDE kernel vs cuBLAS / SDPA, Llama-3.1-8B shapes, bf16
  python bench.py tune      # sweep the block sizes of kernels.CONFIGS on the target shapes
  python bench.py e2e       # whole-model prefill and decode, WIDE vs dense in the same engine

`kernels` first checks each op against its fp32 reference (fresh random inputs, NaN-poisoned
outputs, pruned slots exactly zero, rel err <= 1e-2), then times with triton.testing.do_bench
medians (L2 flushed between reps). Sparse times include everything the sparse path needs: the
layout (mask reordering) and the output zeroing. Decode-sized rows are also timed as CUDA-graph
replays over 4 rotating copies of the weights / KV cache (nothing stays in L2, no launch gaps).
Results: results/kernels_h200.json and results/kernels_h200.md.

`e2e` runs a Llama-3.1-8B-shaped model (random bf16 weights) through model.py's Triton backend:
prefill of 4096 tokens, and decode steps captured as CUDA graphs (generate.CUDAGraphDecoder) at batch
1, 8 and 32 over a KV cache filled to 1k and 8k tokens. WIDE and the dense baseline (the same model
with its routers removed) run in the same engine. Results: results/e2e_h200.json and .md.
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
COPY_GBS, MATMUL_TFLOPS = 4220, 692  # measured H200 ceilings: device-to-device copy, bf16 matmul 8192^3


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


# ----------------------------------------------------------------------------------- end to end
E2E_BATCHES, E2E_CONTEXTS, E2E_PREFILL = (1, 8, 32), (1024, 8192), 4096


def e2e_model(preset="llama-3.1-8b", max_seq_len=None):
    """A preset's shape with random bf16 weights (std 0.02) and WIDE routers; built on the GPU directly."""
    import wide
    from model import ModelConfig, Transformer, rope_frequencies
    cfg = ModelConfig.from_name(preset)
    cfg.max_seq_len = max_seq_len or cfg.max_seq_len
    torch.set_default_dtype(DT)
    try:
        with torch.device("meta"):
            m = Transformer(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    m.to_empty(device=DEVICE)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.02) if p.dim() == 2 else p.fill_(1.0)
    m.inv_freq = rope_frequencies(cfg).to(DEVICE)
    heads = ATTN_HEADS_PER_GROUP if cfg.n_heads == H else cfg.n_heads // cfg.n_kv_heads
    wcfg = wide.WideConfig(attn_group_size=heads, ffn_group_size=FFN_GS if cfg.intermediate_size == FFN else 32)
    wide.install_routers(m, wcfg)
    return m.eval(), wcfg


@torch.no_grad()
def calibrate_routers(m, sparsity=0.5, tokens=1024, passes=2):
    """Shift each group's skip-logit bias so that the group skips `sparsity` of the tokens of a random
    prompt. The routers are the real wide.Router (Kaiming-uniform weights); only the biases move. Two
    passes, since the later layers see what the earlier layers' masks did."""
    import wide
    routers = list(wide.routers(m))
    idx = torch.randint(0, m.config.vocab_size, (1, min(tokens, m.config.max_seq_len)), device=DEVICE)
    for _ in range(passes):
        seen = {}
        hooks = [r.register_forward_hook(lambda mod, a, out: seen.__setitem__(mod, a[0])) for r in routers]
        m.set_backend("torch")
        m(idx)
        for h in hooks:
            h.remove()
        for r, x in seen.items():
            z = r.logits(x).reshape(-1, r.n_groups, 2).float()
            d = z[..., 1] - z[..., 0]  # skip iff d > 0
            r.up.bias.view(-1, 2)[:, 1] -= torch.quantile(d, 1 - sparsity, dim=0)


def weight_bytes(m):
    # What a decode step must read once: every weight except the embedding table (one row per token).
    return sum(p.numel() * p.element_size() for n, p in m.named_parameters()
               if "router" not in n and ("embed_tokens" not in n or m.lm_head is None))


def kv_bytes(cfg, batch, context):
    return cfg.n_layers * batch * context * 2 * cfg.n_kv_heads * cfg.head_dim * 2


def events_ms(fn, reps):
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    fn(reps)
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / reps


@torch.no_grad()
def time_prefill(m, T, reps=5):
    """One prompt of T tokens at positions 0..T-1 into the static cache, logits of its last token."""
    m.setup_caches(1, T)
    idx = torch.randint(0, m.config.vocab_size, (1, T), device=DEVICE)
    pos, last = torch.arange(T, device=DEVICE), torch.tensor([T - 1], device=DEVICE)
    run = lambda n: [m(idx, input_pos=pos, logits_at=last) for _ in range(n)]
    run(2)
    times = sorted(events_ms(run, 1) for _ in range(reps))
    m.clear_caches()
    return times[len(times) // 2]


@torch.no_grad()
def time_decode(m, batch, context, steps):
    """ms per decode step (B new tokens) over a cache filled to `context` with random K/V, as
    generate() runs it: CUDA-graph replay, greedy argmax, next position. Also the masks the WIDE
    routers chose: skipped share and, for B > 1, the share of groups live in the batch's union."""
    from generate import CUDAGraphDecoder
    m.setup_caches(batch, context + steps + 16)
    for layer in m.layers:  # as if a prompt of `context` tokens had been prefilled
        c = layer.self_attn.kv_cache
        c.k_cache[:, :, :context].normal_()
        c.v_cache[:, :, :context].normal_()
    token = torch.randint(0, m.config.vocab_size, (batch, 1), device=DEVICE)
    pos = torch.full((batch,), context, device=DEVICE)
    step = CUDAGraphDecoder(m, token, pos)
    state = dict(token=token)

    def run(n):
        for _ in range(n):
            state["token"] = step(state["token"], pos).argmax(-1, keepdim=True)
            pos.add_(1)
    run(3)
    ms = events_ms(run, steps)
    masks = None
    if m.layers[0].attn_router is not None:
        got = {k: [] for k in ("attn_skip", "ffn_skip", "attn_union_live", "ffn_union_live")}
        for _ in range(4):
            run(1)
            for layer in m.layers:
                for kind, r in (("attn", layer.attn_router), ("ffn", layer.ffn_router)):
                    keep = r.keep.float().reshape(batch, -1)
                    got[f"{kind}_skip"].append(1 - keep.mean().item())
                    got[f"{kind}_union_live"].append(keep.amax(0).mean().item())
        masks = {k: round(sum(v) / len(v), 4) for k, v in got.items()}
    del step
    m.clear_caches()
    torch.cuda.empty_cache()
    return ms, masks


class policy:
    """Temporarily set model.py's module-level knobs (SPARSE_DECODE_MAX_TOKENS, DENSE_DECODE_ATTENTION...)."""

    def __init__(self, **knobs):
        import model
        self.model, self.knobs = model, knobs

    def __enter__(self):
        self.old = {k: getattr(self.model, k) for k in self.knobs}
        for k, v in self.knobs.items():
            setattr(self.model, k, v)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            setattr(self.model, k, v)


def run_e2e(args):
    import triton
    import model as model_py
    from generate import routers_off, routers_on
    t_start = __import__("time").time()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python " + " ".join(sys.argv), copy_GBps=COPY_GBS,
                policy=dict(SPARSE_DECODE_MAX_TOKENS=model_py.SPARSE_DECODE_MAX_TOKENS,
                            SPARSE_PREFILL_MIN_TOKENS=model_py.SPARSE_PREFILL_MIN_TOKENS),
                model="Llama-3.1-8B shape (32 layers, D 4096, 32 q / 8 kv heads, FFN 14336, vocab 128256), "
                      "random bf16 weights; attention groups of 4 query heads (= one KV head), FFN groups "
                      "of 128 channels",
                routers="wide.Router (Kaiming-uniform, fp32) on the real hidden states; each group's skip-logit "
                        "bias set to the median of its (skip - execute) logit gap on a random 1024-token "
                        "prompt (2 passes), so every group skips about half of the tokens",
                timing="CUDA events; prefill: median of 5 forwards (logits of the last token only); decode: "
                       "mean over N CUDA-graph replays incl. greedy argmax, after 3 warm-up steps",
                rows=[])
    rows = meta["rows"]
    stamp = dict(gpu=meta["gpu"], torch=meta["torch"], triton=meta["triton"])

    def save():
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(meta, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(e2e_markdown(meta))

    def over_budget():
        return __import__("time").time() - t_start > args.budget_s

    def attempt(label, fn):
        try:
            return fn()
        except Exception as e:  # one failed variant (e.g. out of memory) must not lose the others
            print(f"  {label}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            torch.cuda.empty_cache()
            return None

    m, wcfg = e2e_model(max_seq_len=max(E2E_CONTEXTS) + 256)
    calibrate_routers(m, 0.5)
    m.set_backend("triton")
    cfg, wbytes = m.config, weight_bytes(m)
    print(f"model ready ({wbytes / 1e9:.2f} GB of weights read per decode step), "
          f"{__import__('time').time() - t_start:.0f}s", flush=True)

    # prefill
    saved = routers_off(m)
    dense_ms = attempt("prefill dense", lambda: time_prefill(m, E2E_PREFILL))
    routers_on(m, saved)
    wide_ms = attempt("prefill wide", lambda: time_prefill(m, E2E_PREFILL))
    if dense_ms and wide_ms:
        head = cfg.vocab_size * cfg.dim  # linear FLOPs (the head for the last token only) + causal attention
        flops = (2 * (wbytes / 2 - head) * E2E_PREFILL + 2 * head
                 + 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * E2E_PREFILL ** 2)
        rows.append(dict(phase="prefill", batch=1, context=E2E_PREFILL, dense_ms=dense_ms, wide_ms=wide_ms,
                         dense_tok_s=E2E_PREFILL / dense_ms * 1e3, wide_tok_s=E2E_PREFILL / wide_ms * 1e3,
                         speedup=dense_ms / wide_ms, dense_TFLOPs=flops / dense_ms / 1e9, **stamp))
        print("  " + fmt_row(rows[-1]), flush=True)
        save()

    # decode
    for batch in E2E_BATCHES:
        for context in E2E_CONTEXTS:
            if over_budget():
                print(f"decode batch {batch} context {context}: skipped (time budget)", flush=True)
                continue
            steps = 40 if batch * context <= 8 * 8192 else 20
            print(f"decode batch {batch}, context {context}", flush=True)
            dense, wide_ = {}, {}
            saved = routers_off(m)
            for attn in ("triton", "sdpa"):
                with policy(DENSE_DECODE_ATTENTION=attn):
                    r = attempt(f"dense ({attn} attention)", lambda: time_decode(m, batch, context, steps))
                if r:
                    dense[attn] = r[0]
            routers_on(m, saved)
            variants = {"default": model_py.SPARSE_DECODE_MAX_TOKENS}
            if batch > model_py.SPARSE_DECODE_MAX_TOKENS:
                variants["all sparse"] = 64
            masks = None
            for name, limit in variants.items():
                with policy(SPARSE_DECODE_MAX_TOKENS=limit):
                    r = attempt(f"wide ({name})", lambda: time_decode(m, batch, context, steps))
                if r:
                    wide_[name], masks = r[0], masks or r[1]
            if not dense or not wide_:
                continue
            d_attn, d_ms = min(dense.items(), key=lambda kv: kv[1])
            w_pol, w_ms = min(wide_.items(), key=lambda kv: kv[1])
            gbytes = wbytes + kv_bytes(cfg, batch, context)
            rows.append(dict(phase="decode", batch=batch, context=context, dense_ms=d_ms, wide_ms=w_ms,
                             dense_tok_s=batch / d_ms * 1e3, wide_tok_s=batch / w_ms * 1e3, speedup=d_ms / w_ms,
                             dense_GBps=gbytes / d_ms / 1e6, dense_copy_frac=gbytes / d_ms / 1e6 / COPY_GBS,
                             dense_attention=d_attn, dense_ms_by_attention=dense, wide_policy=w_pol,
                             wide_ms_by_policy=wide_, bytes_per_step=gbytes, masks=masks, **stamp))
            print("  " + fmt_row(rows[-1]), flush=True)
            save()
    del m
    torch.cuda.empty_cache()

    # realism: the trained small model if there is one, else the small preset with calibrated routers
    if not over_budget():
        attempt("small model", lambda: small_model_rows(args, rows, stamp))
        save()
    meta["wall_s"] = round(__import__("time").time() - t_start)
    save()
    print(e2e_markdown(meta))


@torch.no_grad()
def small_model_rows(args, rows, stamp):
    import wide
    from generate import find_router_checkpoint, generate, routers_off, routers_on
    try:
        path = find_router_checkpoint(args.small_dir, "wide", 0.5)
        m, wcfg = wide.load_wide(path, device=DEVICE, dtype=DT)
        source = f"trained checkpoint {path} (stage {wcfg.stage})"
    except SystemExit:
        m, wcfg = e2e_model("small")
        calibrate_routers(m, 0.5, tokens=512)
        source = "small preset, random weights, calibrated random routers (no trained checkpoint on the GPU machine)"
    m.set_backend("triton")
    cfg = m.config
    prompt = min(128, cfg.max_seq_len // 2)
    new = min(128, cfg.max_seq_len - prompt)
    for batch in (1, 8):
        idx = torch.randint(0, cfg.vocab_size, (batch, prompt), device=DEVICE)
        speed, widths = {}, []
        for name in ("wide", "dense"):
            saved = routers_off(m) if name == "dense" else None
            on_token = None if saved else lambda i, tok: widths.append(wide.last_width(m, wcfg))
            generate(m, idx, 32, on_token=on_token)  # warm-up; for WIDE also the masks it chose
            t = {}
            generate(m, idx, new, timings=t)
            speed[name] = t["decode_s"] / (new - 1) * 1e3
            if saved:
                routers_on(m, saved)
        skip = {k: round(1 - torch.stack([w[k][:, -1].float().mean() for w in widths[1:]]).mean().item(), 4)
                for k in ("attn", "ffn")}
        rows.append(dict(phase="decode (small model)", batch=batch, context=prompt, dense_ms=speed["dense"],
                         wide_ms=speed["wide"], dense_tok_s=batch / speed["dense"] * 1e3,
                         wide_tok_s=batch / speed["wide"] * 1e3, speedup=speed["dense"] / speed["wide"],
                         dense_GBps=(weight_bytes(m) + kv_bytes(cfg, batch, prompt)) / speed["dense"] / 1e6,
                         masks=dict(attn_skip=skip["attn"], ffn_skip=skip["ffn"]), model=source, **stamp))
        print("  " + fmt_row(rows[-1]), flush=True)


def fmt_row(r):
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                     if k not in ("gpu", "torch", "triton"))


E2E_TARGETS = [("decode", 1, "dense decode >= 75% of the copy ceiling", "copy", 0.75),
               ("decode", 1, "WIDE decode, batch 1: >= 1.65x dense (paper 1.55x)", "speedup", 1.65),
               ("prefill", 1, "WIDE prefill, 4096 tokens: >= 1.7x dense (paper 1.68x)", "speedup", 1.7)]


def e2e_markdown(meta):
    rows = meta["rows"]
    out = [f"# WIDE end to end on {meta['gpu']}", "",
           f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, `{meta['command']}`.", "",
           f"Model: {meta['model']}. Routers: {meta['routers']}. Engine: model.py's Triton backend; decode "
           f"steps are CUDA graphs (generate.CUDAGraphDecoder); the dense baseline is the same model with "
           f"its routers removed, in the same engine (cuBLAS linears; decode attention the faster of the "
           f"split-KV Triton kernel with every head on and masked SDPA; prefill attention SDPA's default "
           f"backend). Timing: {meta['timing']}. Dense GB/s = (weights + KV cache read) per step / time, "
           f"against the {meta['copy_GBps']} GB/s copy ceiling.", "",
           "| phase | batch | context | dense tok/s | WIDE tok/s | speedup | dense GB/s (of copy) | "
           "skipped attn / FFN groups | live in batch union attn / FFN |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gbs = f"{r['dense_GBps']:.0f} ({r['dense_GBps'] / meta['copy_GBps']:.0%})" if "dense_GBps" in r else \
            f"{r.get('dense_TFLOPs', 0):.0f} TFLOP/s"
        mk = r.get("masks") or {}
        skip = f"{mk['attn_skip']:.0%} / {mk['ffn_skip']:.0%}" if mk else ""
        union = (f"{mk['attn_union_live']:.0%} / {mk['ffn_union_live']:.0%}"
                 if "attn_union_live" in mk and r["batch"] > 1 else "")
        out.append(f"| {r['phase']} | {r['batch']} | {r['context']} | {r['dense_tok_s']:.1f} | "
                   f"{r['wide_tok_s']:.1f} | {r['speedup']:.2f}x | {gbs} | {skip} | {union} |")
    out += ["", "Variants (ms per step): dense by decode attention, WIDE by policy ('default' = model.py's "
            "SPARSE_DECODE_MAX_TOKENS; 'all sparse' = every pruned linear through its Triton kernel at this "
            "batch):", ""]
    for r in rows:
        if "dense_ms_by_attention" in r:
            out.append(f"- batch {r['batch']}, context {r['context']}: dense "
                       + ", ".join(f"{k} {v:.3f}" for k, v in r["dense_ms_by_attention"].items())
                       + "; WIDE " + ", ".join(f"{k} {v:.3f}" for k, v in r["wide_ms_by_policy"].items()))
        elif "model" in r:
            out.append(f"- {r['phase']}, batch {r['batch']}: {r['model']}")
    out += ["", "Targets:", "", "| target | measured | |", "|---|---|---|"]
    for phase, batch, text, key, goal in E2E_TARGETS:
        vals = [r for r in rows if r["phase"] == phase and r["batch"] == batch]
        if not vals:
            out.append(f"| {text} | not measured | |")
            continue
        got = [(r["dense_copy_frac"] if key == "copy" else r["speedup"], r["context"]) for r in vals]
        shown = ", ".join(f"{v:.0%}" if key == "copy" else f"{v:.2f}x" for v, _ in got)
        ctx = ", ".join(str(c) for _, c in got)
        out.append(f"| {text} | {shown} (context {ctx}) | {'met' if min(v for v, _ in got) >= goal else 'missed'} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["kernels", "tune", "e2e"])
    p.add_argument("--out", default=None, help="output path prefix (.json, .md); default "
                   "results/kernels_h200 (kernels, tune) or results/e2e_h200 (e2e)")
    p.add_argument("--only", default="", help="run only the ops whose name contains this")
    p.add_argument("--budget-s", type=float, default=420, help="e2e: skip the remaining rows after this long")
    p.add_argument("--small-dir", default="out", help="e2e: where to look for a trained router checkpoint")
    args = p.parse_args()
    args.out = args.out or ("results/e2e_h200" if args.what == "e2e" else "results/kernels_h200")
    if not torch.cuda.is_available():
        sys.exit("bench.py needs a CUDA GPU (the kernels' correctness tests run on CPU: pytest)")
    torch.manual_seed(0)
    {"kernels": run_kernels, "tune": run_tune, "e2e": run_e2e}[args.what](args)
