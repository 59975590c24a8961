"""
Where the time of one decode step goes, op by op: `python -m bench.e2e --only profile` ->
results/decode_profile_h200.{json,md,png} (bench/e2e.py's model and routers; this file holds the profile itself;
`python -m bench.e2e --redraw-profile results/decode_profile_h200.json` rewrites the .md and .png from the .json).

For each (batch, context, weights) of Run.profile and each router profile (dense, WIDE at the bench's
calibration, and at batch >= 8 the attention-leaning 75/25 routers), one decode step is captured as a CUDA
graph (engine.CUDAGraphDecoder, as generate() and serve.py replay it) and replayed under torch.profiler.
Every GPU kernel of one replay is assigned to the op of the engine's plan (policy.py) that launched it:
Triton kernels by name, a cuBLAS GEMM to the next op the plan sends to cuBLAS, and the small torch kernels
(casts, element-wise ops) to the op running when they start. Per op, summed over the layers:
  us      the op's kernel time in one step
  gap us  the idle time before each of the op's kernels, from the previous kernel's end (launch gaps)
  MB      the bytes the op must read at the masks the routers chose (weights at the batch's union of live
          groups where the kernel skips, the KV cache at each row's live KV heads), from the plan's op kinds
  GB/s    MB / us: against the copy ceiling (bench/common.py COPY_GBS)
The step time is CUDA-event time per replay; 'byte-ideal' is the step's MB at the copy ceiling.
"""
import json
import os

import torch

import cli
import engine
from bench.common import COPY_GBS, calibrate_routers, clock_ms, fill_cache, mask_summary, save, set_profile, with_engine
from policy import Policy

# Library kernels that start an op the plan sends to cuBLAS or SDPA (the rest: casts, element-wise, reductions);
# SDPA's fused attention is FlashAttention's, cuDNN's (named ..._flash_...) or the memory-efficient one (fmha_...)
GEMM_NAMES = ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "flash", "fmha")


def is_gemm(name):
    # this project's Triton kernels are named _..._kernel; a library GEMM (or SDPA's fused attention) is not
    n = name.lower()
    return not name.startswith("_") and any(g in n for g in GEMM_NAMES) and "splitkreduce" not in n


def op_sequence(plan):
    """[(op label, Op)] in launch order: what Engine.inputs builds before the layers (a dense layer's every-head
    layout in a later chunk), the step's embedding, each layer's ops, the final norm, the head."""
    before = ("step_every_head", "step_embed")
    seq = [("embedding" if name == "step_embed" else name, plan.step[name]) for name in before if name in plan.step]
    for i, layer in enumerate(plan.layers):
        seq += [(name, op) for name, op in layer.items()]
    seq += [(name, op) for name, op in plan.step.items() if name not in before]
    return seq


def assign_ops(kernels, plan):
    """kernels: [(name, start_us, end_us)] of one step in launch order -> [(op label, name, us, gap_us)].
    Walks the plan's ops in order: a Triton kernel goes to the first op still due to launch it (one on a side
    stream may start after a later op's kernels: it goes back to its op, and the walk goes on); a library
    GEMM to the next op off Triton (cuBLAS, SDPA, torch) that has had none yet, but never past another op with
    Triton launches still due (so a GEMM that comes as two kernels stays with its op); anything else to
    the op of the kernel before it, or to the next op if that one runs on torch alone and this one has made
    all its Triton launches."""
    seq = op_sequence(plan)
    due = [list(op.kernels) for _, op in seq]  # the Triton launches each op has still to make
    gemmed = set()
    at, out, prev_end = 0, [], None
    for name, t0, t1 in kernels:
        # (from the first op still due to launch it: a side stream's kernel may start after later ops' kernels)
        hit = next((i for i in range(len(seq)) for k in due[i] if k in name), None)
        if hit is not None:
            due[hit].remove(next(k for k in due[hit] if k in name))
            if hit < at:  # the side stream's: its op, and the walk stays where it is
                out.append((seq[hit][0], name, t1 - t0, max(0.0, t0 - prev_end)))
                prev_end = max(prev_end, t1)
                continue
            at = hit
        elif is_gemm(name):
            for i in range(at, len(seq)):
                if seq[i][1].runs != "Triton" and i not in gemmed:  # (its own Triton launches come after it)
                    at = i
                    break
                if i > at and due[i]:
                    break
            gemmed.add(at)
        elif not due[at] and at + 1 < len(seq) and seq[at + 1][1].runs == "torch" and at + 1 not in gemmed:
            at += 1  # the next op is torch's alone (the embedding after a later chunk's every-head layout)
            gemmed.add(at)
        out.append((seq[at][0], name, t1 - t0, 0.0 if prev_end is None else max(0.0, t0 - prev_end)))
        prev_end = t1 if prev_end is None else max(prev_end, t1)  # (two streams: the later end)
    return out


def op_bytes(m, plan, batch, context, masks):
    """{op label: bytes one step must read} at these masks (see the module docstring)."""
    c = m.config
    e = m.embed_tokens.weight.element_size()
    D, H, Hkv, d, I = c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate_size
    a_union, f_union = (masks or {}).get("attn_union_live", 1.0), (masks or {}).get("ffn_union_live", 1.0)
    a_row = 1 - (masks or {}).get("attn_skip", 0.0)
    kv = batch * context * 2 * Hkv * d * e
    out = {}

    def add(label, n):
        out[label] = out.get(label, 0.0) + n
    for layer in plan.layers:
        for name, op in layer.items():
            w = 1 if op.weights in ("fp8", "fp8 x fp8") else e  # e4m3 codes: a byte each
            skips = op.kind in ("gemv", "gemv_fused", "gemm_k", "tiles", "tiles_fused")
            if name == "qkv":
                add(name, D * (H * d * (a_union if skips else 1) + 2 * Hkv * d) * w)
            elif name == "o":
                add(name, D * H * d * (a_union if skips else 1) * w)
            elif name == "gate_up":
                add(name, 2 * D * I * (f_union if skips else 1) * w)
            elif name == "down":
                add(name, D * I * (f_union if skips else 1) * w)
            elif name == "attention":
                add(name, kv * (a_row if op.kind == "decode_live" else 1))
    add("step_head", c.vocab_size * D * e)
    return out


def kernel_events(prof):
    """[(name, start_us, end_us)] of the GPU kernels the profiler saw, in start order."""
    ev = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
          if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()
          and "memset" not in e.name.lower()]
    return sorted(ev, key=lambda x: x[1])


def profile_step(decoder, plan, token, pos, replays=3):
    """Kernels of the last of `replays` graph replays, assigned to the plan's ops, and how many the
    replay launched (the step's kernels: the same count each replay)."""
    decoder(token, pos)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            decoder(token, pos)
        torch.cuda.synchronize()
    ev = kernel_events(prof)
    per = len(ev) // replays
    return assign_ops(ev[-per:], plan), per


def summarize(assigned, nbytes, step_ms):
    """Per op: kernels, us, gap us, MB, GB/s; plus the step's totals."""
    ops = {}
    for label, name, us, gap in assigned:
        r = ops.setdefault(label, dict(kernels=0, us=0.0, gap_us=0.0))
        r["kernels"] += 1
        r["us"] += us
        r["gap_us"] += gap
    for label, r in ops.items():
        mb = nbytes.get(label, 0.0) / 1e6
        r.update(us=round(r["us"], 1), gap_us=round(r["gap_us"], 1), MB=round(mb, 1),
                 GBps=round(mb / r["us"] * 1e3) if mb and r["us"] else None)
    kernel_us = sum(r["us"] for r in ops.values())
    total_mb = sum(nbytes.values()) / 1e6
    return dict(ops=ops, step_us=round(step_ms * 1e3, 1), kernel_us=round(kernel_us, 1),
                gap_us=round(sum(r["gap_us"] for r in ops.values()), 1), kernels=len(assigned),
                MB=round(total_mb, 1), byte_ideal_us=round(total_mb / COPY_GBS * 1e3, 1),
                share_of_byte_ideal=round(total_mb / COPY_GBS * 1e3 / (step_ms * 1e3), 3))


LABELS = {"attn_norm": "attention norm (+ router)", "attn_layout": "attention layout", "qkv": "Q, K, V",
          "rope": "RoPE + cache", "attention": "decode attention", "o": "O proj", "ffn_norm": "FFN norm (+ router)",
          "ffn_layout": "FFN layout", "gate_up": "gate + up", "down": "down proj", "embedding": "embedding",
          "step_every_head": "every-head layout", "step_norm": "final norm", "step_head": "lm_head"}


def profile_markdown(record):
    out = [f"# One decode step, op by op ({record['gpu']})", "",
           f"torch {record['torch']}, triton {record['triton']}, {record['date']}, `{record['command']}`. "
           f"{record['model']}. Each step: CUDA-graph replay of generate()'s decode step, kernels from "
           "torch.profiler, assigned to the ops of the engine's plan (bench/step_profile.py). us and gap us are per "
           "step, summed over the layers; MB is what the op must read at the routers' masks; GB/s against the "
           f"{COPY_GBS} GB/s copy ceiling. 'byte-ideal' = the step's MB at the copy ceiling.", ""]
    for s in record["steps"]:
        out += [f"## batch {s['batch']}, context {s['context']}, {s['weights']}: {s['profile']}", "",
                f"step {s['step_us']} us (CUDA events) = kernels {s['kernel_us']} us + gaps {s['gap_us']} us over "
                f"{s['kernels']} kernels; {s['MB']} MB read, byte-ideal {s['byte_ideal_us']} us "
                f"({s['share_of_byte_ideal']:.0%} of it reached). Masks: {s['masks']}", "",
                "| op | kernels | us | gap us | MB | GB/s | share of step |", "|---|---|---|---|---|---|---|"]
        for label, r in s["ops"].items():
            share = (r["us"] + r["gap_us"]) / s["step_us"] if s["step_us"] else 0
            out.append(f"| {LABELS.get(label, label)} | {r['kernels']} | {r['us']} | {r['gap_us']} | {r['MB'] or '-'} "
                       f"| {r['GBps'] or '-'} | {share:.1%} |")
        out.append("")
    return "\n".join(out) + "\n"


# The ops that stream weights (or, in attention, the KV cache): the rest of a step is fixed cost at batch 1
STREAMS = ("qkv", "attention", "o", "gate_up", "down", "step_head")
ORDER = ("embedding", "step_every_head", "attn_norm", "attn_layout", "qkv", "rope", "attention", "o", "ffn_norm",
         "ffn_layout", "gate_up", "down", "step_norm", "step_head")  # as a step runs them


def profile_figure(record):
    """Where each profiled decode step's time goes: a horizontal bar per step (dense and WIDE, one panel per batch,
    context and weights), cut into its ops' time (each op's gaps included), and a black tick at the step's
    byte-ideal time (its bytes at the copy ceiling). Hatched: the ops that stream no weights nor cache."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = list(dict.fromkeys((s["batch"], s["context"], s["weights"]) for s in record["steps"]))
    seen = list(dict.fromkeys(label for s in record["steps"] for label in s["ops"]))
    labels = [label for label in ORDER if label in seen] + [label for label in seen if label not in ORDER]
    legend = {}  # label -> its name, once: the first bar that draws it
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, 1.2 + 0.55 * len(record["steps"]) + 0.5 * len(groups)),
                             squeeze=False)
    for ax, (batch, context, weights) in zip(axes[:, 0], groups):
        steps = [s for s in record["steps"] if (s["batch"], s["context"], s["weights"]) == (batch, context, weights)]
        for y, s in enumerate(steps):
            left = 0.0
            for i, label in enumerate(labels):
                r = s["ops"].get(label)
                if r is None:
                    continue
                width = (r["us"] + r["gap_us"]) / 1e3
                ax.barh(y, width, left=left, color=plt.get_cmap("tab20")(i % 20), edgecolor="white",
                        hatch=None if label in STREAMS else "//",
                        label=None if label in legend else legend.setdefault(label, LABELS.get(label, label)))
                left += width
            ax.plot([s["byte_ideal_us"] / 1e3] * 2, [y - 0.45, y + 0.45], color="black", linewidth=2)
            ax.text(left, y, f" {s['step_us'] / 1e3:.2f} ms ({s['share_of_byte_ideal']:.0%} of byte-ideal)",
                    va="center", fontsize=8)
        ax.set_yticks(range(len(steps)), [s["profile"] for s in steps], fontsize=8)
        ax.set_xlim(0, 1.35 * max(s["step_us"] for s in steps) / 1e3)
        ax.invert_yaxis()
        ax.set_title(f"batch {batch}, context {context}, {weights} weights", fontsize=9)
    axes[-1, 0].set_xlabel(f"ms per decode step (black tick: the step's bytes at {record.get('copy_GBps', COPY_GBS)} "
                           "GB/s, the copy ceiling of bench/common.py)")
    handles = [h for ax in axes[:, 0] for h in ax.get_legend_handles_labels()[0]]
    names = [n for ax in axes[:, 0] for n in ax.get_legend_handles_labels()[1]]
    fig.legend(handles, names, loc="lower center", ncol=6, fontsize=7, frameon=False)
    fig.suptitle(f"One decode step, op by op ({record['gpu']})", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def write_profile(out, record):
    """The profile's .json, .md and .png at `out` (a path prefix)."""
    import matplotlib.pyplot as plt
    save(out, record, profile_markdown(record))
    fig = profile_figure(record)
    fig.savefig(out + ".png", dpi=120)
    plt.close(fig)


def redraw(path):
    """bench.e2e --redraw-profile: the .md and .png of a profile's results file, from its .json (no GPU)."""
    try:
        with open(path) as f:
            record = json.load(f)
        prefix = path[:-len(".json")] if path.endswith(".json") else path
        write_profile(prefix, record)
    except (OSError, ValueError, KeyError, TypeError) as e:
        cli.fail(f"--redraw-profile {path}: not a decode profile's results file ({type(e).__name__}: {e}); give "
                 "its .json, e.g. results/decode_profile_h200.json")
    print(f"rewritten: {prefix}.md, {prefix}.png")
    return record


@torch.no_grad()
def profile_one(run, e, batch, context, replays=20):
    """One decode step of `batch` rows at `context` cached positions through engine e: its profile."""
    e.setup_caches(batch, context + 16)
    fill_cache(e.model, context)
    gen = torch.Generator().manual_seed(batch * 100003 + context)  # the same tokens for every engine profiled
    token = torch.randint(0, e.config.vocab_size, (batch, 1), generator=gen).to(run.device)
    pos = torch.full((batch,), context, device=run.device)
    dec = engine.CUDAGraphDecoder(e, token, pos)  # every replay: the same step (the K/V at `context` rewritten)
    ms = clock_ms(False, lambda n: [dec(token, pos) for _ in range(n)], replays)
    masks = mask_summary(dec.masks, batch)
    plan = e.step_plan(batch, True)
    assigned, _ = profile_step(dec, plan, token, pos)
    out = dict(summarize(assigned, op_bytes(e.model, plan, batch, context, masks), ms), masks=masks,
               kernel_names=sorted({name[:80] for _, name, _, _ in assigned}))
    del dec
    e.clear_caches()
    return out


def profiles_of(batch, weights):
    """(name, (attention, FFN) sparsity or None for dense, policy) of each step profiled at this batch and weight
    format: dense (with fp8 at one token every way dense fp8 runs, as bench/e2e.py's FP8_ENGINES: which one is
    dense at its best), WIDE 50/50, and WIDE 75/25 from batch 8 on."""
    out = [("dense", None, Policy())]
    if weights == "fp8" and batch == 1:
        out += [("dense, _scaled_mm per-tensor", None, Policy(fp8_tensorwise_one_token=True)),
                ("dense, WIDE kernels", None, Policy(fp8_scaled_mm_min_tokens=1 << 30))]
    out += [("WIDE 50/50", (0.5, 0.5), Policy())]
    return out + ([("WIDE 75/25", (0.75, 0.25), Policy())] if batch >= 8 else [])


def profile_rows(run, m, record, out, log):
    """The profile part of bench/e2e.py: every (batch, context, weights) of run.profile, dense and WIDE,
    written to `out` (.json, .md) as it goes; returns no e2e rows. The routers end at the bench's 0.5."""
    if run.smoke:  # CUDA graphs and the profiler's GPU kernels: nothing to profile on the CPU
        log("profile: needs a CUDA GPU (graph replay under torch.profiler); skipped")
        return []
    routers = [(l.attn_router, l.ffn_router, l.layer_router) for l in m.layers]
    rec = dict(record, steps=[])
    try:
        for batch, context, weights in run.profile:
            for name, sparsity, policy in profiles_of(batch, weights):
                if sparsity:
                    set_profile(m, routers, *sparsity, run.calibrate_tokens)
                s = with_engine(m, sparsity is not None, policy,
                                lambda e: profile_one(run, e, batch, context), weights)
                rec["steps"].append(dict(s, batch=batch, context=context, weights=weights, profile=name))
                log(f"  profile batch {batch}, context {context}, {weights}, {name}: step {s['step_us']} us, kernels "
                    f"{s['kernel_us']} us, gaps {s['gap_us']} us, {s['share_of_byte_ideal']:.0%} of byte-ideal")
                write_profile(out, rec)
    finally:
        calibrate_routers(m, 0.5, run.calibrate_tokens)
    return []


def profile_out(e2e_out):
    """results/e2e_h200 -> results/decode_profile_h200 (beside it, whatever the --out)."""
    d, base = os.path.split(e2e_out)
    return os.path.join(d, base.replace("e2e", "decode_profile") if "e2e" in base else base + "_decode_profile")
