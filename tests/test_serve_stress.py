"""The serving loop under stress (serve.py): a full queue, cancellation, non-finite logits.

CPU, fp32, the small model of test_e2e.py, greedy. The loop is driven one iteration at a time here (a
fake clock) so that a test can act between two iterations: cancel a request mid-decode or between two
prefill chunks, or poison one slot's KV cache with NaN. The property is always the one of
test_serve.py: every request that runs to the end has exactly the tokens of generating it alone, also
the one that takes a slot right after its occupant was cancelled or stopped.
"""
import itertools
import math

import pytest
import torch

import engine
import serve
from model import greedy
from test_e2e import SKIPPING, wide_model
from test_serve import alone, requests


def drive(server, reqs, when=lambda: False, act=None):
    """Submit reqs (all accepted), then run the loop until it is idle; the first time when() holds
    between two iterations, act(now) runs there. Returns whether it did."""
    tick = itertools.count().__next__  # one tick per clock read, as test_serve.serve_all
    assert all(server.submit(r, tick()) for r in reqs)
    acted = False
    for _ in range(200):  # far more iterations than these requests need: a loop that never idles fails
        if server.idle():
            return acted
        if not acted and when():
            act(tick())
            acted = True
        server.tick(tick)
    pytest.fail(f"the loop is still busy after 200 iterations: {server.slots}")


def decoding(req, n):
    return lambda: len(req.tokens) == n and req.t_done is None


def between_chunks(req):
    return lambda: 0 < req.prefilled < len(req.prompt)


# ------------------------------------------------------------------------------------ a bounded queue
def test_a_full_queue_rejects_at_once_with_one_line_and_the_queued_requests_still_run():
    m = wide_model()
    reqs = requests(5, 7)
    server = serve.Server(m, n_slots=2, slot_len=32, max_queue=3)
    accepted = [server.submit(r, now=5.0) for r in reqs]
    assert accepted == [True] * 3 + [False] * 4 and len(server.queue) == 3  # never more than max_queue
    for r in reqs[3:]:  # rejected as a prompt that does not fit is: error, t_done, in done, no tokens
        assert r.error == "rejected: 3 requests already wait (max_queue 3); retry later or raise max_queue"
        assert r.t_done == 5.0 and r.slot is None and r.tokens == [] and r in server.done
    server.tick(lambda: 6.0)  # two of the three take the slots: the queue has room again
    assert len(server.queue) == 1 and server.submit(reqs[3], now=6.0) and server.queue[-1] is reqs[3]
    with pytest.raises(ValueError, match="already queued or running"):  # the same request twice: a bug
        server.submit(reqs[0])
    drive(server, [])
    for r in reqs[:4]:
        assert r.error is None and r.tokens == alone(m, r)
    assert server.done.count(reqs[3]) == 2  # rejected once, then served: both ends are reported


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_max_queue_must_be_a_whole_number_of_at_least_one(bad):
    with pytest.raises(ValueError) as e:
        serve.Server(wide_model(), n_slots=2, slot_len=32, max_queue=bad)
    msg = str(e.value)
    assert "\n" not in msg and f"max_queue {bad!r}" in msg and "whole number >= 1" in msg


# ------------------------------------------------------------------------------------- cancellation
@pytest.mark.parametrize("where", ["decode", "between prefill chunks"])
def test_cancel_frees_the_slot_at_once_and_its_next_occupant_equals_generating_it_alone(where):
    # a takes slot 0 and is cancelled; c waits in the queue and must land in slot 0 next. Its prompt is
    # shorter than what a had written there, so a's K/V stay behind in the row, past c's positions.
    m = wide_model()
    a = serve.Request(list(range(3, 15)), 10)
    b = serve.Request([7, 1, 4, 1, 5], 8)
    c = serve.Request([2, 7, 1], 6)
    server = serve.Server(m, n_slots=2, slot_len=32, chunk=4)
    state = {}

    def cancel(now):
        state["tokens"] = list(a.tokens)
        assert server.cancel(a, now) and server.slots[0] is None and a.error == "cancelled" and a.t_done == now
        assert not server.cancel(a, now)  # a second cancel changes nothing

    when = decoding(a, 3) if where == "decode" else between_chunks(a)
    assert drive(server, [a, b, c], when, cancel)
    assert a.tokens == state["tokens"] == alone(m, a)[:len(a.tokens)]  # kept, and no token after the cancel
    assert len(a.tokens) == (3 if where == "decode" else 0) and server.done.count(a) == 1
    assert c.slot == a.slot == 0 and b.slot == 1
    for r in (b, c):
        assert r.error is None and r.tokens == alone(m, r)


def test_cancel_a_queued_request_removes_it_before_it_takes_a_slot():
    m = wide_model()
    reqs = requests(6, 4)
    twin = serve.Request(list(reqs[2].prompt), reqs[2].max_new_tokens, reqs[2].arrival)  # equal, not the same
    server = serve.Server(m, n_slots=2, slot_len=32)
    drive(server, reqs + [twin], lambda: True, lambda now: server.cancel(twin, now))
    assert twin.error == "cancelled" and twin.slot is None and twin.tokens == []
    for r in reqs:  # reqs[2] is not the one cancelled, though it compares its fields equal
        assert r.error is None and r.tokens == alone(m, r)
    assert not server.cancel(serve.Request([1, 2], 2))  # never submitted: nothing to cancel


# ------------------------------------------------------------------------------- non-finite logits
def poison(server, req):
    """NaN into every layer's K/V cache of req's slot, at the positions it has written: its next forward
    reads them (a hidden state gone bad) and its logits come out NaN."""
    written = req.prefilled + max(0, len(req.tokens) - 1)
    row = server.stage if server.staged is req else req.slot  # between chunks its prompt is in the stage row
    for cache in server.caches:
        cache.k_cache[row, :, :written] = math.nan
        cache.v_cache[row, :, :written] = math.nan


@pytest.mark.parametrize("where", ["decode", "between prefill chunks"])
def test_nonfinite_logits_stop_that_request_alone_and_leave_its_slot_clean(where):
    # Three requests run side by side, a fourth waits. b's cache row is poisoned: b ends with one error
    # line, a and c are untouched, and d, which takes b's slot, equals generating it alone. Without the
    # scrub, the NaN left in the row (masked, but 0 * NaN) would spread into d.
    m = wide_model()
    a = serve.Request([5, 9, 2, 6], 8)
    b = serve.Request(list(range(20, 33)), 8)
    c = serve.Request([3, 3, 8], 8)
    d = serve.Request([4, 1, 8, 2, 9, 0, 3, 1, 6, 7, 5], 6)
    server = serve.Server(m, n_slots=3, slot_len=32, chunk=5)
    when = decoding(b, 2) if where == "decode" else between_chunks(b)
    assert drive(server, [a, b, c, d], when, lambda now: poison(server, b))
    n = 2 if where == "decode" else 0
    p = len(b.prompt) + n - 1  # the position whose logits were NaN: the last one fed
    assert b.error == (f"non-finite logits (NaN or inf) at position {p}; the request was stopped with its {n} "
                       f"tokens (check the weights, or run in bf16/fp32)")
    assert b.tokens == alone(m, b)[:n] and b.t_done is not None and server.done.count(b) == 1
    assert d.slot == b.slot == 1
    for r in (a, c, d):
        assert r.error is None and r.tokens == alone(m, r), f"slot {r.slot}"


def test_greedy_marks_a_row_with_nan_or_inf_and_keeps_the_others_argmax():
    logits = torch.tensor([[0.0, 2.0, 1.0], [math.inf, 0.0, 0.0], [0.0, math.nan, 0.0], [-math.inf, 1.0, 0.0]])
    assert greedy(logits).tolist() == [1, -1, -1, -1]


def test_the_finiteness_check_costs_no_host_read_beyond_the_tokens(monkeypatch):
    # On a GPU each read of a tensor's value waits for the device. The loop reads once per decode step
    # (all rows' tokens) and once per prompt (its first token); the check must ride on those reads.
    m = wide_model()
    reqs = requests(3, 6)
    server = serve.Server(m, n_slots=3, slot_len=32, chunk=4)
    reads, phases = [], []
    for name in ("tolist", "item", "numpy", "__int__", "__float__", "__bool__", "__index__"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _m=method, _n=name, **k: (reads.append(_n), _m(self, *a, **k))[1])
    for phase in ("prefill", "decode"):
        run = getattr(server, phase)
        monkeypatch.setattr(server, phase, lambda *a, _r=run, _p=phase: (phases.append(_p), _r(*a))[1])
    drive(server, reqs)
    monkeypatch.undo()
    assert all(r.error is None and r.tokens == alone(m, r) for r in reqs)
    assert phases.count("decode") == server.steps > 0 and phases.count("prefill") > len(reqs)  # chunks too
    assert len(reads) == server.steps + len(reqs), f"host reads: {sorted(set(reads))}"


# ----------------------------------------------------------------------- the Triton engine, the same
def test_cancel_and_nonfinite_logits_on_the_triton_engine_leave_the_other_rows_and_the_next_occupant_exact(launches):
    # The interpreter pays for every forward (six here): a is cancelled mid-decode and b poisoned between
    # the same two iterations; c takes a's slot and decodes next to b in the step where b's NaN shows.
    # Tokens are checked against the torch backend's generate, whose greedy tokens equal the engine's
    # (test_e2e.py).
    m = wide_model()
    a, b, c = serve.Request([5, 9, 2], 4), serve.Request([8, 1, 4], 4), serve.Request([3, 7], 2)
    server = serve.Server(engine.Engine(m), n_slots=2, slot_len=16)
    kept = []

    def act(now):
        kept.extend(a.tokens)
        assert server.cancel(a, now)
        poison(server, b)

    with torch.no_grad():
        assert drive(server, [a, b, c], decoding(b, 2), act)
    assert a.error == "cancelled" and a.tokens == kept == alone(m, a)[:len(kept)] and 0 < len(kept) < 4
    assert b.error.startswith("non-finite logits (NaN or inf) at position 4;") and b.tokens == alone(m, b)[:2]
    assert c.slot == a.slot == 0 and c.error is None and c.tokens == alone(m, c)
    assert server.steps == 3 and server.busy[-1] == 2  # c and b shared the step that stopped b
    for name in SKIPPING:
        assert launches.count(name) > 0, f"{name} never ran: the serving loop did not take the Triton path"
