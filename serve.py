"""
Serving: many requests at once through one static KV cache (continuous batching), and whether WIDE keeps
its gains there.

    python serve.py bench            # H200: Poisson arrivals, dense vs WIDE -> results/serving_h200.{json,md,png}
    python serve.py union            # CPU: the mask union of our trained routers (mask_union.py) -> results/mask_union.*
    TRITON_INTERPRET=1 python serve.py bench --smoke   # the bench's code on the CPU, a tiny model (CI)

The loop (Server): the cache has `n_slots` rows of `slot_len` positions, set up once. Requests wait in
a queue; each takes the lowest free slot, is prefilled into it, then decodes one token per step next to
every other running request, each row at its own position (input_pos [B, 1], as generate.py runs prompts
of different lengths). A finished request frees its slot at once and the next one takes it.

        queue ─► free slot ─► prefill (whole prompt, or chunk by chunk) ─► decode steps ─► done, slot freed
                                   one prefill piece, then one decode step for all running slots, repeat

- Prefill writes straight into the request's own cache row: SlotView hands the model a [1, ...] view of
  that row as its KV cache, so a prefill is exactly generate.py's prefill at batch 1 (no copy).
- Chunked prefill (both backends): a long prompt goes in `chunk` tokens per loop iteration at positions
  [start, start + chunk), each chunk attending to the cache before it, so running decodes are not
  stalled by it; without `chunk` a prompt is prefilled whole, one prompt per iteration.
- A decode step runs the first n rows of the cache, n the smallest bucket (BUCKETS) that covers the
  highest running slot; rows in there that are not decoding run a dummy token (a free slot at position
  0, a slot between prefill chunks at slot_len - 1, a position no request that fits ever reads). On a
  GPU each bucket's step is a CUDA graph (generate.CUDAGraphDecoder) over views of those rows, captured
  once. The dummy rows are real work: for WIDE they also widen the batch's mask union.
- A request whose prompt + max_new_tokens exceed slot_len - 1 is rejected with a message; the others run.
Greedy decoding only: every request's tokens are then exactly those of generating it alone
(tests/test_serve.py checks it on the CPU for both backends).
"""
import argparse
import contextlib
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

import torch

import engine
from generate import CUDAGraphDecoder
from wide import routers_off, routers_on
from model import KVCache

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)  # decode batch sizes with their own CUDA graph


@dataclass
class Request:
    prompt: list                  # token ids
    max_new_tokens: int
    arrival: float = 0.0          # seconds after the start (or loop iterations, with a fake clock)
    tokens: list = field(default_factory=list)   # the generated ids
    error: str = None             # set when the request was rejected
    slot: int = None
    prefilled: int = 0            # prompt tokens already in the cache
    t_first: float = None         # when the first new token was known (TTFT = t_first - arrival)
    t_done: float = None


class SlotView(torch.nn.Module):
    """Rows of a layer's static KV cache, used as the layer's KV cache: views, so writes land in place."""

    def __init__(self, cache, rows):
        super().__init__()
        self.k_cache, self.v_cache = cache.k_cache[rows], cache.v_cache[rows]

    update = KVCache.update  # scatter K/V at input_pos ([T], or [B, T] per row), as the full cache does


class Server:
    """Continuous batching over a fixed number of cache slots. forward: engine.select(model, backend)."""

    def __init__(self, forward, n_slots, slot_len, chunk=None, cuda_graph=None):
        self.forward, self.n_slots, self.slot_len = forward, n_slots, slot_len
        self.is_engine = isinstance(forward, engine.Engine)
        self.model = forward.model if self.is_engine else forward
        if slot_len > self.model.config.max_seq_len:
            raise ValueError(f"slot_len {slot_len} exceeds the model's context of {self.model.config.max_seq_len}")
        self.chunk = chunk
        self.device = self.model.embed_tokens.weight.device
        self.cuda_graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        forward.setup_caches(n_slots, slot_len)
        self.caches = [layer.self_attn.kv_cache for layer in self.model.layers]
        self.buckets = sorted({b for b in BUCKETS if b < n_slots} | {n_slots})
        self.graphs = {}                 # bucket -> CUDAGraphDecoder
        self.slots = [None] * n_slots    # the request in each slot, or None
        self.queue, self.done = [], []
        self.steps, self.busy = 0, []    # decode steps run; running requests at each step
        self.marks = []                  # [phase, start, end (CUDA events or clock), tokens or rows]

    def close(self):
        self.graphs.clear()
        self.caches = []  # the cache's memory goes back before the next Server allocates its own
        self.forward.clear_caches()

    def use_rows(self, rows):
        for layer, cache in zip(self.model.layers, self.caches):
            layer.self_attn.kv_cache = SlotView(cache, rows)

    def submit(self, req, now=0.0):
        need = len(req.prompt) + req.max_new_tokens
        # The last position (slot_len - 1) is the dummy rows' scratch: a request may use the ones before it.
        if need > self.slot_len - 1 or not req.prompt or req.max_new_tokens < 1:
            req.error = (f"rejected: {len(req.prompt)} prompt tokens + {req.max_new_tokens} new tokens do not fit a "
                         f"slot of {self.slot_len - 1} positions; shorten the prompt or lower max_new_tokens")
            req.t_done = now
            self.done.append(req)
            return False
        self.queue.append(req)
        return True

    def idle(self):
        return not self.queue and all(r is None for r in self.slots)

    @torch.no_grad()
    def step(self, now):
        """One loop iteration: fill free slots from the queue, run one prefill piece, one decode step."""
        while self.queue and None in self.slots:
            req = self.queue.pop(0)
            req.slot = self.slots.index(None)  # the lowest free slot keeps the decode bucket small
            self.slots[req.slot] = req
        filling = [r for r in self.slots if r is not None and r.prefilled < len(r.prompt)]
        if filling:
            with self.timed("prefill") as mark:
                mark[-1] = self.prefill(min(filling, key=lambda r: r.arrival), now)
        if any(r is not None and r.tokens for r in self.slots):
            with self.timed("decode") as mark:
                mark[-1] = self.decode(now)

    @contextlib.contextmanager
    def timed(self, phase):
        # CUDA events around a phase, read after the run (no extra host sync); on the CPU, wall time.
        if not self.device.type == "cuda":
            t = time.perf_counter()
            mark = [phase, t, None, 0]
            yield mark
            mark[2] = time.perf_counter()
        else:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = torch.cuda.current_stream(self.device)
            a.record(stream)
            mark = [phase, a, b, 0]
            yield mark
            b.record(stream)
        self.marks.append(mark)

    def phase_ms(self):
        """{phase: (total ms, steps, tokens)} over the marks so far (prefill tokens, decode rows)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        out = {}
        for phase, a, b, n in self.marks:
            ms = a.elapsed_time(b) if self.device.type == "cuda" else (b - a) * 1e3
            t, k, tok = out.get(phase, (0.0, 0, 0))
            out[phase] = (t + ms, k + 1, tok + n)
        return out

    def prefill(self, req, now):
        P, start = len(req.prompt), req.prefilled
        end = P if not self.chunk else min(P, start + self.chunk)
        self.use_rows(slice(req.slot, req.slot + 1))
        idx = torch.tensor([req.prompt[start:end]], device=self.device)                   # [1, T]
        pos = torch.arange(start, end, device=self.device)                                # [T]
        logits = self.forward(idx, input_pos=pos, logits_at=torch.tensor([end - start - 1], device=self.device))
        req.prefilled = end
        if end == P:  # the last piece: its last position gives the first new token
            req.tokens.append(int(logits[0, -1].argmax()))
            req.t_first = time.perf_counter() if now is None else now()
            self.finish_if_done(req, now)
        return end - start

    def decode(self, now):
        top = max(i for i, r in enumerate(self.slots) if r is not None and r.tokens)
        n = next(b for b in self.buckets if b > top)
        token = torch.zeros(n, 1, dtype=torch.long)
        pos = torch.zeros(n, dtype=torch.long)
        running = []
        for i, r in enumerate(self.slots[:n]):
            if r is not None and r.tokens:  # prefilled (its first token came from the prefill)
                token[i, 0], pos[i] = r.tokens[-1], len(r.prompt) + len(r.tokens) - 1
                running.append(r)
            elif r is not None:  # between prefill chunks: write where no request that fits ever reads
                pos[i] = self.slot_len - 1
        token, pos = token.to(self.device), pos.to(self.device)                          # [n, 1], [n]
        if self.cuda_graph:
            if n not in self.graphs:
                self.use_rows(slice(0, n))
                self.graphs[n] = CUDAGraphDecoder(self.forward, token, pos)
            logits = self.graphs[n](token, pos)
        else:
            self.use_rows(slice(0, n))
            logits = self.forward(token, input_pos=pos.view(-1, 1))[:, -1]
        nxt = logits.argmax(-1).tolist()  # greedy; the one host sync of a step
        self.steps += 1
        self.busy.append(len(running))
        for r in running:
            r.tokens.append(nxt[r.slot])
            self.finish_if_done(r, now)
        return len(running)

    def finish_if_done(self, req, now):
        if len(req.tokens) == req.max_new_tokens:
            req.t_done = time.perf_counter() if now is None else now()
            self.slots[req.slot] = None
            self.done.append(req)

    @torch.no_grad()  # the Triton engine refuses grad-enabled calls, and graphs capture no autograd
    def warm_up(self):
        """Capture every bucket's CUDA graph before timing (all slots free: dummy rows at position 0)."""
        for n in self.buckets if self.cuda_graph else []:
            self.use_rows(slice(0, n))
            z = torch.zeros(n, 1, dtype=torch.long, device=self.device)
            self.graphs[n] = CUDAGraphDecoder(self.forward, z, z.view(-1).clone())

    def run(self, requests, now=None):
        """Serve requests (arrival: seconds after the start) until all are done or rejected.
        now: a clock (default the wall clock, arrivals in real time); tests pass a fake one."""
        clock = now or time.perf_counter
        t0 = clock()
        since = lambda: clock() - t0
        pending = sorted(requests, key=lambda r: r.arrival)
        while pending or not self.idle():
            while pending and pending[0].arrival <= since():
                self.submit(pending.pop(0), since())
            if self.idle() and pending:  # nothing to do until the next arrival
                if now is None:
                    time.sleep(max(0.0, pending[0].arrival - since()))
                continue
            self.step(since)
        return requests


# ----------------------------------------------------------------------------------- the workload benchmark
@dataclass
class Workload:
    """What `python serve.py bench` runs: Llama-3.1-8B shape on the GPU, or a tiny model (--smoke)."""
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
    """bench_e2e's --smoke run on an even smaller model: one layer, 2 attention groups (2 heads of 16,
    one KV head each), 2 FFN groups of 32 channels. The interpreter pays per kernel program."""
    from dataclasses import replace
    from bench_e2e import smoke_run
    tiny = dict(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=64,
                max_seq_len=32)
    return replace(smoke_run(), config=tiny, calibrate_tokens=24)


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
    random prompt (bench_e2e.calibrate_routers, one router type at a time: the other type is removed
    while one is calibrated, so the two interact only through that)."""
    from bench_e2e import calibrate_routers
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


def run_bench(w, args, argv):
    from bench_e2e import Run, e2e_model
    from bench_kernels import meta, save
    t_start = time.time()
    run = smoke_model_run() if w.smoke else Run()
    slot_len = w.prompt[1] + w.output[1] + 1
    m, _ = e2e_model(run, max_seq_len=slot_len)
    routers = [(l.attn_router, l.ffn_router, l.layer_router) for l in m.layers]
    rec = meta(run, "serve.py", argv, rows=[], policy=repr(engine.Policy()),
               model=f"{'tiny (--smoke)' if w.smoke else w.preset} shape, random {str(run.dtype)[6:]} weights; "
                     f"routers calibrated per profile on a random {run.calibrate_tokens}-token prompt",
               workload=f"{w.requests} requests per rate, Poisson arrivals (seed {w.seed}), prompts log-uniform in "
                        f"{w.prompt[0]}-{w.prompt[1]} tokens, outputs uniform in {w.output[0]}-{w.output[1]} tokens, "
                        f"greedy, {w.n_slots} slots of {slot_len} positions",
               engine="engine.Engine (Triton) for every profile; dense = the routers removed; prompts prefilled in "
                      f"chunks of {args.chunk} tokens, one chunk per loop iteration between decode steps; decode steps "
                      "replayed as CUDA graphs per batch bucket" + (" (eager on the CPU)" if w.smoke else ""))
    for name, attn, ffn in w.profiles:
        if time.time() - t_start > args.budget_s:
            print(f"{name}: skipped (time budget of {args.budget_s:.0f} s spent)", flush=True)
            continue
        if attn is None:
            routers_off(m)
            skip = None
        else:
            set_profile(m, routers, attn, ffn, run.calibrate_tokens)
            skip = realized_skip(m, run.calibrate_tokens)
        server = Server(engine.Engine(m), w.n_slots, slot_len, chunk=args.chunk)
        try:
            server.warm_up()
            server.run(draw_requests(w, math.inf, w.seed + 999, m.config.vocab_size)[:w.warmup_requests])
            for rate in w.rates:
                if time.time() - t_start > args.budget_s:
                    print(f"{name} rate {rate:g}: skipped (time budget of {args.budget_s:.0f} s spent)", flush=True)
                    continue
                server.steps, server.busy, server.done, server.marks = 0, [], [], []
                reqs = draw_requests(w, rate, w.seed, m.config.vocab_size)
                t = time.perf_counter()
                server.run(reqs)
                row = dict(rate=rate, profile=name, skip=skip, **summarize(reqs, server, time.perf_counter() - t))
                rec["rows"].append(row)
                print(f"[{time.time() - t_start:5.0f}s] {name} rate {rate:g}: {row['output_tok_s']:.1f} tok/s, TTFT p99 "
                      f"{row['ttft_p99_ms']:.0f} ms, TPOT p99 {row['tpot_p99_ms']:.1f} ms, concurrency max "
                      f"{row['concurrency_max']}", flush=True)
                rec["wall_s"] = round(time.time() - t_start)
                save(args.out, rec, serving_markdown(rec))
        finally:
            server.close()
            del server
            routers_on(m, routers)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    save(args.out, rec, serving_markdown(rec))
    plot_serving(rec, args.out + ".png")
    print(serving_markdown(rec) + f"\nwritten: {args.out}.json, .md, .png")
    return rec


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["bench", "union"])
    p.add_argument("--smoke", action="store_true", help="bench: a tiny fp32 model on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--out", default=None, help="output path prefix (default results/serving_h200 or results/mask_union; "
                   "--smoke: a temporary folder)")
    p.add_argument("--rates", default="", help="bench: request rates, comma-separated (inf = all at once)")
    p.add_argument("--requests", type=int, default=None, help="bench: requests per rate")
    p.add_argument("--prompt", default="", help="bench: prompt lengths LO,HI (log-uniform; default 512,8192)")
    p.add_argument("--output", default="", help="bench: new tokens LO,HI (uniform; default 128,512)")
    p.add_argument("--budget-s", type=float, default=480, help="bench: start no new rate after this many seconds")
    # >= Policy.sparse_prefill_min_tokens: WIDE's sparse prefill kernels run (H200, 512: 0.66-0.97x dense)
    p.add_argument("--chunk", type=int, default=2048, help="bench: prefill chunk in tokens (a long prompt does not "
                   "stall the running decodes for longer than one chunk)")
    p.add_argument("--out-dir", default="out", help="union: where train.py wrote its checkpoints")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    if args.what == "union":
        args.out = args.out or os.path.join("results", "mask_union")
        import mask_union
        return mask_union.run_union(args, argv)
    from bench_kernels import need_device, out_prefix
    need_device(args, "serve.py", argv)
    w = smoke_workload() if args.smoke else Workload()
    if args.rates:
        w.rates = tuple(float(r) for r in args.rates.split(","))
    if args.requests:
        w.requests = args.requests
    for name in ("prompt", "output"):  # LO,HI token ranges
        text = getattr(args, name)
        if text:
            try:
                lo, hi = (int(v) for v in text.split(","))
                assert 0 < lo <= hi
            except (ValueError, AssertionError):
                sys.exit(f"error: --{name} {text!r}: give a token range LO,HI with 0 < LO <= HI, e.g. 8192,8192")
            setattr(w, name, (lo, hi))
    args.out = out_prefix(args, "serving_h200")
    return run_bench(w, args, argv)


if __name__ == "__main__":
    main()
