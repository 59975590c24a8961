"""
Serving: many requests at once through one static KV cache (continuous batching), measured by bench/serving.py.

        queue ─► free slot ─► prefill (whole prompt, or chunk by chunk) ─► decode steps ─► done, slot freed
                                   one prefill piece, then one decode step for all running slots, repeat

The cache has `n_slots` rows of `slot_len` positions, set up once, and one more: the stage. A request takes
the lowest free slot, is prefilled in the stage row (generate.py's prefill at batch 1; one request at a time,
each chunk a CUDA graph on a GPU, padded to the next of engine.PREFILL_BUCKETS), its prompt's K/V then copied
to its slot once; then it decodes one token per step next to every other running request, each at its own
position. A decode step runs the smallest bucket of rows (BUCKETS) that covers the highest running slot, one
CUDA graph per bucket on a GPU (Server.warm_up compiles every kernel and captures every graph before the first
request);
rows that are not decoding run a dummy token where no request reads. Overload, cancellation and non-finite
logits end one request alone, with one line in Request.error (tests/test_serve_stress.py). Greedy, with decode
steps of at most model.ffn_rule.max_rows rows (wide.FFNRule), gives every request the tokens of generating it
alone (tests/test_serve.py); sampling draws from each request's own seeded stream (sample_rows).
    python serve.py --sparsity 0.5 --port 8000    # the OpenAI-compatible front (make_app) over the loop (Loop)
"""
import asyncio
import contextlib
import json
import os
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field

import torch

import checkpoints
import cli
import data
import engine
from model import KVCache, greedy, sample_rows

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)  # decode batch sizes with their own CUDA graph


# eq=False: a request is compared by identity, so cancel() removes this request from the queue, not
# another one that happens to carry the same prompt.
@dataclass(eq=False)
class Request:
    prompt: list                  # token ids
    max_new_tokens: int
    arrival: float = 0.0          # seconds after the start (or loop iterations, with a fake clock)
    temperature: float = 0.0      # 0: greedy; else a draw from softmax(logits / temperature) ...
    top_k: int = 0                # ... over the top_k likeliest tokens (0: all) ...
    top_p: float = 1.0            # ... and the smallest set of them whose probability reaches top_p
    seed: int = None              # the request's own random stream (None: a fresh one)
    stop_ids: tuple = ()          # token ids that end the request (an end-of-text token), kept in tokens
    tokens: list = field(default_factory=list)   # the generated ids
    finish: str = None            # "length" (max_new_tokens reached) or "stop" (a stop id), when it ended so
    error: str = None             # set when it was rejected, cancelled or stopped (one line)
    slot: int = None
    prefilled: int = 0            # prompt tokens already in the cache
    t_first: float = None         # when the first new token was known (TTFT = t_first - arrival)
    t_done: float = None
    generator: object = None      # its random stream (made at submit when temperature > 0)


class SlotView(torch.nn.Module):
    """Rows of a layer's static KV cache, used as the layer's KV cache: views, so writes land in place."""

    def __init__(self, cache, rows):
        super().__init__()
        self.k_cache, self.v_cache = cache.k_cache[rows], cache.v_cache[rows]

    update = KVCache.update  # scatter K/V at input_pos ([T], or [B, T] per row), as the full cache does


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
        forward.setup_caches(n_slots + 1, slot_len)  # the last row: the stage every prefill runs in
        self.caches = [layer.self_attn.kv_cache for layer in self.model.layers]
        # Prefill graphs need the engine, and a chunk after the first whose attention reads its start on the device
        self.graph_prefill = self.cuda_graph and self.is_engine and forward.policy.dense_chunk_attention == "triton"
        self.stage, self.staged = n_slots, None  # the stage's row, and the request prefilling there
        self.prefill_graphs = []  # engine.CUDAGraphPrefill, shortest first
        self.buckets = sorted({b for b in BUCKETS if b < n_slots} | {n_slots})
        self.graphs = {}                 # bucket -> CUDAGraphDecoder
        self.slots = [None] * n_slots    # the request in each slot, or None
        self.queue = []                  # waiting for a slot, at most max_queue
        self.done = []                   # every request that ended: done, rejected, cancelled or stopped
        self.steps, self.busy = 0, []    # decode steps run; running requests at each step
        self.marks = []                  # [phase, start, end (CUDA events or clock), tokens or rows]: bench.serving

    def close(self):
        self.graphs.clear()
        self.prefill_graphs.clear()
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
        req.finish, req.generator = None, None
        need = len(req.prompt) + req.max_new_tokens
        # The last position (slot_len - 1) is the dummy rows' scratch: a request may use the ones before it.
        if need > self.slot_len - 1 or not req.prompt or req.max_new_tokens < 1:
            why = (f"rejected: {len(req.prompt)} prompt tokens + {req.max_new_tokens} new tokens do not fit a "
                   f"slot of {self.slot_len - 1} positions; shorten the prompt or lower max_new_tokens")
        elif not (req.temperature >= 0 and req.top_k >= 0 and 0 < req.top_p <= 1):
            why = (f"rejected: temperature {req.temperature}, top_k {req.top_k}, top_p {req.top_p}: give a "
                   "temperature >= 0, a top_k >= 0 (0: all tokens) and a top_p in (0, 1]")
        elif len(self.queue) >= self.max_queue:  # overload: refuse now rather than hold it without bound
            why = (f"rejected: {len(self.queue)} requests already wait (max_queue {self.max_queue}); "
                   f"retry later or raise max_queue")
        else:
            if req.temperature > 0:
                req.generator = torch.Generator(device=self.device)
                req.generator.manual_seed(req.seed) if req.seed is not None else req.generator.seed()
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
                if self.staged is req:
                    self.scrub(self.stage)
        if self.staged is req:
            self.staged = None
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
        if filling:  # the stage holds one request's prompt: it finishes before the next one starts
            with self.timed("prefill") as mark:
                mark[-1] = self.prefill(self.staged or min(filling, key=lambda r: r.arrival), now)
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

    def prefill(self, req, now):
        P, start = len(req.prompt), req.prefilled
        end = P if not self.chunk else min(P, start + self.chunk)
        self.staged, ids = req, req.prompt[start:end]
        graph = next((g for g in self.prefill_graphs if g.fits(end - start, start)), None)
        if graph is not None:
            logits = graph(ids, start)
        else:
            self.use_rows(slice(self.stage, self.stage + 1))
            logits = self.forward(torch.tensor([ids], device=self.device), logits_at=torch.tensor([len(ids) - 1]).to(
                self.device), input_pos=torch.arange(start, end, device=self.device))
        req.prefilled = end
        # Only the last piece is read back: a NaN in an earlier chunk's K/V shows there, as every later
        # position attends to it. Its last position gives the first new token (or -1: not finite).
        if end == P:  # the prompt's K/V go from the stage to the request's slot, where its decode steps read them
            for cache in self.caches:
                cache.k_cache[req.slot, :, :P].copy_(cache.k_cache[self.stage, :, :P])
                cache.v_cache[req.slot, :, :P].copy_(cache.v_cache[self.stage, :, :P])
            self.take(req, int(self.pick(logits[:, -1], [req])[0]), now)  # a NaN there scrubs the stage too
            self.staged = None
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
        rows = [r if r in running else None for r in self.slots[:n]]
        nxt = self.pick(logits, rows).tolist()  # the one host sync of a step: tokens, -1 for a non-finite row
        self.steps += 1
        self.busy.append(len(running))
        for r in running:
            self.take(r, nxt[r.slot], now)
        return len(running)

    def pick(self, logits, rows):
        """The next token of each row of logits [n, vocab] (rows: the request of each row, or None): greedy
        unless a row's request samples (sample_rows, with noise from that request's generator)."""
        if all(r is None or r.temperature == 0 for r in rows):
            return greedy(logits)
        noise = torch.zeros(logits.shape, device=logits.device)
        for i, r in enumerate(rows):
            if r is not None and r.temperature > 0:
                noise[i] = torch.rand(logits.shape[1], generator=r.generator, device=logits.device)
        param = lambda name, empty, dtype: torch.tensor([empty if r is None else getattr(r, name) for r in rows],
                                                        dtype=dtype, device=logits.device)
        return sample_rows(logits, param("temperature", 0.0, torch.float32), param("top_k", 0, torch.long),
                           param("top_p", 1.0, torch.float32), noise)

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
        if token in req.stop_ids or len(req.tokens) == req.max_new_tokens:
            req.finish = "stop" if token in req.stop_ids else "length"
            self.end(req, read(now))

    @torch.no_grad()  # the Triton engine refuses grad-enabled calls, and graphs capture no autograd
    def warm_up(self, prefill=None):
        """Before the first request, so that none pays a compile in its latency: a prefill chunk of every shape a
        request can reach (Engine.warm_prefill; default: on a GPU, as the interpreter compiles nothing), and every
        decode bucket's CUDA graph (all slots free: dummy rows at position 0)."""
        longest = self.chunk or self.slot_len - 1
        if self.is_engine and (self.cuda_graph if prefill is None else prefill):
            self.use_rows(slice(self.stage, self.stage + 1))
            self.forward.warm_prefill(longest, self.slot_len - 1)
            if self.graph_prefill:  # every chunk length's bucket, at start 0 and after it; one memory pool
                self.prefill_graphs.clear()
                pool = torch.cuda.graph_pool_handle()
                for later in (False, True) if longest < self.slot_len - 1 else (False,):
                    self.prefill_graphs += [engine.CUDAGraphPrefill(self.forward, n, later, self.slot_len, pool)
                                            for n in engine.prefill_sizes(longest)]
                self.prefill_graphs.sort(key=lambda g: g.tokens)
            self.scrub(self.stage)
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


# ----------------------------------------------------------------------------------- the HTTP front
class Loop:
    """The Server on a thread of its own, for the HTTP front: only this thread touches it. Requests and cancels come
    in through `inbox`; after each tick, each request whose tokens grew or that ended is reported to its callback."""

    def __init__(self, server):
        sys.setswitchinterval(5e-4)  # the GIL back soon after a step's sync: the front holds it in bursts
        self.server, self.inbox, self.watched = server, [], {}  # watched: request -> (callback, tokens reported)
        self.deliver = lambda batch: [report(*u) for report, u in batch]  # a step's reports (the front: one wake-up)
        self.wake, self.stopping, self.t0 = threading.Condition(), False, time.perf_counter()
        self.thread = threading.Thread(target=self.run, name="serve-loop", daemon=True)

    def now(self):
        return time.perf_counter() - self.t0

    def put(self, req, report=None):
        """Submit req, report(len(tokens), finish, error, ended) called as it makes progress; no report: cancel it."""
        with self.wake:
            self.inbox.append((req, report))
            self.wake.notify()

    def stop(self):
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join()

    def run(self):
        while True:
            with self.wake:
                while not (self.inbox or self.stopping or not self.server.idle()):
                    self.wake.wait()
                if self.stopping:
                    return
                todo, self.inbox = self.inbox, []
            for req, report in todo:
                if report is not None:
                    self.watched[req] = (report, 0)
                (self.server.submit if report else self.server.cancel)(req, self.now())
            try:
                if not self.server.idle():
                    self.server.tick(self.now)
            except Exception as e:  # a bug: the requests in flight end with its line, and the loop goes on
                traceback.print_exc()
                for req in [*self.server.queue, *(r for r in self.server.slots if r is not None)]:
                    self.server.cancel(req, self.now())
                    req.error = f"server error: {type(e).__name__}: {e}"
            batch = []
            for req, (report, sent) in list(self.watched.items()):
                ended = req.t_done is not None
                if ended or len(req.tokens) > sent:
                    batch.append((report, (len(req.tokens), req.finish, req.error, ended)))  # a count: no copy here
                    self.watched[req] = (report, len(req.tokens))
                if ended:
                    del self.watched[req]
            self.deliver(batch) if batch else None


class BadRequest(Exception):
    """A request the front refuses: BadRequest(HTTP status, one line saying what is wrong)."""


def field_of(body, name, kind, default, ok=lambda v: True, rule=""):
    # One field of a JSON body: the right type (an int is a number too; a bool is not an int) and range.
    v = body.get(name)
    if v is None:
        return default
    v = float(v) if kind is float and type(v) is int else v
    if not isinstance(v, kind) or isinstance(v, bool) != (kind is bool) or not ok(v):
        raise BadRequest(400, f"{name}: {v!r} is not {rule or kind.__name__}")
    return v


def completion_params(body, name, slot_len, tok, eot):
    """The request a /v1/completions body asks for, checked: (Request, stop strings, stream) or BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest(400, "the body must be a JSON object with at least a prompt")
    if body.get("model") not in (None, name):
        raise BadRequest(404, f"model {body['model']!r} is not served here; this server serves {name!r}")
    prompt = body.get("prompt")
    prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
    if not isinstance(prompt, str):
        raise BadRequest(400, "prompt: give one string (for several prompts, send one request each)")
    for unsupported, neutral in (("n", 1), ("best_of", 1), ("echo", False), ("logprobs", None), ("suffix", None),
                                 ("presence_penalty", 0), ("frequency_penalty", 0)):
        if body.get(unsupported, neutral) not in (neutral, None):
            raise BadRequest(400, f"{unsupported}: only {neutral} is supported here")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(x, str) and x for x in stop)):
        raise BadRequest(400, "stop: give a string or a list of at most 4 non-empty strings")
    ids = tok.encode(prompt).ids if prompt else ([eot] if eot is not None else [])
    if not ids:
        raise BadRequest(400, "prompt: empty, and this tokenizer has no end-of-text token to start from")
    max_tokens = field_of(body, "max_tokens", int, 16, lambda v: v >= 1, "a whole number >= 1")
    if len(ids) + max_tokens > slot_len - 1:
        raise BadRequest(400, f"{len(ids)} prompt tokens + max_tokens {max_tokens} do not fit the context of "
                              f"{slot_len - 1} tokens; shorten the prompt or lower max_tokens")
    req = Request(ids, max_tokens, stop_ids=() if eot is None else (eot,),
                  temperature=field_of(body, "temperature", float, 1.0, lambda v: 0 <= v <= 100, "a number in [0, 100]"),
                  top_p=field_of(body, "top_p", float, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"),
                  top_k=max(0, field_of(body, "top_k", int, 0, lambda v: v >= -1, "a whole number >= -1 (-1 or 0: all)")),
                  seed=field_of(body, "seed", int, None, lambda v: 0 <= v < 2 ** 63, "a whole number in [0, 2^63)"))
    return req, stop, field_of(body, "stream", bool, False)


def visible_text(tok, tokens, stop_ids, stop, ended, done):
    """(text so far, a stop string was found): the tokens' text without stop ids, cut at the first stop string.
    Until the request ends, a tail that could still become a stop string, or an unfinished UTF-8 character,
    is held back. done: [tokens, their text] decoded before, which this advances: only the rest is decoded."""
    tail = tok.decode([t for t in tokens[done[0]:] if t not in stop_ids])
    text = done[1] + tail
    if not tail.endswith("\ufffd"):  # whole characters: the next update starts from here
        done[:] = [len(tokens), text]
    cuts = [text.find(s) for s in stop if s in text]
    if cuts:
        return text[:min(cuts)], True
    if not ended:
        text = text[:len(text) - max([len(s) - 1 for s in stop] + [0])].rstrip("\ufffd")
    return text, False


def make_app(loop, tok, name, eot):
    """The OpenAI-compatible front: POST /v1/completions (whole, or streamed as server-sent events), GET
    /v1/models and /health. Each completion is one Request on `loop`; a client that goes away cancels it."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, StreamingResponse
    app, created = FastAPI(title="wide"), int(time.time())
    error = lambda status, message: JSONResponse({"error": dict(message=message, code=status, type=(
        "invalid_request_error" if status < 500 else "server_error"))}, status_code=status)

    app.get("/health")(lambda: dict(status="ok", running=sum(r is not None for r in loop.server.slots),
                                    queued=len(loop.server.queue)))
    app.get("/v1/models")(lambda: {"object": "list", "data": [dict(id=name, object="model", created=created,
                                                                   owned_by="wide")]})

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        try:
            body = json.loads(await http.body() or b"null")
            req, stop, stream = completion_params(body, name, loop.server.slot_len, tok, eot)
        except json.JSONDecodeError as e:
            return error(400, f"the body is not JSON ({e.msg} at position {e.pos})")
        except BadRequest as e:
            return error(*e.args)
        updates, aloop = asyncio.Queue(), asyncio.get_running_loop()
        loop.deliver = lambda batch: aloop.call_soon_threadsafe(lambda: [report(*u) for report, u in batch])
        loop.put(req, lambda *u: updates.put_nowait(u))
        while True:  # queued or prefilling: a client that leaves meanwhile gives its place up
            try:
                first = await asyncio.wait_for(updates.get(), 0.1)
                break
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    loop.put(req)
                    return error(400, "the client disconnected")
        if first[3] and first[2] and first[2].startswith("rejected"):  # the queue was full (the rest was checked)
            return error(429, first[2])
        reply = dict(id=f"cmpl-{uuid.uuid4().hex}", object="text_completion", created=int(time.time()), model=name)

        async def progress():
            # (text, finish reason or None) as tokens arrive; cancels the request once a stop string shows
            update, done = first, [0, ""]
            while True:
                while not updates.empty():  # behind the loop: only the latest update matters
                    update = updates.get_nowait()
                n, finish, err, ended = update
                text, stopped = visible_text(tok, req.tokens[:n], req.stop_ids, stop, ended, done)
                if stopped and not ended:
                    loop.put(req)
                if stopped or ended:
                    yield text, "stop" if stopped else finish or ("length" if err is None else "abort")
                    return
                yield text, None
                await asyncio.sleep(0.02)  # then the latest update: fewer, longer events, less work beside the loop
                update = await updates.get()

        usage = lambda: {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.tokens),
                         "total_tokens": len(req.prompt) + len(req.tokens)}
        if not stream:
            try:
                async for text, finish in progress():
                    if await http.is_disconnected():
                        break
            finally:
                loop.put(req)  # a cancel: a no-op once it ended; frees the slot of a client that went away
            if (req.error or "").startswith("server error"):
                return error(500, req.error)
            return dict(reply, choices=[dict(text=text, index=0, logprobs=None, finish_reason=finish)], usage=usage())

        async def events():
            sent = ""
            try:
                async for text, finish in progress():
                    if text != sent or finish:
                        piece, sent = text[len(sent):], text
                        choice = dict(text=piece, index=0, logprobs=None, finish_reason=finish)
                        yield f"data: {json.dumps(dict(reply, choices=[choice]))}\n\n"
                yield f"data: {json.dumps(dict(reply, choices=[], usage=usage()))}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                loop.put(req)  # a cancel: the client went away mid-stream (or the stream ended), free the slot
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


# ----------------------------------------------------------------------------------- the command line
def parse_args(argv):
    p = cli.Parser(prog="serve.py", description="The OpenAI-compatible completions API over continuous batching.")
    p.add_argument("--checkpoint", help="checkpoint directory (default: out/base, or the one nearest --sparsity)")
    p.add_argument("--sparsity", type=cli.fraction(), help="dial the routers trained for the nearest target to this")
    p.add_argument("--out-dir", default=None, help="train.py's checkpoints (default out, or routers/NAME with --model)")
    p.add_argument("--model", choices=sorted(checkpoints.PRETRAINED), help="a pretrained model, read from its GGUF")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=cli.integer(1, 65535), default=8000)
    p.add_argument("--slots", type=cli.integer(1), default=8, help="requests decoded together (cache rows)")
    p.add_argument("--slot-len", type=cli.integer(2), help="positions per slot (default: the context, <= 4096)")
    p.add_argument("--chunk", type=cli.integer(1), default=None, help="prefill prompts in chunks of this many tokens")
    p.add_argument("--max-queue", type=cli.integer(1), default=256, help="waiting requests; more get a 429")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"], help="auto: triton on a GPU")
    p.add_argument("--weights", default="bf16", choices=["bf16", "fp8", "fp8-gptq"], help="fp8: the prunable "
                   "linears as e4m3; fp8-gptq: with GPTQ's codes (as generate.py)")
    args = p.parse_args(argv)
    args.device = cli.pick_device(args.device)
    args.out_dir = args.out_dir or (os.path.join("routers", args.model) if args.model else "out")
    return args


def main(argv=None):
    args = parse_args(argv)
    with socket.socket() as s:  # a port already taken is one line now, not a traceback after the model loads
        try:
            s.bind((args.host, args.port))
        except OSError as e:
            cli.fail(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); pick another with --port")
    path, model, wcfg, _ = checkpoints.load_for_inference(
        args.checkpoint, args.model, args.out_dir, "wide", args.sparsity, None, None, windows=data.dial_windows,
        device=args.device, dtype=torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    if args.weights != "bf16" and engine.backend_of(model, args.backend) == "torch":  # before any calibration
        cli.fail(f"--weights {args.weights} runs on the Triton engine; add --backend triton (a CUDA GPU)")
    tok = checkpoints.tokenizer_for(path, args.model)
    weights = engine.fp8_weights(model.eval(), args.weights, tok)  # "fp8-gptq": GPTQ's codes, then "fp8"
    forward = engine.select(model, args.backend, weights=weights)  # the one backend switch
    slot_len = args.slot_len or min(model.config.max_seq_len, 4096)
    if slot_len > model.config.max_seq_len:
        cli.fail(f"--slot-len {slot_len} exceeds the model's context of {model.config.max_seq_len}")
    server = Server(forward, args.slots, slot_len, chunk=args.chunk, max_queue=args.max_queue)
    server.warm_up()  # every kernel compiled and every decode graph captured before the first request (on a GPU)
    name = "-".join(filter(None, [args.model, os.path.basename(os.path.normpath(path)) if os.path.isdir(path) else ""]))
    loop = Loop(server)
    loop.thread.start()
    import uvicorn
    print(f"serving {name} ({'WIDE' if wcfg else 'dense'}; backend {'triton' if server.is_engine else 'torch'}, "
          f"{args.slots} slots of {slot_len} positions) at http://{args.host}:{args.port}/v1", flush=True)
    try:
        uvicorn.run(make_app(loop, tok, name, tok.token_to_id("<|endoftext|>")), host=args.host, port=args.port,
                    log_level="warning")
    finally:
        loop.stop()
        server.close()


if __name__ == "__main__":
    cli.run(main)
