"""
End to end: a Llama-3.1-8B-shaped model (random bf16 weights, wide.Routers whose skip biases are calibrated
to skip half of a random prompt's tokens) through engine.Engine, against the same model with its routers
removed in the same engine, the dense side at its best (the fastest of the ways the engine can run it).

  python -m bench.e2e                            # the default parts -> results/e2e_h200.{json,md}
  python -m bench.e2e --only decode,compile      # a subset: prefill, decode, compile, fp8, small, profile
  python -m bench.e2e --decode 1x1024,32x8192    # other decode rows (batch x context)
  python -m bench.e2e --only fp8 --append        # replace only these parts' rows in results/e2e_h200.*
  TRITON_INTERPRET=1 python -m bench.e2e --smoke # the same code on the CPU: a tiny fp32 model (CI)

Parts: prefill (one 4096-token prompt); decode (CUDA-graph steps over a filled KV cache, with each row's
bytes and byte limit); compile (the dense engine against gpt-fast's torch.compile loop on model.py); fp8
(bf16 and fp8 weights, dense and WIDE); profile (one step op by op, bench/step_profile.py); small (a trained
model, or the small preset, through generate()). --smoke times nothing meaningful and never writes results/.
"""
import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch

import checkpoints
import cli
import engine
import kernels_base
from bench import common, step_profile
from bench.common import (COPY_GBS, SMOKE, ModelSetup, calibrate_routers, clock_ms, fill_cache, mask_summary, meta,
                          random_model, save, with_engine)
from generate import generate
from model import CheckpointError
from policy import Policy
from wide import FFNRule, routers_off, routers_on


@dataclass
class E2ESetup(ModelSetup):
    """What one run measures (the rows below), on bench/common.py's model: the Llama-3.1-8B shape on the GPU,
    or a tiny model (--smoke)."""
    prefill: int = 4096
    decode: list = field(default_factory=lambda: [(1, 1024), (1, 8192), (8, 1024), (32, 8192)])
    fp8_decode: list = field(default_factory=lambda: [(1, 1024), (1, 8192)])
    profile: list = field(default_factory=lambda: [(1, 1024, "bf16"), (1, 1024, "fp8"), (32, 8192, "bf16")])
    compile_context: int = 1024
    steps: int = 40                   # timed decode steps (half of it for batch x context > 64k)
    warmup: int = 3
    small_preset: str = "small"
    small_tokens: tuple = (128, 128)  # prompt, new tokens
    small_batches: tuple = (1, 8)


def smoke_run():
    # One layer, 4 attention groups (2 heads of 16, one KV head each), 4 FFN groups of 32 channels.
    tiny = dict(vocab_size=128, dim=64, n_layers=1, n_heads=8, n_kv_heads=4, head_dim=16,
                intermediate_size=128, max_seq_len=96)
    return E2ESetup(**SMOKE, config=tiny, prefill=32,
               decode=[(1, 24), (6, 24)], fp8_decode=[(1, 24)], profile=[(1, 24, "bf16")], compile_context=24, steps=2, warmup=1, calibrate_tokens=32,
               small_preset=None, small_tokens=(8, 3), small_batches=(2,))


# ----------------------------------------------------------------------------------- bytes a step reads
def weight_bytes(m):
    # What a decode step must read once: every weight except the embedding table (one row per token),
    # which is read in full when it doubles as the head.
    return sum(p.numel() * p.element_size() for n, p in m.named_parameters()
               if "router" not in n and ("embed_tokens" not in n or m.lm_head is None))


def kv_bytes(m, batch, context):
    c = m.config
    return c.n_layers * batch * context * 2 * c.n_kv_heads * c.head_dim * m.embed_tokens.weight.element_size()


def wide_bytes(m, batch, context, masks):
    """The bytes a WIDE step must read at these masks: Q/O weights and the KV cache scale with the
    attention groups live in the batch's union, the FFN weights with the FFN groups'."""
    c, e = m.config, m.embed_tokens.weight.element_size()
    attn, ffn = masks["attn_union_live"], masks["ffn_union_live"]
    qo, f = 2 * c.dim * c.n_heads * c.head_dim * e, 3 * c.dim * c.intermediate_size * e
    return weight_bytes(m) - c.n_layers * ((1 - attn) * qo + (1 - ffn) * f) - (1 - attn) * kv_bytes(m, batch, context)


# ----------------------------------------------------------------------------------- timing
def fmt_row(r, skip=("gpu", "torch", "triton")):
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items() if k not in skip)


class EagerDecoder:
    """engine.CUDAGraphDecoder's interface without the graph, for --smoke on the CPU (no CUDA graphs there)."""

    def __init__(self, model, token, pos):
        self.model, self.masks = model, {}

    def __call__(self, token, pos):
        self.masks.clear()
        return self.model(token, input_pos=pos.view(-1, 1), masks=self.masks)[:, -1]


@torch.no_grad()
def time_prefill(run, e, T, reps=5):
    """ms of one prompt of T tokens at positions 0..T-1 into the static cache, logits of its last token."""
    e.setup_caches(1, T)
    idx = torch.randint(0, e.config.vocab_size, (1, T), device=run.device)
    pos, last = torch.arange(T, device=run.device), torch.tensor([T - 1], device=run.device)
    step = lambda n: [e(idx, input_pos=pos, logits_at=last) for _ in range(n)]
    step(1 if run.smoke else 2)
    times = sorted(clock_ms(run.smoke, step, 1) for _ in range(1 if run.smoke else reps))
    e.clear_caches()
    return times[len(times) // 2]


@torch.no_grad()
def time_decode(run, e, batch, context, steps):
    """ms per decode step (batch new tokens) as generate() runs it: graph replay, greedy argmax, next
    position. Also the masks the routers chose: the skipped share and the share live in the batch's union.
    The tokens fed are one drawn sequence per (batch, context), the same for every engine and policy timed, so
    their masks differ only where a router's decision sits at a tie (feeding each step's own argmax instead let
    one engine's rounding send the next tokens, and so every later mask, elsewhere: an A/B of unequal work)."""
    e.setup_caches(batch, context + steps + run.warmup + 8)
    fill_cache(e.model, context)
    gen = torch.Generator().manual_seed(batch * 100003 + context)
    tokens = torch.randint(0, e.config.vocab_size, (run.warmup + steps, batch, 1), generator=gen).to(run.device)
    pos = torch.full((batch,), context, device=run.device)
    graph = (EagerDecoder if run.smoke else engine.CUDAGraphDecoder)(e, tokens[0], pos)
    state = dict(i=0)

    def go(n):
        for _ in range(n):
            graph(tokens[state["i"]], pos).argmax(-1, keepdim=True)  # greedy's work; its token is not fed back
            state["i"] += 1
            pos.add_(1)
    go(run.warmup)
    ms = clock_ms(run.smoke, go, steps)
    masks = mask_summary(graph.masks, batch)
    del graph
    e.clear_caches()
    return ms, masks


@torch.no_grad()
def time_compiled(run, m, context, steps):
    """gpt-fast's decode loop on model.py itself (batch 1, static KV cache): ms per step, and the
    seconds the compilation and warm-up took."""
    def decode_one_token(model, token, pos):  # token [1, 1], pos [1]
        return model(token, input_pos=pos)[:, -1].argmax(-1, keepdim=True)

    # CUDA graphs by torch.compile on the GPU; --smoke traces the same function (fullgraph) without them.
    step = torch.compile(decode_one_token, backend="eager", fullgraph=True) if run.smoke else \
        torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
    m.setup_caches(1, context + steps + run.warmup + 8)
    fill_cache(m, context)
    state = dict(token=torch.randint(0, m.config.vocab_size, (1, 1), device=run.device))
    pos = torch.tensor([context], device=run.device)

    def go(n):
        for _ in range(n):
            state["token"] = step(m, state["token"], pos).clone()
            pos.add_(1)
    t = time.perf_counter()
    go(run.warmup)
    compile_s = time.perf_counter() - t
    ms = clock_ms(run.smoke, go, steps)
    m.clear_caches()
    return ms, compile_s


# ----------------------------------------------------------------------------------- rows
def prefill_row(run, m, T):
    dense = with_engine(m, False, Policy(), lambda e: time_prefill(run, e, T))
    wide_ms = with_engine(m, True, Policy(), lambda e: time_prefill(run, e, T))
    c = m.config
    head = c.vocab_size * c.dim  # linear FLOPs (the head for the last token only) + causal attention
    flops = 2 * (weight_bytes(m) / m.embed_tokens.weight.element_size() - head) * T + 2 * head \
        + 2 * c.n_layers * c.n_heads * c.head_dim * T ** 2
    return dict(phase="prefill", batch=1, context=T, dense_ms=dense, wide_ms=wide_ms, dense_tok_s=T / dense * 1e3,
                wide_tok_s=T / wide_ms * 1e3, speedup=dense / wide_ms, dense_TFLOPs=flops / dense / 1e9,
                dense_GBps=weight_bytes(m) / dense / 1e6)  # weights read once: not the limit here, FLOPs are


def decode_row(run, m, batch, context, log):
    steps = run.steps if batch * context <= 64 * 1024 else max(1, run.steps // 2)
    dense, wide_ms, masks = {}, {}, None
    # The dense side at its best: each decode attention, the unrouted linears through cuBLAS or through WIDE's
    # kernels with every group live (steps of <= Policy.dense_gemv_max_tokens tokens), and launches with and
    # without programmatic dependent launch (kernels_base.pdl); the fastest is the row's dense time.
    small = batch <= Policy().sparse_decode_max_tokens
    dense_policies = {"triton": Policy(), "sdpa": Policy(dense_decode_attention="sdpa")}
    if batch <= Policy().dense_gemv_max_tokens:
        dense_policies["cublas linears"] = Policy(dense_gemv_max_tokens=0)
    for name, pol in dense_policies.items():
        dense[name] = with_engine(m, False, pol, lambda e: time_decode(run, e, batch, context, steps)[0])
        log(f"  dense ({name}): {dense[name]:.3f} ms")
    best = dense_policies[min(dense, key=dense.get)]
    pdl = kernels_base.pdl(torch.device(run.device)) > 0  # else 'PDL off' would be the same run again
    if pdl:
        with kernels_base.pdl_off():
            dense["PDL off"] = with_engine(m, False, best, lambda e: time_decode(run, e, batch, context, steps)[0])
        log(f"  dense (its best without PDL): {dense['PDL off']:.3f} ms")
    policies = {"default": Policy()}
    if not small:
        policies["all sparse"] = Policy(sparse_decode_max_tokens=64)
    if batch == 1:  # the router's rule left in norm_route (its ticket and last program) instead of the GEMV's
        policies["rule in norm_route"] = Policy(router_rule_in_gemv=False)
    if batch > Policy().sparse_decode_max_tokens:  # where Q, K, V run for every head: the router beside them
        policies["router side stream"] = Policy(router_side_stream=True)
    for name, pol in policies.items():
        wide_ms[name], got = with_engine(m, True, pol, lambda e: time_decode(run, e, batch, context, steps))
        masks = masks or got
        log(f"  WIDE ({name}): {wide_ms[name]:.3f} ms, masks {got}")
    if pdl:
        with kernels_base.pdl_off():
            wide_ms["PDL off"] = with_engine(m, True, Policy(),
                                             lambda e: time_decode(run, e, batch, context, steps)[0])
        log(f"  WIDE (default, without PDL): {wide_ms['PDL off']:.3f} ms")
    # The vote rule (wide.FFNRule, off by default: it changes what a token computes), timed on the side:
    # an FFN group runs for the whole batch iff >= k rows want it. Never the row's headline WIDE time.
    votes = {}
    for k in (batch // 4, batch // 2) if batch > Policy().sparse_decode_max_tokens else ():
        m.ffn_rule = FFNRule(vote=k)
        try:
            ms, got = with_engine(m, True, Policy(), lambda e: time_decode(run, e, batch, context, steps))
        finally:
            m.ffn_rule = FFNRule()
        votes[k] = dict(ms=ms, speedup=min(dense.values()) / ms, ffn_union_live=got["ffn_union_live"])
        log(f"  WIDE, vote k={k}: {ms:.3f} ms, FFN groups live {got['ffn_union_live']:.1%}")
    d_attn, d_ms = min(dense.items(), key=lambda kv: kv[1])
    w_pol, w_ms = min(wide_ms.items(), key=lambda kv: kv[1])
    nbytes = weight_bytes(m) + kv_bytes(m, batch, context)
    return dict(phase="decode", batch=batch, context=context, dense_ms=d_ms, wide_ms=w_ms,
                dense_tok_s=batch / d_ms * 1e3, wide_tok_s=batch / w_ms * 1e3, speedup=d_ms / w_ms,
                dense_GBps=nbytes / d_ms / 1e6, dense_copy_frac=nbytes / d_ms / 1e6 / COPY_GBS,
                byte_limit_speedup=nbytes / wide_bytes(m, batch, context, masks), bytes_per_step=nbytes,
                dense_policy=d_attn, dense_ms_by_policy=dense, wide_policy=w_pol,
                wide_ms_by_policy=wide_ms, masks=masks, steps=steps, ffn_vote=votes)


# fp8_row's engines: name -> (routers, weights, policy). Each dense side at its best: bf16 through WIDE's kernels
# with every group live or through cuBLAS; fp8 through _scaled_mm (fp8 tensor cores, each token's input quantized in
# the step, as stock fp8 serving runs) or through WIDE's kernels on the weight codes (weights only).
FP8_ENGINES = {"dense bf16 (WIDE kernels)": (False, "bf16", Policy()),
               "dense bf16 (cuBLAS)": (False, "bf16", Policy(dense_gemv_max_tokens=0)),
               "dense fp8 (_scaled_mm)": (False, "fp8", Policy()),
               "dense fp8 (_scaled_mm, per-tensor)": (False, "fp8", Policy(fp8_tensorwise_one_token=True)),
               "dense fp8 (WIDE kernels)": (False, "fp8", Policy(fp8_scaled_mm_min_tokens=1 << 30)),
               "WIDE bf16": (True, "bf16", Policy()), "WIDE fp8": (True, "fp8", Policy())}


def fp8_row(run, m, batch, context, log):
    """One decode shape, dense and WIDE, with the model's weights and with fp8 weights (FP8_ENGINES); the row's
    "dense bf16" and "dense fp8" are each the faster of its two ways."""
    ms = {}
    for name, (routers, weights, pol) in FP8_ENGINES.items():
        ms[name] = with_engine(m, routers, pol, lambda e: time_decode(run, e, batch, context, run.steps)[0], weights)
        log(f"  {name}: {ms[name]:.3f} ms")
    for side in ("dense bf16", "dense fp8"):
        ms[side] = min(v for k, v in ms.items() if k.startswith(side + " ("))
    return dict(phase="decode fp8", batch=batch, context=context, ms=ms,
                tok_s={k: batch / v * 1e3 for k, v in ms.items()},
                wide_fp8_vs_dense_fp8=ms["dense fp8"] / ms["WIDE fp8"],
                wide_fp8_vs_dense_bf16=ms["dense bf16"] / ms["WIDE fp8"],
                dense_fp8_vs_dense_bf16=ms["dense bf16"] / ms["dense fp8"],
                wide_bf16_vs_dense_bf16=ms["dense bf16"] / ms["WIDE bf16"])


def compile_row(run, m, rows, log):
    """The dense engine against torch.compile(mode="reduce-overhead") on model.py, same weights, batch 1."""
    ctx = run.compile_context
    same = next((r for r in rows if r["phase"] == "decode" and r["batch"] == 1 and r["context"] == ctx), None)
    if same:
        e_ms = same["dense_ms"]
    else:
        e_ms = with_engine(m, False, Policy(), lambda e: time_decode(run, e, 1, ctx, run.steps)[0])
    saved = routers_off(m)
    try:
        c_ms, compile_s = time_compiled(run, m, ctx, run.steps)
    finally:
        routers_on(m, saved)
    log(f"  dense engine {e_ms:.3f} ms, torch.compile {c_ms:.3f} ms (compiled in {compile_s:.0f} s)")
    nbytes = weight_bytes(m) + kv_bytes(m, 1, ctx)
    return dict(phase="decode: dense engine vs torch.compile", batch=1, context=ctx, dense_ms=e_ms,
                compiled_ms=c_ms, dense_tok_s=1e3 / e_ms, compiled_tok_s=1e3 / c_ms, engine_vs_compiled=c_ms / e_ms,
                dense_GBps=nbytes / e_ms / 1e6, dense_copy_frac=nbytes / e_ms / 1e6 / COPY_GBS,
                compiled_GBps=nbytes / c_ms / 1e6, compile_s=round(compile_s, 1), bytes_per_step=nbytes)


def trained_small_model(run, out_dir):
    """The trained router checkpoint nearest 50% under out_dir: (model, source), or None if there is none."""
    try:
        path = checkpoints.nearest_checkpoint(out_dir, "wide", 0.5)
        m, wcfg = checkpoints.load_wide(path, device=run.device, dtype=run.dtype)
    except CheckpointError:
        return None
    return m, f"trained checkpoint {path} (stage {wcfg.stage})"


@torch.no_grad()
def small_rows(run, args):
    """Masks from a trained router where one exists: generate() with the small trained model."""
    found = None if run.smoke else trained_small_model(run, args.small_dir)  # --smoke: the tiny model only
    if found:
        m, source = found
    else:
        m, _ = random_model(run, run.small_preset)
        calibrate_routers(m, 0.5, run.calibrate_tokens // 2)
        source = "random weights, calibrated random routers (no trained checkpoint found)"
    cfg, rows = m.config, []
    prompt, new = run.small_tokens
    for batch in run.small_batches:
        idx = torch.randint(0, cfg.vocab_size, (batch, prompt), device=run.device)
        speed, live = {}, []
        for name in ("wide", "dense"):
            saved = routers_off(m) if name == "dense" else None
            e = engine.Engine(m)
            # WIDE: the share of groups each decode step ran (i = 0 is the prefill's token)
            on_token = None if saved else (lambda i, tok, masks: i > 0 and live.append(
                {k: torch.stack([x.float().mean() for x in masks[k]]).mean().item() for k in ("attn", "ffn")}))
            generate(e, idx, min(new, 32), on_token=on_token)  # warm-up; for WIDE also the masks it chose
            t = {}
            generate(e, idx, new, timings=t)
            speed[name] = t["decode_s"] / max(1, new - 1) * 1e3
            if saved:
                routers_on(m, saved)
        skip = {f"{k}_skip": round(1 - sum(w[k] for w in live) / max(1, len(live)), 4) for k in ("attn", "ffn")}
        nbytes = weight_bytes(m) + kv_bytes(m, batch, prompt)
        rows.append(dict(phase="decode (small model)", batch=batch, context=prompt, dense_ms=speed["dense"],
                         wide_ms=speed["wide"], dense_tok_s=batch / speed["dense"] * 1e3,
                         wide_tok_s=batch / speed["wide"] * 1e3, speedup=speed["dense"] / speed["wide"],
                         dense_GBps=nbytes / speed["dense"] / 1e6, masks=skip, model=source))
    return rows


# The end-to-end speed targets: (text, phase, batch, contexts or None for any, row key, goal).
TARGETS = [
    ("dense engine decode, batch 1, share of the copy ceiling", "decode", 1, None, "dense_copy_frac", 0.80),
    ("WIDE decode batch 1 (ctx 1k and 8k) vs that dense engine", "decode", 1, None, "speedup", 1.65),
    ("WIDE prefill 4096 vs dense (O and down dense: ceiling 1.47x)", "prefill", 1, None, "speedup", 1.40),
    ("WIDE decode batch 8, ctx 1k (mask union ~100%)", "decode", 8, (1024,), "speedup", 1.00),
    ("WIDE decode batch 32, ctx 8k (KV-head skipping)", "decode", 32, (8192,), "speedup", 1.40),
]


# The fp8 targets (quantized weights with dynamic width), on the "decode fp8" rows: (text, key, contexts, goal).
FP8_TARGETS = [
    ("dense fp8 (at its best) vs dense bf16 (at its best), batch 1", "dense_fp8_vs_dense_bf16", (1024,), 1.55),
    ("WIDE fp8 vs dense fp8 (at its best), batch 1", "wide_fp8_vs_dense_fp8", (1024, 8192), 1.45),
    ("WIDE fp8 vs dense bf16 (at its best), batch 1", "wide_fp8_vs_dense_bf16", (1024,), 2.2),
]


def fp8_markdown(rows):
    rows = [r for r in rows if r["phase"] == "decode fp8"]
    if not rows:
        return []
    names = [n for n in rows[0]["tok_s"] if n not in ("dense bf16", "dense fp8")]
    out = ["", "fp8 weights (engine.Engine(weights=\"fp8\"): Q, K, V, O, gate, up, down as e4m3 with one scale per "
           "output channel; embeddings and head stay bf16). WIDE's decode kernels read the live groups' codes (weights "
           "only); the dense side runs either _scaled_mm (fp8 tensor cores, each token's input quantized in the step: "
           "stock fp8) or WIDE's kernels with every group live, and its best is the ratios' 'dense fp8' (bf16 likewise: "
           "WIDE's kernels or cuBLAS). Decode tok/s:", "",
           "| batch | context | " + " | ".join(names) + " | WIDE fp8 / dense fp8 | WIDE fp8 / dense bf16 | "
           "dense fp8 / dense bf16 |", "|---|---|" + "---|" * (len(names) + 3)]
    for r in rows:
        out.append(f"| {r['batch']} | {r['context']} | " + " | ".join(f"{r['tok_s'][k]:.1f}" for k in names)
                   + f" | {r['wide_fp8_vs_dense_fp8']:.2f}x | {r['wide_fp8_vs_dense_bf16']:.2f}x | "
                   f"{r['dense_fp8_vs_dense_bf16']:.2f}x |")
    out += ["", "fp8 targets (H200, batch 1, 50% of groups skipped):", "", "| target | measured | goal | |",
            "|---|---|---|---|"]
    for text, key, contexts, goal in FP8_TARGETS:
        got = [r for r in rows if r["batch"] == 1 and r["context"] in contexts]
        vals = ", ".join(f"{r[key]:.2f}x (ctx {r['context']})" for r in got) or "not measured"
        verdict = ("met" if min(r[key] for r in got) >= goal else "missed") if got else ""
        out.append(f"| {text} | {vals} | >= {goal:.2f}x | {verdict} |")
    return out


def markdown(m):
    rows = m["rows"]
    pct = lambda v: f"{v:.0%}"
    out = [f"# WIDE end to end on {m['gpu']}", "",
           f"torch {m['torch']}, triton {m['triton']}, {m['date']}, `{m['command']}`, {m.get('wall_s', '?')} s.", ""]
    cmds = m.get("commands", {})
    if len(set(cmds.values())) > 1:  # --append: parts measured by other commands (each row: its own versions)
        out += ["Rows by part: " + "; ".join(f"{p}: `{c}`" for p, c in cmds.items()) + ".", ""]
    out += [f"Model: {m['model']}. Routers: {m['routers']}. Engine: engine.Engine for both sides; the dense side "
           "is the same model with its routers removed (decode attention: the faster of the split-KV Triton "
           "kernel with every head on and SDPA; prefill attention: SDPA's default backend). Decode steps are "
           f"CUDA graphs (engine.CUDAGraphDecoder) with greedy argmax. Dense GB/s = (weights + KV cache) per "
           f"step / dense time, against the {COPY_GBS} GB/s copy ceiling; byte limit = the bytes dense reads / "
           "the bytes WIDE must read at the masks its routers chose (the batch's union of live groups).", "",
           "| phase | batch | context | dense tok/s | WIDE tok/s | speedup | byte limit | dense GB/s (of copy) | "
           "skipped attn / FFN | live in batch union attn / FFN |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "wide_ms" not in r:
            continue
        mk = r.get("masks") or {}
        rate = f"{r['dense_GBps']:.0f} ({pct(r['dense_GBps'] / COPY_GBS)})" if r["phase"] != "prefill" \
            else f"({r['dense_TFLOPs']:.0f} TFLOP/s)"
        skip = f"{pct(mk['attn_skip'])} / {pct(mk['ffn_skip'])}" if mk else ""
        union = f"{pct(mk['attn_union_live'])} / {pct(mk['ffn_union_live'])}" if "attn_union_live" in mk else ""
        limit = f"{r['byte_limit_speedup']:.2f}x" if "byte_limit_speedup" in r else ""
        out.append(f"| {r['phase']} | {r['batch']} | {r['context']} | {r['dense_tok_s']:.1f} | {r['wide_tok_s']:.1f} | "
                   f"{r['speedup']:.2f}x | {limit} | {rate} | {skip} | {union} |")
    out += ["", "Variants (ms per step): dense by policy ('triton' / 'sdpa' = the decode attention, 'cublas linears' = "
            "the linears through cuBLAS instead of WIDE's kernels with every group live, 'PDL off' = the best of those launched "
            "without programmatic dependent launch); WIDE by policy ('default' = Policy(); 'all sparse' = Q and "
            "O through their kernels at this batch, the FFN as the batch rule says; 'rule in norm_route' = batch 1 with "
            "the routers' rule applied by norm_route instead of the GEMV after it; 'router side stream' = the router's "
            "decision on a side stream beside Q, K, V (Policy.router_side_stream); 'PDL off' = default without it):",
            ""]
    for r in rows:
        if "dense_ms_by_policy" in r:
            out.append(f"- batch {r['batch']}, context {r['context']}: dense "
                       + ", ".join(f"{k} {v:.3f}" for k, v in r["dense_ms_by_policy"].items())
                       + "; WIDE " + ", ".join(f"{k} {v:.3f}" for k, v in r["wide_ms_by_policy"].items())
                       + "".join(f"; vote rule k={k}: {v['ms']:.3f} ({v['speedup']:.2f}x dense, FFN groups live "
                                 f"{v['ffn_union_live']:.0%})" for k, v in r.get("ffn_vote", {}).items()))
        elif "model" in r:
            out.append(f"- {r['phase']}, batch {r['batch']}: {r['model']}")
    for r in rows:
        if "compiled_ms" in r:
            out += ["", f"Dense engine against gpt-fast's recipe on the same weights (model.py forward, routers off, "
                    f"static KV cache, torch.compile(mode=\"reduce-overhead\", fullgraph=True), batch 1, context "
                    f"{r['context']}): engine {r['dense_tok_s']:.1f} tok/s ({r['dense_GBps']:.0f} GB/s, "
                    f"{pct(r['dense_copy_frac'])} of copy), torch.compile {r['compiled_tok_s']:.1f} tok/s "
                    f"({r['compiled_GBps']:.0f} GB/s); the engine is {r['engine_vs_compiled']:.2f}x the compiled loop "
                    f"(compilation and warm-up {r['compile_s']:.0f} s)."]
    out += ["", "Targets (H200, bf16, 50% of groups skipped):", "",
            "| target | measured | goal | |", "|---|---|---|---|"]
    for text, phase, batch, contexts, key, goal in TARGETS:
        got = [r for r in rows if r["phase"] == phase and r["batch"] == batch and key in r
               and (contexts is None or r["context"] in contexts)]
        show = (lambda v: pct(v)) if key == "dense_copy_frac" else (lambda v: f"{v:.2f}x")
        if not got:
            out.append(f"| {text} | not measured | >= {show(goal)} | |")
            continue
        vals = ", ".join(f"{show(r[key])} (ctx {r['context']})" for r in got)
        out.append(f"| {text} | {vals} | >= {show(goal)} | {'met' if min(r[key] for r in got) >= goal else 'missed'} |")
    out += fp8_markdown(rows)
    return "\n".join(out) + "\n"


PARTS = ("prefill", "decode", "compile", "fp8", "small", "profile")


def part_of(row):
    # Which part of the run wrote a row (--append replaces the rows of the parts it runs).
    if "compiled_ms" in row:
        return "compile"
    return {"prefill": "prefill", "decode fp8": "fp8", "decode (small model)": "small"}.get(row["phase"], "decode")


def read_results(path):
    """--append: the rows (and commands) of an earlier run's results file; one line if it is not one."""
    if not os.path.exists(path):
        return dict(rows=[], commands={}, command=None)
    try:
        with open(path) as f:
            old = json.load(f)
        assert isinstance(old["rows"], list) and old["command"]
    except (ValueError, KeyError, TypeError, AssertionError):
        cli.fail(f"--append: {path} is not a results file of this script; move it away or run without --append")
    return old


def merge(record, rows, old):
    """record's rows: the old file's rows of the parts this run has not produced yet (a part that fails or
    runs out of budget keeps its old rows), then this run's; each part names the command that measured it."""
    new_parts = {part_of(r) for r in rows}
    kept = [r for r in old["rows"] if part_of(r) not in new_parts]
    record["rows"] = kept + rows
    record["commands"] = {**{part_of(r): old.get("commands", {}).get(part_of(r), old["command"]) for r in kept},
                          **{p: record["command"] for p in new_parts}}


def e2e_meta(run, args, argv):
    return meta(run.smoke, "-m bench.e2e", argv, copy_GBps=COPY_GBS, budget_s=args.budget_s,
                policy=repr(Policy()), rows=[],
                model=f"{run.preset if not run.smoke else 'tiny (--smoke)'} shape, random {str(run.dtype)[6:]} "
                      f"weights (std 0.02); attention groups = one KV head's query heads, FFN groups of "
                      f"{run.ffn_group_size} channels",
                routers="wide.Router (fp32, its own init); each group's skip bias shifted to skip half of a random "
                        f"{run.calibrate_tokens}-token prompt's tokens (2 passes)",
                timing="CUDA events; prefill: median of 5 forwards; decode: mean over N graph replays after "
                       f"{run.warmup} warm-up steps")


def model_rows(run, parts, add, rows, log, record, out):
    """The parts measured on the 8B-shaped model (all but "small"), in the order of the README's table."""
    longest = max([c for _, c in run.decode + run.fp8_decode] + [c for _, c, _ in run.profile]
                  + [run.prefill, run.compile_context]) + run.steps + 64
    m, _ = random_model(run, max_seq_len=longest)
    calibrate_routers(m, 0.5, run.calibrate_tokens)
    log(f"model ready: {weight_bytes(m) / 1e9:.2f} GB of weights read per decode step")
    if "prefill" in parts:
        add(lambda: prefill_row(run, m, run.prefill), f"prefill {run.prefill}")
    for batch, context in run.decode if "decode" in parts else []:
        add(lambda: decode_row(run, m, batch, context, log), f"decode batch {batch}, context {context}")
        if "compile" in parts and (batch, context) == (1, run.compile_context):
            add(lambda: compile_row(run, m, rows, log), "compile: dense engine vs torch.compile")
    for batch, context in run.fp8_decode if "fp8" in parts else []:
        add(lambda: fp8_row(run, m, batch, context, log), f"decode fp8 batch {batch}, context {context}")
    if "compile" in parts and not any("compiled_ms" in r for r in rows):
        add(lambda: compile_row(run, m, rows, log), "compile: dense engine vs torch.compile")
    if "profile" in parts:  # its own results file (bench/step_profile.py), last: it recalibrates the routers
        add(lambda: step_profile.profile_rows(run, m, record, step_profile.profile_out(out), log),
            "profile: one decode step, op by op")


def run_e2e(run, args, argv):
    t_start = time.time()
    log = lambda text: print(f"[{time.time() - t_start:5.0f}s] {text}", flush=True)
    # (--smoke runs the fp8 part when asked for it, --only fp8; its default set is the bf16 parts)
    parts = args.only or [p for p in PARTS if not (run.smoke and p == "fp8")]
    record = e2e_meta(run, args, argv)
    rows = []  # this run's rows; --append: merged after the file's
    old = read_results(args.out + ".json") if args.append else dict(rows=[], commands={}, command=None)

    def publish():
        merge(record, rows, old)
        save(args.out, record, markdown(record))

    def add(make, label):
        # One row (or list of rows), published as soon as it is measured.
        if time.time() - t_start > args.budget_s:
            log(f"{label}: skipped (time budget of {args.budget_s:.0f} s spent)")
            return
        log(label)
        try:
            got = make()
        except Exception as e:  # one failed row (e.g. out of memory) must not lose the others
            if run.smoke:
                raise
            log(f"  {label}: failed: {type(e).__name__}: {str(e)[:300]}")
            torch.cuda.empty_cache()
            return
        for r in got if isinstance(got, list) else [got]:
            rows.append(dict(r, gpu=record["gpu"], torch=record["torch"], triton=record["triton"]))
            log("  " + fmt_row(rows[-1]))
        record["wall_s"] = round(time.time() - t_start)
        publish()

    if set(parts) - {"small"}:
        model_rows(run, parts, add, rows, log, record, args.out)  # (the 8B-shaped model is freed when it returns)
    if "small" in parts:
        if not run.smoke:
            torch.cuda.empty_cache()
        add(lambda: small_rows(run, args), "small model (masks from a trained router if there is one)")
    record["wall_s"] = round(time.time() - t_start)
    publish()
    print(markdown(record) + f"\nwritten: {args.out}.json, {args.out}.md")
    return record


# ----------------------------------------------------------------------------------- the command line
def parts_list(text):
    """--only: comma-separated parts, each one of PARTS."""
    parts = [x for x in text.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"{text!r}: the parts are {', '.join(PARTS)}")
    return parts


def decode_rows(text):
    """--decode: rows as BATCHxCONTEXT, comma-separated, each a whole number >= 1."""
    try:
        rows = [tuple(int(v) for v in bc.lower().split("x")) for bc in text.split(",")]
        assert all(len(bc) == 2 and min(bc) > 0 for bc in rows)
    except (ValueError, AssertionError):
        raise argparse.ArgumentTypeError(f"{text!r}: give rows as BATCHxCONTEXT, e.g. 1x1024,32x8192")
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = common.parser(__doc__, "-m bench.e2e", "e2e_h200")
    p.add_argument("--only", type=parts_list, default=None,
                   help=f"comma-separated parts to run, of: {', '.join(PARTS)} (default all)")
    p.add_argument("--decode", type=decode_rows, default=None,
                   help="decode rows as BxC,BxC (default 1x1024,1x8192,8x1024,32x8192)")
    p.add_argument("--budget-s", type=cli.real(0, lo_open=True), default=420, help="start no new row after this "
                   "many seconds")
    p.add_argument("--small-dir", default="out", help="where to look for a trained router checkpoint")
    p.add_argument("--append", action="store_true", help="keep the rows of the parts not run from the --out file")
    p.add_argument("--redraw-profile", metavar="JSON", default=None, help="measure nothing: rewrite the .md and .png "
                   "of a decode profile (results/decode_profile_*.json) from its .json")
    args = p.parse_args(argv)
    if args.redraw_profile:
        return step_profile.redraw(args.redraw_profile)
    common.prepare(args, "-m bench.e2e", argv, "e2e_h200")
    run = smoke_run() if args.smoke else E2ESetup()
    run.decode = args.decode or run.decode
    return run_e2e(run, args, argv)


if __name__ == "__main__":
    cli.run(main)
