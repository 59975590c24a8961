"""
Serving: many requests at once through one static KV cache (continuous batching), measured by bench/serving.py.

        queue ─► free slot ─► prefill (whole prompt, or chunk by chunk) ─► decode steps ─► done, slot freed
                                   one prefill piece, then one decode step for all running slots, repeat

The cache has `n_slots` rows of `slot_len` positions, set up once. A request takes the lowest free slot, is
prefilled straight into that row (SlotView: generate.py's prefill at batch 1, no copy), then decodes one
token per step next to every other running request, each at its own position. A decode step runs the
smallest bucket of rows (BUCKETS) that covers the highest running slot, one CUDA graph per bucket on a GPU;
rows that are not decoding run a dummy token where no request reads. Overload, cancellation and non-finite
logits end one request alone, with one line in Request.error (tests/test_serve_stress.py). Greedy only:
with decode steps of at most model.ffn_rule.max_rows rows (wide.FFNRule) every request's tokens are those
of generating it alone (tests/test_serve.py); a larger step runs the whole FFN, so they depend on the batch.
"""
import contextlib
import time
from dataclasses import dataclass, field

import torch

import engine
from model import KVCache

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)  # decode batch sizes with their own CUDA graph


# eq=False: a request is compared by identity, so cancel() removes this request from the queue, not
# another one that happens to carry the same prompt.
@dataclass(eq=False)
class Request:
    prompt: list                  # token ids
    max_new_tokens: int
    arrival: float = 0.0          # seconds after the start (or loop iterations, with a fake clock)
    tokens: list = field(default_factory=list)   # the generated ids
    error: str = None             # set when it was rejected, cancelled or stopped (one line)
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


def greedy(logits):
    """logits [..., vocab] -> the argmax ids [...], -1 where a row holds NaN or inf. One tensor, so the
    one host read of a step brings back the tokens and the finiteness check together."""
    return torch.where(torch.isfinite(logits).all(-1), logits.argmax(-1), -1)


def read(now):
    return time.perf_counter() if now is None else now()


class Server:
    """Continuous batching over a fixed number of cache slots. forward: engine.select(model, backend).
    max_queue: how many requests may wait for a slot; submit() rejects the ones beyond it."""

    def __init__(self, forward, n_slots, slot_len, chunk=None, cuda_graph=None, max_queue=1024):
        self.forward, self.n_slots, self.slot_len = forward, n_slots, slot_len
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue {max_queue!r}: give a whole number >= 1 (how many requests may wait "
                             f"for a slot before new ones are rejected)")
        self.max_queue = max_queue
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
        self.queue = []                  # waiting for a slot, at most max_queue
        self.done = []                   # every request that ended: done, rejected, cancelled or stopped
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
        """Queue a request (True), or reject it at once (False: error set, t_done = now, in `done`)."""
        if req in self.queue or req in self.slots:  # identity (Request has eq=False)
            raise ValueError("this request is already queued or running: cancel it first, or submit a new one")
        # A request submitted again (a retry after a rejection, or after a cancel) starts from scratch.
        req.tokens, req.prefilled, req.slot, req.t_first, req.error, req.t_done = [], 0, None, None, None, None
        need = len(req.prompt) + req.max_new_tokens
        # The last position (slot_len - 1) is the dummy rows' scratch: a request may use the ones before it.
        if need > self.slot_len - 1 or not req.prompt or req.max_new_tokens < 1:
            why = (f"rejected: {len(req.prompt)} prompt tokens + {req.max_new_tokens} new tokens do not fit a "
                   f"slot of {self.slot_len - 1} positions; shorten the prompt or lower max_new_tokens")
        elif len(self.queue) >= self.max_queue:  # overload: refuse now rather than hold it without bound
            why = (f"rejected: {len(self.queue)} requests already wait (max_queue {self.max_queue}); "
                   f"retry later or raise max_queue")
        else:
            self.queue.append(req)
            return True
        self.end(req, now, why)
        return False

    def cancel(self, req, now=0.0):
        """Stop a request wherever it is: queued, between prefill chunks, or decoding. Its slot is free at
        once and it keeps the tokens it has (error "cancelled"). False if it had already ended, or was
        never submitted here."""
        if req in self.queue:
            self.queue.remove(req)
        elif req.slot is None or self.slots[req.slot] is not req:
            return False
        self.end(req, now, "cancelled")
        return True

    def end(self, req, t, error=None):
        """Every way a request ends goes through here: done, rejected, cancelled, or stopped."""
        req.error, req.t_done = error, t
        if req.slot is not None and self.slots[req.slot] is req:
            self.slots[req.slot] = None  # free at once: the next request can take it in the next iteration
            if error is not None:
                self.scrub(req.slot)
        self.done.append(req)

    def scrub(self, slot):
        # Zero the slot's row in every layer, all positions (the scratch one too). Attention masks stale
        # positions, but a masked NaN still makes NaN (0 * NaN), so a row that may hold one must not be
        # handed on as it is. Only early ends pay for it (2 fills per layer), never a normal finish.
        for cache in self.caches:
            cache.k_cache[slot].zero_()
            cache.v_cache[slot].zero_()

    def idle(self):
        return not self.queue and all(r is None for r in self.slots)

    @torch.no_grad()
    def tick(self, now):
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
        # Only the last piece is read back: a NaN in an earlier chunk's K/V shows there, as every later
        # position attends to it.
        if end == P:  # the last piece: its last position gives the first new token (or -1: not finite)
            self.take(req, int(greedy(logits[0, -1])), now)
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
                self.graphs[n] = engine.CUDAGraphDecoder(self.forward, token, pos)
            logits = self.graphs[n](token, pos)
        else:
            self.use_rows(slice(0, n))
            logits = self.forward(token, input_pos=pos.view(-1, 1))[:, -1]
        nxt = greedy(logits).tolist()  # the one host sync of a step: tokens, -1 for a non-finite row
        self.steps += 1
        self.busy.append(len(running))
        for r in running:
            self.take(r, nxt[r.slot], now)
        return len(running)

    def take(self, req, token, now):
        """A running request's next token: append it (ending the request at max_new_tokens), or, for -1,
        stop the request alone. Rows never mix in the model (WIDE's mask union only decides which tiles
        run, never another row's values), so the other requests run on untouched."""
        if token < 0:
            p = len(req.prompt) + len(req.tokens) - 1  # the position whose logits were not finite
            self.end(req, read(now), f"non-finite logits (NaN or inf) at position {p}; the request was stopped "
                                     f"with its {len(req.tokens)} tokens (check the weights, or run in bf16/fp32)")
            return
        req.tokens.append(token)
        if len(req.tokens) == 1:
            req.t_first = read(now)
        if len(req.tokens) == req.max_new_tokens:
            self.end(req, read(now))

    @torch.no_grad()  # the Triton engine refuses grad-enabled calls, and graphs capture no autograd
    def warm_up(self):
        """Capture every bucket's CUDA graph before timing (all slots free: dummy rows at position 0)."""
        for n in self.buckets if self.cuda_graph else []:
            self.use_rows(slice(0, n))
            z = torch.zeros(n, 1, dtype=torch.long, device=self.device)
            self.graphs[n] = engine.CUDAGraphDecoder(self.forward, z, z.view(-1).clone())

    def serve(self, requests, now=None):
        """Serve requests (arrival: seconds after the start) until each has ended (done, rejected, stopped).
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
            self.tick(since)
        return requests
