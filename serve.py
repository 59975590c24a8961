"""
Serving: many requests at once through one static KV cache (continuous batching).

Whether WIDE keeps its gains there is measured by bench_serve.py (Poisson arrivals, dense vs WIDE ->
results/serving_h200.*); why weight skipping fades as the batch grows, by mask_union.py.

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
import contextlib
import time
from dataclasses import dataclass, field

import torch

import engine
from generate import CUDAGraphDecoder
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
