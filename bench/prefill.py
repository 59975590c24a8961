"""
Prefill chunks, WIDE against dense, at every chunk length a server runs: `python -m bench.prefill` ->
results/prefill_chunks_h200.{json,md,png}.

A serving loop prefills a long prompt in chunks (serve.py --chunk, 2048 by default), so besides the whole
chunks it runs a remainder of any length, and every chunk after the first starts at a position > 0 where the
chunk attends to the cache before it. For each chunk length T and start S: one chunk of T tokens at positions
S..S+T-1 of a one-row cache (filled with random K/V up to S), logits of its last token only, timed with CUDA
events (median of 5 after 2 warm-ups) two ways: as Server.prefill runs it on a GPU, a CUDA graph replay
(engine.CUDAGraphPrefill at the bucket the chunk is padded to), and eagerly (one launch per op from the host).
The profiles: dense (the routers removed, the engine's dense path at its best) and WIDE with the serving
benchmark's two calibrations (bench/serving.py).

Each row also has the op breakdown of one replay (torch.profiler, kernels assigned to the plan's ops as in
bench/step_profile.py): each op's kernel time and the idle time before its kernels, so a length where WIDE loses
says which op loses, and whether in its kernels or between them.
"""
import sys
import time

import torch

import cli
import engine
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
    """(eager ms, graph ms, host ms, {op: us}, {op: gap us}, kernels) of one chunk of T tokens at positions
    start..start+T-1 of a one-row cache: eagerly, as a CUDA graph as Server.prefill runs it (engine.CUDAGraphPrefill
    at the bucket a chunk of T is padded to; the op breakdown is of that replay: each op's kernel time, and the idle
    time before its kernels), and the host's time to issue the eager chunk's launches alone. kernels: [op, kernel
    name, us, launches] of that replay, summed over the layers, longest first (which kernel an op's time is)."""
    idx = torch.randint(0, e.config.vocab_size, (1, T), device=run.device)
    pos = torch.arange(start, start + T, device=run.device)
    last = torch.tensor([T - 1], device=run.device)
    step = lambda n: [e(idx, input_pos=pos, logits_at=last) for _ in range(n)]
    step(1 if run.smoke else 2)
    def median(fn):
        times = sorted(clock_ms(run.smoke, fn, 1) for _ in range(1 if run.smoke else reps))
        return times[len(times) // 2]
    eager = median(step)
    if run.smoke:  # CUDA graphs and the profiler's GPU kernels: nothing more on the CPU
        return eager, None, None, {}, {}, []
    # The host's own cost: the chunk's launches issued while a sleep kernel keeps the GPU busy, so the host
    # never waits on it (start given: no host read of input_pos).
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))
    t = time.perf_counter()
    e(idx, input_pos=pos, logits_at=last, start=start)
    host = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    bucket = next(n for n in engine.prefill_sizes(max(LENGTHS)) if n >= T)
    g = engine.CUDAGraphPrefill(e, bucket, start > 0, e.model.layers[0].self_attn.kv_cache.k_cache.shape[2])
    ids = idx[0].tolist()
    replay = lambda n: [g(ids, start) for _ in range(n)]
    graph = median(replay)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        replay(1)
        torch.cuda.synchronize()
    ops, gaps, by_kernel = {}, {}, {}
    for label, name, us, gap in assign_ops(kernel_events(prof), e.step_plan(bucket, False, start)):
        ops[label] = round(ops.get(label, 0.0) + us, 1)
        gaps[label] = round(gaps.get(label, 0.0) + gap, 1)
        total, n = by_kernel.get((label, name[:120]), (0.0, 0))
        by_kernel[(label, name[:120])] = (total + us, n + 1)
    kernels = sorted(([label, name, round(us, 1), n] for (label, name), (us, n) in by_kernel.items()),
                     key=lambda k: -k[2])
    del g
    return eager, graph, host, ops, gaps, kernels


def profile_rows(run, m, routers, name, sparsity, lengths, starts, log, policy):
    if sparsity:
        set_profile(m, routers, *sparsity, run.calibrate_tokens)

    def measure(e):
        rows = []
        e.setup_caches(1, max(starts) + max(lengths) + 16)
        fill_cache(m, max(starts))
        for start in starts:
            for T in lengths:
                eager, graph, host, ops, gaps, kernels = time_chunk(run, e, T, start)
                rows.append(dict(profile=name, start=start, tokens=T, eager_ms=round(eager, 3),
                                 graph_ms=graph and round(graph, 3), host_ms=host and round(host, 3), ops=ops, gaps=gaps,
                                 kernels=kernels, ms_per_1k=round((graph or eager) / T * 1e3, 2)))
                log(f"{name}, start {start}, {T} tokens: {eager:.2f} ms eager, graph {graph or 0:.2f} ms, "
                    f"host {host or 0:.2f} ms")
        e.clear_caches()
        return rows
    return with_engine(m, sparsity is not None, policy, measure)


def chunk_table(rec, key):
    rows = rec["rows"]
    names = list(dict.fromkeys(r["profile"] for r in rows))
    by = {(r["profile"], r["start"], r["tokens"]): r for r in rows}
    out = ["| start | tokens | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for start in rec["starts"]:
        for T in rec["lengths"]:
            d = by.get(("dense", start, T))
            cells = []
            for n in names:
                r = by.get((n, start, T))
                cells.append("-" if r is None else f"{r[key]:.2f}" if n == "dense" or d is None
                             else f"{r[key]:.2f} ({d[key] / r[key]:.2f}x)")
            out.append(f"| {start} | {T} | " + " | ".join(cells) + " |")
    return out


def markdown(rec):
    rows = rec["rows"]
    by = {(r["profile"], r["start"], r["tokens"]): r for r in rows}
    out = [f"# Prefill chunks, WIDE against dense ({rec['gpu']})", "",
           f"torch {rec['torch']}, triton {rec['triton']}, {rec['date']}, `{rec['command']}`. {rec['model']}. "
           f"{rec['timing']}", ""] + ([rec["note"], ""] if rec.get("note") else [])
    served = "graph_ms" if rows[0]["graph_ms"] else "eager_ms"  # the smoke run has no graphs
    out += [f"ms of one chunk as the server runs it ({'a CUDA graph' if rows[0]['graph_ms'] else 'eagerly'}; vs "
            "dense: dense ms / WIDE ms, > 1 = WIDE faster):", ""] + chunk_table(rec, served)
    worst = [(d[served] / r[served], r) for r in rows if r["profile"] != "dense"
             for d in [by.get(("dense", r["start"], r["tokens"]))] if d]
    ratio, slowest = min(worst, key=lambda x: x[0]) if worst else (None, None)
    if slowest:
        out += ["", f"Slowest WIDE chunk against dense: {slowest['profile']}, {slowest['tokens']} tokens at start "
                f"{slowest['start']}: {ratio:.2f}x."]
    if rows[0]["graph_ms"]:
        out += ["", "The same chunks launched eagerly, op by op from the host:", ""] + chunk_table(rec, "eager_ms")
    if rows[0].get("host_ms"):
        out += ["", "The host's time to issue one eager chunk's launches (ms; the GPU kept busy meanwhile, so the "
                "host never waits): where it exceeds the graph's time, the host sets the eager chunk's pace:", ""]
        out += chunk_table(rec, "host_ms")
    seen = {k for r in rows for k in r["ops"]}
    ops = [k for k in ORDER if k in seen] + sorted(seen - set(ORDER))
    if ops:
        out += ["", "Kernel time per op in one replay (us, summed over the layers; torch.profiler):", "",
                "| profile | start | tokens | " + " | ".join(ops) + " |", "|---|---|---|" + "---|" * len(ops)]
        for r in rows:
            out.append(f"| {r['profile']} | {r['start']} | {r['tokens']} | "
                       + " | ".join(f"{r['ops'].get(k, 0):.0f}" for k in ops) + " |")
    if any(r.get("gaps") for r in rows):  # where a chunk's time is neither kernel: launches waiting on each other
        out += ["", "Idle time before each op's kernels in the same replay (us, summed over the layers: the gaps "
                "between one kernel's end and the next one's start), and the replay's kernel time and idle time in all:",
                "", "| profile | start | tokens | " + " | ".join(ops) + " | kernels | idle |",
                "|---|---|---|" + "---|" * (len(ops) + 2)]
        for r in rows:
            gaps = r.get("gaps") or {}
            out.append(f"| {r['profile']} | {r['start']} | {r['tokens']} | "
                       + " | ".join(f"{gaps.get(k, 0):.0f}" for k in ops)
                       + f" | {sum(r['ops'].values()):.0f} | {sum(gaps.values()):.0f} |")
    dense = slowest and by[("dense", slowest["start"], slowest["tokens"])]
    if slowest and slowest.get("kernels") and dense.get("kernels"):  # which kernels the slowest chunk's time is
        out += ["", f"The longest kernels of that chunk's replay ({slowest['profile']}, {slowest['tokens']} tokens at "
                f"start {slowest['start']}) and of dense's (us summed over the layers, launches):", "",
                "| profile | op | kernel | us | launches |", "|---|---|---|---|---|"]
        for row in (slowest, dense):
            out += [f"| {row['profile']} | {op} | `{name[:60]}` | {us:.0f} | {n} |"
                    for op, name, us, n in row["kernels"][:12]]
    return "\n".join(out) + "\n"


def plot(rec, path):
    """dense ms / WIDE ms against the chunk length: as a graph (as served) and eager, at each start."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = rec["rows"]
    by = {(r["profile"], r["start"], r["tokens"]): r for r in rows}
    keys = ([("graph_ms", "CUDA graph (served)")] if rows[0]["graph_ms"] else []) + [("eager_ms", "eager")]
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
    names = [n for n in dict.fromkeys(r["profile"] for r in rows) if n != "dense"]
    for ax, (key, title) in zip(axes[0], keys):
        for i, n in enumerate(names):
            for j, start in enumerate(rec["starts"]):
                pts = [(T, by[("dense", start, T)][key] / by[(n, start, T)][key]) for T in rec["lengths"]
                       if (n, start, T) in by and ("dense", start, T) in by]
                if pts:
                    ax.plot(*zip(*pts), "o-" if j == 0 else "s--", color=f"C{i}", label=f"{n}, start {start}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log")
        ax.set(xlabel="chunk length (tokens)", ylabel="dense ms / WIDE ms", title=f"{title} ({rec['gpu']})")
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
    p.add_argument("--policy", type=common.policy_of, default=Policy(), help="the engine's thresholds, as Policy fields "
                   "NAME=VALUE,... (default: Policy())")
    p.add_argument("--profiles", type=lambda t: [x for x in PROFILES if x[0] in t.split(",")] or
                   p.error(f"--profiles {t!r}: give names of {[x[0] for x in PROFILES]}"), default=None,
                   help="comma-separated: dense,WIDE 50/50,WIDE 75/25 (default all)")
    args = p.parse_args(argv)
    common.prepare(args, "-m bench.prefill", argv, "prefill_chunks_h200")
    run, lengths, starts = smoke_run() if args.smoke else (ModelSetup(), LENGTHS, STARTS)
    lengths, starts = args.lengths or lengths, args.starts or starts
    longest = max(starts) + max(lengths) + 16
    m, _ = random_model(run, max_seq_len=max(longest, run.calibrate_tokens))
    routers = [(l.attn_router, l.ffn_router, l.layer_router) for l in m.layers]
    log = lambda text: print(text, flush=True)
    rec = meta(args.smoke, "-m bench.prefill", argv, rows=[], lengths=list(lengths), starts=list(starts),
               policy=repr(args.policy),
               model=f"{'tiny (--smoke)' if args.smoke else run.preset} shape, random weights; routers calibrated "
                     f"per profile on a random {run.calibrate_tokens}-token prompt (bench/common.py set_profile)",
               timing="one chunk into a one-row cache (its K/V up to the start random), logits of its last token; "
                      "CUDA events, median of 5 after 2 warm-ups; as a CUDA graph (engine.CUDAGraphPrefill, padded to "
                      "the bucket the server pads it to, as served) and eagerly")
    for name, sparsity in args.profiles or (PROFILES if not args.smoke else PROFILES[:2]):
        rec["rows"] += profile_rows(run, m, routers, name, sparsity, lengths, starts, log, args.policy)
        routers_on(m, routers)
        save(args.out, rec, markdown(rec))
    plot(rec, args.out + ".png")
    print(markdown(rec) + f"\nwritten: {args.out}.json, .md, .png")
    return rec


if __name__ == "__main__":
    cli.run(main)
