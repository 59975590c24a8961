"""
Serving benchmark: Poisson arrivals through serve.py's continuous-batching loop, dense vs WIDE, on a
Llama-3.1-8B-shaped model (random bf16 weights, routers calibrated per profile).

    python -m bench.serving                   # mixed: prompts 512-8192, 64 slots -> results/serving_h200_mixed.*
    python -m bench.serving --workload 8k     # prompts of 8192 tokens, 64 slots -> results/serving_h200_8k.*
    python -m bench.serving --workload long   # prompts 16k-32k, 16 slots, 32 requests -> results/serving_h200_long.*
    python -m bench.serving --profiles 0.5/0.5,0.75/0.25,0.875/0.25   # one more attention-leaning profile
    TRITON_INTERPRET=1 python -m bench.serving --smoke --slots 1      # the same code on the CPU, a tiny model (CI)

Explicit flags override what the workload sets. Per rate and profile: output tokens/s, TTFT and TPOT (p50 /
p99), the concurrency reached, and per phase the stream time. Every profile runs on the same engine; "dense"
is the model with its routers removed. With results/quality_serving.json (python eval.py --serving-only) the
table shows each profile's perplexity next to its speed. Writes .json, .md and .png (throughput and p99 TPOT
against the offered load).
"""
import argparse
import asyncio
import json
import math
import os
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

import cli
import engine
from bench import common
from bench.common import SMOKE, ModelSetup, meta, random_model, save, set_profile
from policy import Policy
from serve import Loop, Request, Server, make_app
from wide import routers_off, routers_on

CONTEXT = 131072  # Llama-3.1-8B's context (its rope_scaling stretches the preset's 8192 by 8): the longest slot
QUALITY = os.path.join("results", "quality_serving.json")  # perplexity per profile: python eval.py --serving-only
DENSE = ("dense", None, None)  # (name, attention sparsity, FFN sparsity); dense: the routers removed
HTTP = ", HTTP front"  # after a profile's name: its rows served through serve.py's HTTP front (--http)


@dataclass
class Workload:
    """What one run serves: the Llama-3.1-8B shape on the GPU, or a tiny model (--smoke). The defaults are
    the mixed workload; WORKLOADS below changes them for the others."""
    name: str = "mixed"
    preset: str = "llama-3.1-8b"
    rates: tuple = (2.0, 4.0, 8.0, math.inf)  # requests per second (inf: all arrive at once)
    requests: int = 64
    prompt: tuple = (512, 8192)      # prompt lengths: log-uniform in this range
    output: tuple = (128, 512)       # new tokens: uniform in this range
    n_slots: int = 64                # concurrency at most; a slot holds prompt[1] + output[1] + 1 positions
    profiles: tuple = (DENSE, ("WIDE 50/50", 0.5, 0.5), ("WIDE 75/25", 0.75, 0.25))
    smoke: bool = False
    seed: int = 0


# The three workloads of BENCH.md, each its own results file (results/serving_h200_<name>). KV cache per
# position of the 8B shape: 32 layers x 2 (K, V) x 8 KV heads x 128 x 2 bytes = 128 KiB. mixed and 8k:
# 64 slots x 8705 positions = 68 GiB; long: 16 slots x 33281 positions = 65 GiB. Either fits the H200's
# 141 GB next to the 16 GB of weights (~50 GB left for activations, CUDA graphs and the causal mask).
WORKLOADS = {
    "mixed": dict(),
    "8k": dict(prompt=(8192, 8192)),
    # Prompts of 16k-32k tokens take long to prefill, so higher rates would all saturate: 32 requests at
    # 0.5/s and all at once keep the run short. Where a ratio decides a claim: run it twice, or
    # --requests 64 --rates inf.
    "long": dict(prompt=(16384, 32768), n_slots=16, requests=32, rates=(0.5, math.inf)),
}


def smoke_workload(name="mixed"):
    return Workload(name=name, rates=(math.inf, 40.0), requests=3, prompt=(4, 16), output=(2, 4), n_slots=2,
                    smoke=True, profiles=(DENSE, ("WIDE 50/50", 0.5, 0.5)))


def smoke_model_run():
    """A smaller model than bench/e2e.py's --smoke: one layer, 2 attention groups (2 heads of 16, one KV
    head each), 2 FFN groups of 32 channels. The interpreter pays per kernel program."""
    tiny = dict(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=64,
                max_seq_len=32)
    return ModelSetup(**SMOKE, config=tiny, calibrate_tokens=24)


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
    first = sorted(ok, key=lambda r: r.arrival)[:16]  # the first 16 to arrive: do they pay a one-time cost?
    rest = [r for r in ok if r not in first]
    first_ttft, rest_ttft = [r.t_first - r.arrival for r in first], [r.t_first - r.arrival for r in rest]
    # ... per prompt token too: the first 16 prompts are another mix of lengths than the rest's, and a request's
    # TTFT grows with its prompt, so only this ratio tells a one-time cost from a longer prompt
    per_1k = lambda rs: [(r.t_first - r.arrival) / len(r.prompt) * 1e3 for r in rs]
    tpot = [(r.t_done - r.t_first) / (len(r.tokens) - 1) for r in ok if len(r.tokens) > 1]
    n_out = sum(len(r.tokens) for r in ok)
    return dict(requests=len(reqs), rejected=len(reqs) - len(ok), output_tokens=n_out, wall_s=round(wall_s, 3),
                output_tok_s=n_out / wall_s, ttft_p50_ms=pct(ttft, 50) * 1e3, ttft_p99_ms=pct(ttft, 99) * 1e3,
                ttft_first16_p50_ms=pct(first_ttft, 50) * 1e3, ttft_rest_p50_ms=pct(rest_ttft, 50) * 1e3,
                ttft_first16_p50_ms_per_1k=pct(per_1k(first), 50) * 1e3,
                ttft_rest_p50_ms_per_1k=pct(per_1k(rest), 50) * 1e3,
                tpot_p50_ms=pct(tpot, 50) * 1e3, tpot_p99_ms=pct(tpot, 99) * 1e3,
                concurrency_max=max(server.busy, default=0),
                concurrency_mean=sum(server.busy) / max(1, len(server.busy)), decode_steps=server.steps,
                **phase_columns(phase_ms(server), wall_s))


def phase_ms(server):
    """{phase: (total ms, steps, tokens)} over the server's marks (Server.timed: prefill tokens, decode rows)."""
    if server.device.type == "cuda":
        torch.cuda.synchronize()
    out = {}
    for phase, a, b, n in server.marks:
        ms = a.elapsed_time(b) if server.device.type == "cuda" else (b - a) * 1e3
        t, k, tok = out.get(phase, (0.0, 0, 0))
        out[phase] = (t + ms, k + 1, tok + n)
    return out


def phase_columns(ph, wall_s):
    """Per phase, stream time between CUDA events (launch gaps included; CPU: wall time): prefill ms per
    1k prompt tokens, decode ms per step, and the share of the run's wall time inside the two phases."""
    (p_ms, _, p_tok), (d_ms, d_n, _) = ph.get("prefill", (0.0, 0, 0)), ph.get("decode", (0.0, 0, 0))
    return dict(prefill_ms_per_1k_tokens=p_ms / max(1, p_tok) * 1e3, decode_ms_per_step=d_ms / max(1, d_n),
                in_phase_share=(p_ms + d_ms) / 1e3 / wall_s)


@torch.no_grad()
def realized_skip(m, tokens):
    idx = torch.randint(0, m.config.vocab_size, (1, min(tokens, m.config.max_seq_len)), device=m.embed_tokens.weight.device)
    masks = {}
    m(idx, masks=masks)
    return {k: round(1 - torch.stack([x.float().mean() for x in masks[k]]).mean().item(), 4) for k in ("attn", "ffn")}


# ----------------------------------------------------------------------------------- what a run writes
def load_quality(path, profiles):
    """The rows of `path` (perplexity of trained routers, e.g. {"attn": 0.75, "ffn": 0.25, "ffn_rule":
    "per token", "ppl_vs_dense": 1.252}) whose attn/ffn match a profile of this run, to 3 decimals;
    [] when there is no such file. The file holds a list of rows or {"rows": [...]}."""
    if not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        cli.fail(f"{path} is not readable JSON ({e}); fix or remove it")
    rows = data.get("rows", []) if isinstance(data, dict) else data
    wanted = {profile_key(a or 0.0, f or 0.0) for _, a, f in profiles}
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    return [r for r in rows if isinstance(r, dict) and all(number(r.get(k)) for k in ("attn", "ffn", "ppl_vs_dense"))
            and profile_key(r["attn"], r["ffn"]) in wanted]


def profile_key(attn, ffn):
    return round(float(attn), 3), round(float(ffn), 3)


def ppl_cell(quality, attn, ffn):
    """Every matching row's perplexity ratio, labelled by its ffn_rule when it has one; "-" when none."""
    hits = [q for q in quality if profile_key(q["attn"], q["ffn"]) == profile_key(attn or 0.0, ffn or 0.0)]
    return " / ".join(f"{q['ppl_vs_dense']:.3f}" + (f" ({q['ffn_rule']})" if q.get("ffn_rule") else "")
                      for q in hits) or "-"


def rate_label(rate):
    return "all at once" if math.isinf(rate) else f"{rate:g}"


def serving_markdown(rec):
    quality, targets = rec.get("quality", []), {n: (a, f) for n, a, f in rec.get("profiles", [])}
    limit = rec.get("ffn_router_max_decode_rows")
    rule = ("routes the FFN per token at every step" if limit is None else "routes the FFN per token except in "
            f"decode steps of more than {limit} rows, which run it dense, so above that concurrency \"dense at "
            "decode\" is the rule that was served")
    source = (f"from `{rec['quality_file']}` (trained routers at the profile's attn/FFN sparsity, matched to 3 "
              f"decimals), every matching row, labelled by its ffn_rule. This engine {rule}" if quality else
              f"\"-\": no row of `{rec.get('quality_file', QUALITY)}` matches these profiles (or no such file)")
    title = f"{rec['gpu']}: the {rec.get('workload_name', '?')} workload, {rec.get('slots', '?')} slots"
    out = [f"# Serving on {title}", "", f"torch {rec['torch']}, triton {rec['triton']}, {rec['date']}, "
           f"`{rec['command']}`, {rec.get('wall_s', '?')} s.", "",
           f"Model: {rec['model']}. Workload: {rec['workload']}. Engine: {rec['engine']}", "",
           f"ppl / dense: {source}.", ""] + ([rec["note"], ""] if rec.get("note") else []) + [
           "| rate (req/s) | run | profile | output tok/s | vs dense | TTFT p50 / p99 (ms) | TTFT p50 first 16 / rest "
           "(ms) | TPOT p50 / p99 (ms) | concurrency max / mean | skipped attn / FFN | prefill ms per 1k tokens | "
           "decode ms per step | in-phase share of wall | ppl / dense |", "|---" * 14 + "|"]
    front = lambda name: name.endswith(HTTP)  # a row served through the HTTP front: compared with dense's
    key = lambda r: (r["rate"], front(r["profile"]), r.get("run", 1))  # a row is compared with its own run's dense
    dense = {key(r): r for r in rec["rows"] if r["profile"] in ("dense", "dense" + HTTP)}
    for r in sorted(rec["rows"], key=lambda r: (r["rate"], r.get("run", 1))):  # stable: run order within a run
        d, sk = dense.get(key(r)), r.get("skip") or {}
        ratio = f"{r['output_tok_s'] / d['output_tok_s']:.2f}x" if d else "-"
        phases = (f"{r['prefill_ms_per_1k_tokens']:.1f} | {r['decode_ms_per_step']:.2f} | {r['in_phase_share']:.0%}"
                  if "decode_ms_per_step" in r else "- | - | -")
        first = (f"{r['ttft_first16_p50_ms']:.0f} / {r['ttft_rest_p50_ms']:.0f}" if "ttft_first16_p50_ms" in r
                 and math.isfinite(r["ttft_rest_p50_ms"]) else "-")
        if first != "-" and math.isfinite(r.get("ttft_rest_p50_ms_per_1k", math.nan)):
            first += f" ({r['ttft_first16_p50_ms_per_1k'] / r['ttft_rest_p50_ms_per_1k']:.2f}x per prompt token)"
        out.append(f"| {rate_label(r['rate'])} | {r.get('run', 1)} | {r['profile']} | {r['output_tok_s']:.1f} | "
                   f"{ratio} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {first} | "
                   f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | "
                   f"{r['concurrency_max']} / {r['concurrency_mean']:.1f} | "
                   + (f"{sk['attn']:.0%} / {sk['ffn']:.0%}" if sk else "-") + f" | {phases} | "
                   + ppl_cell(quality, *targets.get(r["profile"].removesuffix(HTTP), (None, None))) + " |")
    spread = {}  # (profile, rate) -> [vs dense per run]
    for r in rec["rows"]:
        d = dense.get(key(r))
        if d and not r["profile"].startswith("dense"):
            spread.setdefault((r["profile"], r["rate"]), []).append(r["output_tok_s"] / d["output_tok_s"])
    runs = [(k, v) for k, v in spread.items() if len(v) > 1]
    out += [""] + [f"{p} at {rate_label(rate)}, vs dense over {len(v)} runs: {min(v):.2f}x - {max(v):.2f}x (each run "
                   f"against its own dense)." for (p, rate), v in runs] if runs else []
    own = {(r["profile"], r["rate"], r.get("run", 1)): r for r in rec["rows"]}
    fronts = [(r, own.get((r["profile"].removesuffix(HTTP), r["rate"], r.get("run", 1)))) for r in rec["rows"]
              if front(r["profile"])]
    out += [""] + [f"Through the HTTP front (streaming clients), {r['profile'].removesuffix(HTTP)} at "
                   f"{rate_label(r['rate'])}: {r['output_tok_s'] / mine['output_tok_s']:.2f}x the in-process "
                   f"loop's output tok/s." for r, mine in fronts if mine] if fronts else []
    return "\n".join(out) + "\n"


def serving_figure(rec):
    """Two panels against the offered load: (a) output tokens/s, (b) p99 TPOT. The load axis is numeric
    (requests per second) and each profile's line joins its finite rates only; "all at once" (rate inf)
    is no point on that axis, so it is a separate marker at the right edge with its own tick."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = rec["rows"]
    finite = sorted({r["rate"] for r in rows if math.isfinite(r["rate"])})
    saturated = any(math.isinf(r["rate"]) for r in rows)
    x_sat = 1.3 * finite[-1] if finite else 1.0  # where "all at once" is drawn
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = (("output_tok_s", "output tokens/s", "(a) throughput"),
              ("tpot_p99_ms", "p99 time per output token (ms)", "(b) p99 TPOT"))
    for ax, (key, ylabel, title) in zip(axes, panels):
        names = list(dict.fromkeys(r["profile"] for r in rows))
        runs = sorted({r.get("run", 1) for r in rows})
        for (name, k) in [(n, k) for n in names for k in runs]:  # a colour per profile, a line per run
            mine = sorted((r for r in rows if r["profile"] == name and r.get("run", 1) == k), key=lambda r: r["rate"])
            line = [r for r in mine if math.isfinite(r["rate"])]
            sat = [r for r in mine if math.isinf(r["rate"])]
            label, i = name + (f", run {k}" if len(runs) > 1 else ""), names.index(name)
            if line:
                ax.plot([r["rate"] for r in line], [r[key] for r in line], "o-" if k == 1 else "o--", color=f"C{i}",
                        label=label)
            if sat:  # its own marker, never joined to the line
                ax.plot([x_sat], [sat[0][key]], "D" if k == 1 else "s", linestyle="none", color=f"C{i}",
                        label=None if line else label)
        ticks = finite + ([x_sat] if saturated else [])
        ax.set_xticks(ticks, [f"{r:g}" for r in finite] + (["all at once"] if saturated else []))
        ax.set_xlim(0, 1.1 * ticks[-1] if finite else 2.0)
        ax.set_ylim(0, 1.1 * max(r[key] for r in rows))
        ax.set(xlabel="offered load (requests/s)", ylabel=ylabel, title=title)
        ax.legend()
    fig.suptitle(f"{rec['gpu']}: the {rec.get('workload_name', '?')} workload, {rec.get('slots', '?')} slots",
                 fontsize=9)
    fig.tight_layout()
    return fig


def plot_serving(rec, path):
    import matplotlib.pyplot as plt
    fig = serving_figure(rec)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cache_bytes(cfg, n_slots, slot_len, element_size):
    """The KV cache of n_slots x slot_len positions and the prefill stage's row (K and V of every layer), plus
    the model's [slot_len, slot_len] causal mask of bools (model.setup_caches)."""
    return (n_slots + 1) * slot_len * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * element_size + slot_len ** 2


def check_cache_fits(m, w, slot_len, headroom=4 << 30):
    """On the GPU, before the cache is allocated: one line, not an out-of-memory traceback, when it cannot fit
    (headroom: a prefill chunk's activations, the CUDA graphs' pools)."""
    need = cache_bytes(m.config, w.n_slots, slot_len, m.embed_tokens.weight.element_size())
    free = torch.cuda.mem_get_info()[0]
    if need + headroom > free:
        cli.fail(f"the KV cache of {w.n_slots} slots x {slot_len} positions needs {need / 2**30:.1f} GiB but "
                 f"{free / 2**30:.1f} GiB are free (less {headroom >> 30} GiB headroom): lower --slots or the "
                 "--prompt / --output lengths")


def serving_meta(w, run, args, argv, m, slot_len):
    gib = cache_bytes(m.config, w.n_slots, slot_len, m.embed_tokens.weight.element_size()) / 2 ** 30
    return meta(run.smoke, "-m bench.serving", argv, rows=[], policy=repr(args.policy), workload_name=w.name,
                slots=w.n_slots, slot_len=slot_len, kv_cache_gib=round(gib, 2), requests=w.requests,
                profiles=[list(p) for p in w.profiles], ffn_router_max_decode_rows=m.ffn_rule.max_rows,
                quality_file=QUALITY, quality=load_quality(QUALITY, w.profiles),
                model=f"{'tiny (--smoke)' if w.smoke else w.preset} shape, random {str(run.dtype)[6:]} weights; "
                      f"routers calibrated per profile on a random {run.calibrate_tokens}-token prompt",
                workload=f"{w.name}: {w.requests} requests per rate, Poisson arrivals (seed {w.seed}), prompts "
                         f"log-uniform in {w.prompt[0]}-{w.prompt[1]} tokens, outputs uniform in {w.output[0]}-"
                         f"{w.output[1]} tokens, greedy, {w.n_slots} slots of {slot_len} positions "
                         f"(KV cache {gib:.1f} GiB)",
                engine="engine.Engine (Triton) for every profile; dense = the routers removed; prompts prefilled in "
                       f"chunks of {args.chunk} tokens in the stage row, one chunk per loop iteration between decode "
                       "steps, each a CUDA graph padded to its bucket (engine.PREFILL_BUCKETS); decode steps "
                       "replayed as CUDA graphs per batch bucket"
                       + (" (eager on the CPU)" if w.smoke else ""))


def serve_rates(server, w, name, skip, out_of_time, log):
    """One profile at every rate on one fresh server, after its warm_up (every kernel compiled, every CUDA graph
    captured) and nothing else: the first timed request is the server's first. Yields each rate's row."""
    vocab = server.model.config.vocab_size
    t = time.perf_counter()
    server.warm_up()
    warm_s = round(time.perf_counter() - t, 1)
    log(f"{name}: warm-up {warm_s} s")
    for rate in w.rates:
        if out_of_time(f"{name} rate {rate:g}"):
            continue
        server.steps, server.busy, server.done, server.marks = 0, [], [], []  # this rate's counters only
        reqs = draw_requests(w, rate, w.seed, vocab)
        t = time.perf_counter()
        server.serve(reqs)
        row = dict(rate=rate, profile=name, skip=skip, warm_up_s=warm_s,
                   **summarize(reqs, server, time.perf_counter() - t))
        log(f"{name} rate {rate:g}: {row['output_tok_s']:.1f} tok/s, TTFT p99 {row['ttft_p99_ms']:.0f} ms, "
            f"TPOT p99 {row['tpot_p99_ms']:.1f} ms, concurrency max {row['concurrency_max']}")
        yield row


class IdText:
    """The HTTP front's tokenizer for a random-weight model: a text is its token ids (" 12 7 99"), so the front
    carries exactly the requests the in-process loop serves, and streamed pieces add up (each id's own text)."""
    def encode(self, text):
        return SimpleNamespace(ids=[int(t) for t in text.split()])

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)

    def token_to_id(self, text):
        return None  # no end-of-text token: every request runs to its max_tokens, as in the loop


async def stream_all(url, reqs):
    """Each request as a streaming client of the front, sent at its arrival: its times as the client sees them
    (t_first: the first text; t_done: the last event) and its completion tokens from the stream's usage."""
    import httpx
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=len(reqs) + 8)) as client:
        async def one(r):
            await asyncio.sleep(max(0.0, r.arrival - (time.perf_counter() - t0)))
            body = dict(prompt="".join(f" {i}" for i in r.prompt), max_tokens=r.max_new_tokens, temperature=0,
                        stream=True)
            async with client.stream("POST", url, json=body) as reply:
                if reply.status_code != 200:
                    r.error, r.t_done = f"HTTP {reply.status_code}", time.perf_counter() - t0
                    return
                async for line in reply.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["text"] and r.t_first is None:
                        r.t_first = time.perf_counter() - t0
                    if chunk.get("usage"):
                        r.tokens = [0] * chunk["usage"]["completion_tokens"]
            r.t_done = time.perf_counter() - t0
        await asyncio.gather(*(one(r) for r in reqs))


def client_process(url, specs):
    """The clients of one rate, in a process of their own: [(prompt, max_new_tokens, arrival)] -> (their wall
    time in s, [(t_first, t_done, completion tokens, error)] per request)."""
    reqs = [SimpleNamespace(prompt=p, max_new_tokens=n, arrival=a, t_first=None, t_done=None, tokens=[], error=None)
            for p, n, a in specs]
    t = time.perf_counter()
    asyncio.run(stream_all(url, reqs))
    return time.perf_counter() - t, [(r.t_first, r.t_done, len(r.tokens), r.error) for r in reqs]


def stream_from_another_process(url, reqs):
    """stream_all in a process of its own, as real clients are: a load generator in the server's interpreter
    would take the GIL from the HTTP front and the engine loop it measures. Fills each request's client-side
    times and tokens; returns the clients' wall time (s), from their first send schedule to the last event."""
    import multiprocessing
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # spawn: no copy of this process's CUDA state
        wall, seen = pool.apply(client_process, (url, [(r.prompt, r.max_new_tokens, r.arrival) for r in reqs]))
    for r, (t_first, t_done, n, error) in zip(reqs, seen):
        r.t_first, r.t_done, r.tokens, r.error = t_first, t_done, [0] * n, error
    return wall


def serve_http(server, w, name, skip, rate, log):
    """One rate through serve.py's HTTP front (make_app on uvicorn, on a thread; the Server on its own, Loop),
    each request a streaming client in another process: the row as the clients measured it."""
    import uvicorn
    loop = Loop(server)
    loop.thread.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    front = uvicorn.Server(uvicorn.Config(make_app(loop, IdText(), name, None), host="127.0.0.1", port=port,
                                          log_level="warning"))
    thread = threading.Thread(target=front.run, daemon=True)
    thread.start()
    try:
        while not front.started:
            time.sleep(0.01)
        server.steps, server.busy, server.done, server.marks = 0, [], [], []
        reqs = draw_requests(w, rate, w.seed, server.model.config.vocab_size)
        wall = stream_from_another_process(f"http://127.0.0.1:{port}/v1/completions", reqs)
        row = dict(rate=rate, profile=name + HTTP, skip=skip, **summarize(reqs, server, wall))
    finally:
        front.should_exit = True
        thread.join()
        loop.stop()
    log(f"{name} through the HTTP front, rate {rate:g}: {row['output_tok_s']:.1f} tok/s, TTFT p99 "
        f"{row['ttft_p99_ms']:.0f} ms, TPOT p99 {row['tpot_p99_ms']:.1f} ms")
    return row


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

    run = smoke_model_run() if w.smoke else ModelSetup()
    slot_len = w.prompt[1] + w.output[1] + 1  # the longest request, and the dummy rows' scratch position
    m, _ = random_model(run, max_seq_len=slot_len)
    routers = [(l.attn_router, l.ffn_router, l.layer_router) for l in m.layers]
    rec = serving_meta(w, run, args, argv, m, slot_len)
    log(f"{w.name} workload: {rec['workload']}")
    # Run k serves the profiles in order, run k + 1 in reverse: no profile always comes first (--runs).
    order = [(k + 1, p) for k in range(args.runs) for p in (w.profiles if k % 2 == 0 else w.profiles[::-1])]
    for run_no, (name, attn, ffn) in order:
        if out_of_time(name):
            continue
        if attn is None:
            routers_off(m)
            skip = None
        else:
            set_profile(m, routers, attn, ffn, run.calibrate_tokens)
            skip = realized_skip(m, run.calibrate_tokens)
        forward = engine.Engine(m, args.policy)
        if torch.cuda.is_available():
            check_cache_fits(m, w, slot_len)
        server = Server(forward, w.n_slots, slot_len, chunk=args.chunk)
        try:
            for row in serve_rates(server, w, name, skip, out_of_time, log):
                rec["rows"].append(dict(row, run=run_no))
                publish()
                if args.http and not out_of_time(f"{name} rate {row['rate']:g}, HTTP front"):
                    rec["rows"].append(dict(serve_http(server, w, name, skip, row["rate"], log), run=run_no))
                    publish()
        finally:
            server.close()
            del server, forward
            routers_on(m, routers)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    publish()
    plot_serving(rec, args.out + ".png")
    print(serving_markdown(rec) + f"\nwritten: {args.out}.json, .md, .png")
    return rec


# ----------------------------------------------------------------------------------- the command line
def token_range(text):
    """LO,HI: a range of token counts, 0 < LO <= HI <= CONTEXT."""
    try:
        lo, hi = (int(v) for v in text.split(","))
        assert 0 < lo <= hi <= CONTEXT
    except (ValueError, AssertionError):
        raise argparse.ArgumentTypeError(f"{text!r}: give a token range LO,HI with 0 < LO <= HI <= {CONTEXT} (the "
                                         "model's context), e.g. 8192,8192")
    return lo, hi


def rates(text):
    """Request rates per second, comma-separated, each > 0 (inf: every request arrives at once)."""
    positive = cli.real(0, lo_open=True)
    try:
        return tuple(math.inf if r.strip() == "inf" else positive(r) for r in text.split(","))
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}; give rates > 0 per second, or inf, e.g. 2,8,inf")


def profiles(text):
    """A/F,A/F,...: WIDE profiles as (attention, FFN) sparsity, each in [0, 1); dense always runs first."""
    share = cli.fraction()
    try:
        pairs = [tuple(share(v) for v in item.split("/")) for item in text.split(",")]
        if any(len(p) != 2 for p in pairs):
            raise argparse.ArgumentTypeError("each profile is ATTN/FFN")
        if len(set(pairs)) < len(pairs):
            raise argparse.ArgumentTypeError("a profile is given twice")
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}; give attention/FFN sparsities in [0, 1), e.g. "
                                         "0.5/0.5,0.75/0.25,0.875/0.25")
    return (DENSE,) + tuple((f"WIDE {a * 100:g}/{f * 100:g}", a, f) for a, f in pairs)


def workload(args):
    """The workload the flags ask for: the named one (or --smoke's tiny one), then each flag given."""
    w = smoke_workload(args.workload) if args.smoke else Workload(name=args.workload, **WORKLOADS[args.workload])
    return replace(w, **{k: getattr(args, k) for k in ("rates", "requests", "prompt", "output", "n_slots", "profiles")
                         if getattr(args, k) is not None})


def redraw(path):
    """--redraw: the tables and plot of a results file, from its own measurements and today's quality file."""
    try:
        with open(path) as f:
            rec = json.load(f)
        prefix = path[:-len(".json")] if path.endswith(".json") else path
        rec["quality"] = load_quality(QUALITY, [tuple(p) for p in rec["profiles"]])
        save(prefix, rec, serving_markdown(rec))
        plot_serving(rec, prefix + ".png")
    except (OSError, ValueError, KeyError, TypeError) as e:
        cli.fail(f"--redraw {path}: not a results file of this script ({type(e).__name__}: {e}); give its .json")
    print(f"rewritten: {prefix}.md, {prefix}.png")
    return rec


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = common.parser(__doc__, "-m bench.serving", "serving_h200_<workload>")
    p.add_argument("--workload", choices=list(WORKLOADS), default="mixed", help="mixed: prompts 512-8192, 64 slots; "
                   "8k: prompts of 8192; long: prompts 16384-32768, 16 slots, 32 requests at 0.5/s and all at once "
                   "(default mixed)")
    p.add_argument("--rates", type=rates, default=None, help="request rates per second, comma-separated "
                   "(inf = all at once; default 2,4,8,inf; long: 0.5,inf)")
    p.add_argument("--requests", type=cli.integer(1, 1024), default=None, help="requests per rate (default 64; "
                   "long: 32, as each ~24k-token prompt takes about a second to prefill and 64 would need ~2 min "
                   "per profile and rate)")
    p.add_argument("--prompt", type=token_range, default=None, help="prompt lengths LO,HI (log-uniform; "
                   "default 512,8192; 8k: 8192,8192; long: 16384,32768)")
    p.add_argument("--output", type=token_range, default=None, help="new tokens LO,HI (uniform; default 128,512)")
    p.add_argument("--slots", dest="n_slots", metavar="N", type=cli.integer(1, 1024), default=None,
                   help="KV cache slots: requests served at once (default 64; long: 16); each holds the longest "
                   "prompt + output + 1")
    p.add_argument("--profiles", type=profiles, metavar="A/F,...", default=None,
                   help="WIDE profiles as attention/FFN sparsity, comma-separated, each in [0, 1); dense always "
                   "runs too (default 0.5/0.5,0.75/0.25)")
    p.add_argument("--budget-s", type=cli.real(0, lo_open=True), default=480,
                   help="start no new rate after this many seconds")
    # >= Policy.sparse_prefill_min_tokens: WIDE's sparse prefill kernels run (smaller chunks: results/serving.md)
    p.add_argument("--chunk", type=cli.integer(1), default=2048, help="prefill chunk in tokens (a long prompt "
                   "does not stall the running decodes for longer than one chunk)")
    p.add_argument("--policy", type=common.policy_of, default=Policy(), help="the engine's thresholds, as Policy "
                   "fields NAME=VALUE,... (default: Policy())")
    p.add_argument("--runs", type=cli.integer(1, 8), default=1, help="serve every profile this many times, each "
                   "time on a fresh server, the order reversed every other run (the rows: run 1, 2, ...; default 1)")
    p.add_argument("--http", action="store_true", help="also serve each rate through serve.py's HTTP front, each "
                   "request a streaming client, the clients in a process of their own (rows '<profile>, HTTP front')")
    p.add_argument("--redraw", metavar="JSON", default=None, help="measure nothing: rewrite the .md and .png of an "
                   "earlier run from its .json (e.g. after python eval.py --serving-only wrote new perplexities)")
    args = p.parse_args(argv)  # every flag checked here, before the device check: the same error on any machine
    if args.redraw:
        return redraw(args.redraw)
    w = workload(args)
    if w.prompt[1] + w.output[1] + 1 > CONTEXT:
        p.error(f"--prompt/--output: a slot of {w.prompt[1]} + {w.output[1]} + 1 positions exceeds the model's "
                f"context of {CONTEXT}; shorten the prompt or the output range")
    common.prepare(args, "-m bench.serving", argv, f"serving_h200_{w.name}")
    return run_bench(w, args, argv)


if __name__ == "__main__":
    cli.run(main)
