"""
Serving benchmark: Poisson arrivals through serve.py's continuous-batching loop, dense vs WIDE, on a
Llama-3.1-8B-shaped model (random bf16 weights, routers calibrated per profile).

    python bench_serve.py --rates 2,8,inf --budget-s 300   # H200, ~4 min -> results/serving_h200.{json,md,png}
    python bench_serve.py --prompt 8192,8192 --rates inf --out results/serving_h200_8k   # long prompts only
    TRITON_INTERPRET=1 python bench_serve.py --smoke        # the same code on the CPU, a tiny model (CI)

Per rate and profile: output tokens/s, TTFT and TPOT (p50 / p99), the concurrency reached, and per phase
the stream time (prefill ms per 1k prompt tokens, decode ms per step). Every profile runs on the same
engine (engine.Engine); "dense" is the model with its routers removed. A profile's routers are calibrated
on a random prompt (bench_common.calibrate_routers), one router type at a time.
"""
import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, replace

import torch

import bench_common
import cli
import engine
from bench_common import SMOKE, ModelRun, calibrate_routers, meta, random_model, save
from serve import Request, Server
from wide import routers_off, routers_on


@dataclass
class Workload:
    """What one run serves: the Llama-3.1-8B shape on the GPU, or a tiny model (--smoke)."""
    preset: str = "llama-3.1-8b"
    rates: tuple = (2.0, 4.0, 8.0, math.inf)  # requests per second (inf: all arrive at once)
    requests: int = 64
    prompt: tuple = (512, 8192)      # prompt lengths: log-uniform in this range
    output: tuple = (128, 512)       # new tokens: uniform in this range
    n_slots: int = 64                # concurrency at most
    profiles: tuple = (("dense", None, None), ("WIDE 50/50", 0.5, 0.5), ("WIDE 75/25", 0.75, 0.25))
    warmup_requests: int = 4
    smoke: bool = False
    seed: int = 0


def smoke_workload():
    return Workload(rates=(math.inf, 40.0), requests=3, prompt=(4, 16), output=(2, 4), n_slots=2,
                    warmup_requests=1, smoke=True, profiles=(("dense", None, None), ("WIDE 50/50", 0.5, 0.5)))


def smoke_model_run():
    """A smaller model than bench_e2e's --smoke: one layer, 2 attention groups (2 heads of 16, one KV
    head each), 2 FFN groups of 32 channels. The interpreter pays per kernel program."""
    tiny = dict(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=64,
                max_seq_len=32)
    return ModelRun(**SMOKE, config=tiny, calibrate_tokens=24)


def draw_requests(w, rate, seed, vocab):
    """Seeded: Poisson arrivals (exponential gaps at `rate` per second), log-uniform prompt lengths,
    uniform output lengths, random token ids."""
    g = random.Random(seed)
    t, out = 0.0, []
    lo, hi = w.prompt
    for _ in range(w.requests):
        P = int(round(math.exp(g.uniform(math.log(lo), math.log(hi)))))
        out.append(Request([g.randrange(vocab) for _ in range(P)], g.randint(*w.output), arrival=t))
        t += 0.0 if math.isinf(rate) else g.expovariate(rate)
    return out


def pct(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))] if v else float("nan")


def summarize(reqs, server, wall_s):
    ok = [r for r in reqs if r.error is None]
    ttft = [r.t_first - r.arrival for r in ok]
    tpot = [(r.t_done - r.t_first) / (len(r.tokens) - 1) for r in ok if len(r.tokens) > 1]
    n_out = sum(len(r.tokens) for r in ok)
    return dict(requests=len(reqs), rejected=len(reqs) - len(ok), output_tokens=n_out, wall_s=round(wall_s, 3),
                output_tok_s=n_out / wall_s, ttft_p50_ms=pct(ttft, 50) * 1e3, ttft_p99_ms=pct(ttft, 99) * 1e3,
                tpot_p50_ms=pct(tpot, 50) * 1e3, tpot_p99_ms=pct(tpot, 99) * 1e3,
                concurrency_max=max(server.busy, default=0),
                concurrency_mean=sum(server.busy) / max(1, len(server.busy)), decode_steps=server.steps,
                **phase_columns(server.phase_ms(), wall_s))


def phase_columns(ph, wall_s):
    """Per phase, stream time between CUDA events (launch gaps included; CPU: wall time): prefill ms per
    1k prompt tokens, decode ms per step, and the share of the run's wall time inside the two phases."""
    (p_ms, _, p_tok), (d_ms, d_n, _) = ph.get("prefill", (0.0, 0, 0)), ph.get("decode", (0.0, 0, 0))
    return dict(prefill_ms_per_1k_tokens=p_ms / max(1, p_tok) * 1e3, decode_ms_per_step=d_ms / max(1, d_n),
                in_phase_share=(p_ms + d_ms) / 1e3 / wall_s)


def set_profile(m, routers, attn, ffn, tokens):
    """Calibrate the routers to skip `attn` of the attention groups and `ffn` of the FFN groups on a
    random prompt (one router type at a time: the other type is removed while one is calibrated, so the
    two interact only through that)."""
    for kind, s in (("attn", attn), ("ffn", ffn)):
        for layer, (a, f, _) in zip(m.layers, routers):
            layer.attn_router, layer.ffn_router = (a, None) if kind == "attn" else (None, f)
        calibrate_routers(m, s, tokens)
    routers_on(m, routers)


@torch.no_grad()
def realized_skip(m, tokens):
    idx = torch.randint(0, m.config.vocab_size, (1, min(tokens, m.config.max_seq_len)), device=m.embed_tokens.weight.device)
    masks = {}
    m(idx, masks=masks)
    return {k: round(1 - torch.stack([x.float().mean() for x in masks[k]]).mean().item(), 4) for k in ("attn", "ffn")}


def serving_markdown(rec):
    out = [f"# Serving on {rec['gpu']}", "", f"torch {rec['torch']}, triton {rec['triton']}, {rec['date']}, "
           f"`{rec['command']}`, {rec.get('wall_s', '?')} s.", "", f"Model: {rec['model']}. Workload: {rec['workload']}. "
           f"Engine: {rec['engine']}", "", "| rate (req/s) | profile | output tok/s | vs dense | TTFT p50 / p99 (ms) | "
           "TPOT p50 / p99 (ms) | concurrency max / mean | skipped attn / FFN | stream time: prefill ms per 1k tokens / "
           "decode ms per step / share of wall |", "|---|---|---|---|---|---|---|---|---|"]
    dense = {r["rate"]: r for r in rec["rows"] if r["profile"] == "dense"}
    for r in rec["rows"]:
        d = dense.get(r["rate"])
        ratio = f"{r['output_tok_s'] / d['output_tok_s']:.2f}x" if d else ""
        sk = r.get("skip") or {}
        out.append(f"| {r['rate']:g} | {r['profile']} | {r['output_tok_s']:.1f} | {ratio} | {r['ttft_p50_ms']:.0f} / "
                   f"{r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | {r['concurrency_max']} / "
                   f"{r['concurrency_mean']:.1f} | " + (f"{sk['attn']:.0%} / {sk['ffn']:.0%}" if sk else "") + " | "
                   + (f"{r['prefill_ms_per_1k_tokens']:.1f} / {r['decode_ms_per_step']:.2f} / {r['in_phase_share']:.0%}"
                      if "decode_ms_per_step" in r else "") + " |")
    return "\n".join(out) + "\n"


def plot_serving(rec, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["profile"] for r in rec["rows"]):
        rows = [r for r in rec["rows"] if r["profile"] == name]
        x = list(range(len(rows)))
        a.plot(x, [r["output_tok_s"] for r in rows], "o-", label=name)
        b.plot(x, [r["tpot_p99_ms"] for r in rows], "o-", label=name)
        for ax in (a, b):
            ax.set_xticks(x, [f"{r['rate']:g}" for r in rows])
    a.set(xlabel="request rate (req/s; inf = all at once)", ylabel="output tokens/s", title="throughput")
    b.set(xlabel="request rate (req/s; inf = all at once)", ylabel="p99 time per output token (ms)", title="p99 TPOT")
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def serving_meta(w, run, args, argv, slot_len):
    return meta(run.smoke, "bench_serve.py", argv, rows=[], policy=repr(engine.Policy()),
                model=f"{'tiny (--smoke)' if w.smoke else w.preset} shape, random {str(run.dtype)[6:]} weights; "
                      f"routers calibrated per profile on a random {run.calibrate_tokens}-token prompt",
                workload=f"{w.requests} requests per rate, Poisson arrivals (seed {w.seed}), prompts log-uniform in "
                         f"{w.prompt[0]}-{w.prompt[1]} tokens, outputs uniform in {w.output[0]}-{w.output[1]} tokens, "
                         f"greedy, {w.n_slots} slots of {slot_len} positions",
                engine="engine.Engine (Triton) for every profile; dense = the routers removed; prompts prefilled in "
                       f"chunks of {args.chunk} tokens, one chunk per loop iteration between decode steps; decode "
                       "steps replayed as CUDA graphs per batch bucket" + (" (eager on the CPU)" if w.smoke else ""))


def serve_rates(server, w, name, skip, out_of_time, log):
    """One profile at every rate on one server (its CUDA graphs captured first): yields each rate's row."""
    vocab = server.model.config.vocab_size
    server.warm_up()
    server.run(draw_requests(w, math.inf, w.seed + 999, vocab)[:w.warmup_requests])
    for rate in w.rates:
        if out_of_time(f"{name} rate {rate:g}"):
            continue
        server.steps, server.busy, server.done, server.marks = 0, [], [], []  # this rate's counters only
        reqs = draw_requests(w, rate, w.seed, vocab)
        t = time.perf_counter()
        server.run(reqs)
        row = dict(rate=rate, profile=name, skip=skip, **summarize(reqs, server, time.perf_counter() - t))
        log(f"{name} rate {rate:g}: {row['output_tok_s']:.1f} tok/s, TTFT p99 {row['ttft_p99_ms']:.0f} ms, "
            f"TPOT p99 {row['tpot_p99_ms']:.1f} ms, concurrency max {row['concurrency_max']}")
        yield row


def run_bench(w, args, argv):
    t_start = time.time()
    log = lambda text: print(f"[{time.time() - t_start:5.0f}s] {text}", flush=True)

    def out_of_time(label):
        if time.time() - t_start <= args.budget_s:
            return False
        log(f"{label}: skipped (time budget of {args.budget_s:.0f} s spent)")
        return True

    def publish():  # after every row: a run cut short still leaves its tables
        rec["wall_s"] = round(time.time() - t_start)
        save(args.out, rec, serving_markdown(rec))

    run = smoke_model_run() if w.smoke else ModelRun()
    slot_len = w.prompt[1] + w.output[1] + 1
    m, _ = random_model(run, max_seq_len=slot_len)
    routers = [(l.attn_router, l.ffn_router, l.layer_router) for l in m.layers]
    rec = serving_meta(w, run, args, argv, slot_len)
    for name, attn, ffn in w.profiles:
        if out_of_time(name):
            continue
        if attn is None:
            routers_off(m)
            skip = None
        else:
            set_profile(m, routers, attn, ffn, run.calibrate_tokens)
            skip = realized_skip(m, run.calibrate_tokens)
        server = Server(engine.Engine(m), w.n_slots, slot_len, chunk=args.chunk)
        try:
            for row in serve_rates(server, w, name, skip, out_of_time, log):
                rec["rows"].append(row)
                publish()
        finally:
            server.close()
            del server
            routers_on(m, routers)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    publish()
    plot_serving(rec, args.out + ".png")
    print(serving_markdown(rec) + f"\nwritten: {args.out}.json, .md, .png")
    return rec


# ----------------------------------------------------------------------------------- the command line
def token_range(text):
    """LO,HI: a range of token counts, 0 < LO <= HI."""
    try:
        lo, hi = (int(v) for v in text.split(","))
        assert 0 < lo <= hi
    except (ValueError, AssertionError):
        raise argparse.ArgumentTypeError(f"{text!r}: give a token range LO,HI with 0 < LO <= HI, e.g. 8192,8192")
    return lo, hi


def rates(text):
    """Request rates per second, comma-separated, each > 0 (inf: every request arrives at once)."""
    positive = cli.real(0, lo_open=True)
    try:
        return tuple(math.inf if r.strip() == "inf" else positive(r) for r in text.split(","))
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}; give rates > 0 per second, or inf, e.g. 2,8,inf")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = bench_common.parser(__doc__, "serving_h200")
    p.add_argument("--rates", type=rates, default=None, help="request rates per second, comma-separated "
                   "(inf = all at once; default 2,4,8,inf)")
    p.add_argument("--requests", type=cli.integer(1), default=None, help="requests per rate (default 64)")
    p.add_argument("--prompt", type=token_range, default=None, help="prompt lengths LO,HI (log-uniform; "
                   "default 512,8192)")
    p.add_argument("--output", type=token_range, default=None, help="new tokens LO,HI (uniform; default 128,512)")
    p.add_argument("--budget-s", type=cli.real(0, lo_open=True), default=480,
                   help="start no new rate after this many seconds")
    # >= Policy.sparse_prefill_min_tokens: WIDE's sparse prefill kernels run (H200, 512: 0.66-0.97x dense)
    p.add_argument("--chunk", type=cli.integer(1), default=2048, help="prefill chunk in tokens (a long prompt "
                   "does not stall the running decodes for longer than one chunk)")
    args = p.parse_args(argv)  # every flag checked here, before the device check: the same error on any machine
    bench_common.prepare(args, "bench_serve.py", argv, "serving_h200")
    w = smoke_workload() if args.smoke else Workload()
    w = replace(w, **{k: getattr(args, k) for k in ("rates", "requests", "prompt", "output") if getattr(args, k)})
    return run_bench(w, args, argv)


if __name__ == "__main__":
    cli.run(main)
