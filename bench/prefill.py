"""
Prefill chunks, WIDE against dense, at every chunk length a server runs: `python -m bench.prefill` ->
results/prefill_chunks_h200.{json,md,png}.

A serving loop prefills a long prompt in chunks (serve.py --chunk, 2048 by default), so besides the whole
chunks it runs a remainder of any length, and every chunk after the first starts at a position > 0 where the
chunk attends to the cache before it. For each chunk length T and start S, one forward of T tokens at
positions S..S+T-1 of a one-row cache (filled with random K/V up to S), logits of the last token only, as
Server.prefill runs it: eagerly (no CUDA graph: prefill shapes vary), launches included, timed with CUDA
events (median of 5 after 2 warm-ups). The profiles: dense (the routers removed, the engine's dense path at
its best) and WIDE with the serving benchmark's two calibrations (bench/serving.py).

Each row also has the op breakdown of one forward (torch.profiler, kernels assigned to the plan's ops as in
bench/step_profile.py), so a length where WIDE loses says which op loses.
"""
import sys

import torch

import cli
from bench import common
from bench.common import SMOKE, ModelSetup, clock_ms, fill_cache, meta, random_model, save, set_profile, with_engine
from bench.step_profile import assign_ops, kernel_events
from policy import Policy
from wide import routers_on

LENGTHS = (1, 4, 16, 64, 100, 256, 512, 1000, 1024, 1500, 2048)
STARTS = (0, 8192)
PROFILES = (("dense", None), ("WIDE 50/50", (0.5, 0.5)), ("WIDE 75/25", (0.75, 0.25)))
ORDER = ("embedding", "attn_norm", "attn_layout", "qkv", "rope", "attention", "o", "ffn_norm", "ffn_layout",
         "gate_up", "down", "step_every_head", "step_norm", "step_head")  # the op breakdown's columns


def smoke_run():
    tiny = dict(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=64,
                max_seq_len=64)
    return ModelSetup(**SMOKE, config=tiny, calibrate_tokens=24), (1, 5, 17), (0, 24)


@torch.no_grad()
def time_chunk(run, e, T, start, reps=5):
    """(ms, {op: us}) of one chunk of T tokens at positions start..start+T-1 into a one-row cache."""
    idx = torch.randint(0, e.config.vocab_size, (1, T), device=run.device)
    pos = torch.arange(start, start + T, device=run.device)
    last = torch.tensor([T - 1], device=run.device)
    step = lambda n: [e(idx, input_pos=pos, logits_at=last) for _ in range(n)]
    step(1 if run.smoke else 2)
    times = sorted(clock_ms(run.smoke, step, 1) for _ in range(1 if run.smoke else reps))
    ops = {}
    if not run.smoke:  # the profiler's GPU kernels: nothing to break down on the CPU
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(1)
            torch.cuda.synchronize()
        for label, _, us, _ in assign_ops(kernel_events(prof), e.step_plan(T, False, start)):
            ops[label] = round(ops.get(label, 0.0) + us, 1)
    return times[len(times) // 2], ops


def profile_rows(run, m, routers, name, sparsity, lengths, starts, log):
    if sparsity:
        set_profile(m, routers, *sparsity, run.calibrate_tokens)

    def measure(e):
        rows = []
        e.setup_caches(1, max(starts) + max(lengths) + 16)
        fill_cache(m, max(starts))
        for start in starts:
            for T in lengths:
                ms, ops = time_chunk(run, e, T, start)
                rows.append(dict(profile=name, start=start, tokens=T, ms=round(ms, 3), ops=ops,
                                 ms_per_1k=round(ms / T * 1e3, 2)))
                log(f"{name}, start {start}, {T} tokens: {ms:.2f} ms")
        e.clear_caches()
        return rows
    return with_engine(m, sparsity is not None, Policy(), measure)


def markdown(rec):
    rows = rec["rows"]
    names = list(dict.fromkeys(r["profile"] for r in rows))
    by = {(r["profile"], r["start"], r["tokens"]): r for r in rows}
    out = [f"# Prefill chunks, WIDE against dense ({rec['gpu']})", "",
           f"torch {rec['torch']}, triton {rec['triton']}, {rec['date']}, `{rec['command']}`. {rec['model']}. "
           f"{rec['timing']}", "",
           "ms of one chunk (vs dense: dense ms / WIDE ms, > 1 = WIDE faster):", "",
           "| start | tokens | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for start in rec["starts"]:
        for T in rec["lengths"]:
            d = by.get(("dense", start, T))
            cells = []
            for n in names:
                r = by.get((n, start, T))
                cells.append("-" if r is None else f"{r['ms']:.2f}" if n == "dense" or d is None
                             else f"{r['ms']:.2f} ({d['ms'] / r['ms']:.2f}x)")
            out.append(f"| {start} | {T} | " + " | ".join(cells) + " |")
    worst = [(d["ms"] / r["ms"], r) for r in rows if r["profile"] != "dense"
             for d in [by.get(("dense", r["start"], r["tokens"]))] if d]
    if worst:
        ratio, r = min(worst, key=lambda x: x[0])
        out += ["", f"Slowest WIDE chunk against dense: {r['profile']}, {r['tokens']} tokens at start {r['start']}: "
                f"{ratio:.2f}x."]
    seen = {k for r in rows for k in r["ops"]}
    ops = [k for k in ORDER if k in seen] + sorted(seen - set(ORDER))
    if ops:
        out += ["", "Kernel time per op in one chunk (us, summed over the layers; torch.profiler):", "",
                "| profile | start | tokens | " + " | ".join(ops) + " |", "|---|---|---|" + "---|" * len(ops)]
        for r in rows:
            out.append(f"| {r['profile']} | {r['start']} | {r['tokens']} | "
                       + " | ".join(f"{r['ops'].get(k, 0):.0f}" for k in ops) + " |")
    return "\n".join(out) + "\n"


def plot(rec, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = rec["rows"]
    by = {(r["profile"], r["start"], r["tokens"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [n for n in dict.fromkeys(r["profile"] for r in rows) if n != "dense"]
    for i, n in enumerate(names):
        for j, start in enumerate(rec["starts"]):
            pts = [(T, by[("dense", start, T)]["ms"] / by[(n, start, T)]["ms"]) for T in rec["lengths"]
                   if (n, start, T) in by and ("dense", start, T) in by]
            if pts:
                ax.plot(*zip(*pts), "o-" if j == 0 else "s--", color=f"C{i}", label=f"{n}, start {start}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set(xlabel="chunk length (tokens)", ylabel="dense ms / WIDE ms", title=f"Prefill chunks ({rec['gpu']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def counts(lo):
    """Whole numbers >= lo, comma-separated."""
    one = cli.integer(lo)

    def parse(text):
        return tuple(one(v) for v in text.split(","))
    return parse


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = common.parser(__doc__, "-m bench.prefill", "prefill_chunks_h200")
    p.add_argument("--lengths", type=counts(1), default=None,
                   help=f"chunk lengths, comma-separated (default {','.join(map(str, LENGTHS))})")
    p.add_argument("--starts", type=counts(0), default=None,
                   help=f"chunk starts, comma-separated (default {','.join(map(str, STARTS))})")
    args = p.parse_args(argv)
    common.prepare(args, "-m bench.prefill", argv, "prefill_chunks_h200")
    run, lengths, starts = smoke_run() if args.smoke else (ModelSetup(), LENGTHS, STARTS)
    lengths, starts = args.lengths or lengths, args.starts or starts
    longest = max(starts) + max(lengths) + 16
    m, _ = random_model(run, max_seq_len=max(longest, run.calibrate_tokens))
    routers = [(l.attn_router, l.ffn_router, l.layer_router) for l in m.layers]
    log = lambda text: print(text, flush=True)
    rec = meta(args.smoke, "-m bench.prefill", argv, rows=[], lengths=list(lengths), starts=list(starts),
               policy=repr(Policy()),
               model=f"{'tiny (--smoke)' if args.smoke else run.preset} shape, random weights; routers calibrated "
                     f"per profile on a random {run.calibrate_tokens}-token prompt (bench/common.py set_profile)",
               timing="one forward of the chunk into a one-row cache, eager, CUDA events, median of 5")
    for name, sparsity in PROFILES if not args.smoke else PROFILES[:2]:
        rec["rows"] += profile_rows(run, m, routers, name, sparsity, lengths, starts, log)
        routers_on(m, routers)
        save(args.out, rec, markdown(rec))
    plot(rec, args.out + ".png")
    print(markdown(rec) + f"\nwritten: {args.out}.json, .md, .png")
    return rec


if __name__ == "__main__":
    cli.run(main)
