"""serve.py's HTTP front as a client sees it: the OpenAI client against a server on localhost (a tiny
checkpoint, backend torch on the CPU): whole and streamed completions, several clients at once, sampling
that follows its seed, stop strings, bad requests, a full queue, and a client that leaves mid-stream."""
import os
import socket
import threading
import time

import httpx
import pytest
import torch

import checkpoints
import engine
import serve
from conftest import assert_one_line_error, run_main, stopped
from generate import generate
from test_generate import out_dir  # noqa: F401  (the fixture: a tiny router checkpoint)

openai = pytest.importorskip("openai")
EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def ckpt(out_dir):
    """generate.py's test checkpoint: a router checkpoint as train.py writes it (random weights and routers)."""
    return os.path.join(out_dir, "wide-s0.5-stage1")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """make_app's app served by uvicorn on a thread (as serve.py's main runs it), with its Loop and Server."""

    def __init__(self, path, slots=4, max_queue=64, slow=0.0):
        import uvicorn
        self.model, _ = checkpoints.load_wide(path)
        self.own, _ = checkpoints.load_wide(path)
        self.tok = checkpoints.tokenizer_of(path)
        self.server = serve.Server(engine.select(self.model.eval(), "torch"), slots, 64, max_queue=max_queue)
        if slow:  # each loop iteration takes at least `slow` seconds: a queue can be seen to fill
            tick = self.server.tick
            self.server.tick = lambda now: (time.sleep(slow), tick(now))
        self.loop = serve.Loop(self.server)
        self.loop.thread.start()
        self.name = "wide-s0.5-stage1"
        app = serve.make_app(self.loop, self.tok, self.name, self.tok.token_to_id(EOT))
        self.port = free_port()
        self.http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.http.run, daemon=True)
        self.thread.start()
        while not self.http.started:
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def close(self):
        self.http.should_exit = True
        self.thread.join()
        self.loop.stop()
        self.server.close()

    def alone(self, prompt, n):
        """generate.py's greedy text for this prompt (its own batch of one, on its own copy of the model: the
        server's holds the server's cache), cut at the end-of-text token."""
        ids = self.tok.encode(prompt).ids
        out = generate(self.own, torch.tensor([ids]), n)[0, len(ids):].tolist()
        eot = self.tok.token_to_id(EOT)
        return self.tok.decode(out[:out.index(eot)] if eot in out else out)


@pytest.fixture(scope="module")
def front(ckpt):
    r = Running(ckpt)
    yield r
    r.close()


def test_models_and_health(front):
    assert [m.id for m in front.client.models.list().data] == [front.name]
    assert httpx.get(front.url + "/health").json()["status"] == "ok"


def test_a_greedy_completion_is_generate_py_text_for_the_same_prompt(front):
    got = front.client.completions.create(model=front.name, prompt="ROMEO:", max_tokens=12, temperature=0)
    assert got.choices[0].text == front.alone("ROMEO:", 12)
    assert got.choices[0].finish_reason in ("length", "stop")
    assert got.usage.prompt_tokens == len(front.tok.encode("ROMEO:").ids) and got.usage.completion_tokens <= 12


def test_a_streamed_completion_adds_up_to_the_whole_one(front):
    whole = front.client.completions.create(model=front.name, prompt="But soft", max_tokens=10, temperature=0)
    chunks = list(front.client.completions.create(model=front.name, prompt="But soft", max_tokens=10,
                                                  temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])


def test_several_clients_at_once_each_get_their_own_text(front):
    prompts = ["ROMEO:", "It is the east", "Juliet", "But soft, what", "yonder window", "the sun"]
    got = {}

    def ask(p):
        got[p] = front.client.completions.create(model=front.name, prompt=p, max_tokens=8, temperature=0).choices[0].text
    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert got == {p: front.alone(p, 8) for p in prompts}


def test_sampling_follows_the_seed(front):
    ask = lambda seed: front.client.completions.create(model=front.name, prompt="ROMEO:", max_tokens=12,
                                                       temperature=1.5, top_p=0.95, seed=seed,
                                                       extra_body=dict(top_k=50)).choices[0].text
    first = ask(1)
    assert ask(1) == first
    assert any(ask(s) != first for s in (2, 3, 4)), "other seeds give other samples"


def test_a_stop_string_ends_the_text_before_it(front):
    full = front.client.completions.create(model=front.name, prompt="ROMEO:", max_tokens=12, temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    got = front.client.completions.create(model=front.name, prompt="ROMEO:", max_tokens=12, temperature=0, stop=[stop])
    assert got.choices[0].text == full[:full.index(stop)] and got.choices[0].finish_reason == "stop"
    streamed = front.client.completions.create(model=front.name, prompt="ROMEO:", max_tokens=12, temperature=0,
                                               stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[:full.index(stop)]


@pytest.mark.parametrize("body, status, words", [
    (dict(prompt="ROMEO:", temperature=-1), 400, ["temperature"]),
    (dict(prompt="ROMEO:", max_tokens=0), 400, ["max_tokens"]),
    (dict(prompt="ROMEO:", max_tokens=500), 400, ["do not fit", "max_tokens"]),
    (dict(prompt="ROMEO:", top_p=0), 400, ["top_p"]),
    (dict(prompt=["a", "b"]), 400, ["prompt"]),
    (dict(max_tokens=4), 400, ["prompt"]),
    (dict(prompt="ROMEO:", n=2), 400, ["n"]),
    (dict(prompt="ROMEO:", stop=7), 400, ["stop"]),
    (dict(prompt="ROMEO:", model="gpt-4"), 404, ["gpt-4"]),
])
def test_a_bad_request_is_one_clear_message(front, body, status, words):
    r = httpx.post(front.url + "/v1/completions", json=body)
    assert r.status_code == status
    message = r.json()["error"]["message"]
    assert "\n" not in message and all(w in message for w in words), message


def test_a_body_that_is_not_json_is_a_400(front):
    r = httpx.post(front.url + "/v1/completions", content=b"{prompt", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]


def wait_until(check, timeout=20.0):
    t = time.time()
    while not check():
        assert time.time() - t < timeout, "timed out"
        time.sleep(0.02)


def test_a_full_queue_answers_429_and_a_client_that_leaves_frees_its_slot(ckpt):
    r = Running(ckpt, slots=1, max_queue=1, slow=0.05)
    try:
        health = lambda: httpx.get(r.url + "/health").json()
        body = dict(model=r.name, prompt="ROMEO:", max_tokens=40, temperature=0, stream=True)
        with httpx.stream("POST", r.url + "/v1/completions", json=body, timeout=30) as a:
            lines = a.iter_lines()  # (held: dropping the iterator would close the stream)
            next(lines)  # the first event: the request holds the only slot
            waiting = threading.Thread(target=lambda: httpx.post(r.url + "/v1/completions", timeout=60,
                                                                 json=dict(body, stream=False, max_tokens=2)))
            waiting.start()
            wait_until(lambda: health()["queued"] == 1)
            full = httpx.post(r.url + "/v1/completions", json=dict(body, stream=False))
            assert full.status_code == 429 and "max_queue" in full.json()["error"]["message"]
        # the streaming client left after one event: its slot goes to the waiting request, which finishes
        waiting.join(timeout=30)
        assert not waiting.is_alive()
        wait_until(lambda: health() == dict(status="ok", running=0, queued=0))
        cancelled = [q for q in r.server.done if q.error == "cancelled"]
        assert len(cancelled) == 1 and len(cancelled[0].tokens) < 40
    finally:
        r.close()


def test_main_serves_the_checkpoint_the_flags_name(ckpt, capsys, monkeypatch):
    import uvicorn
    from fastapi.testclient import TestClient
    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(app=app, **kw))
    out = run_main(capsys, serve.main, "--checkpoint", ckpt, "--port", str(free_port()), "--slots", "2",
                   "--backend", "torch")
    assert out.returncode == 0, out.stderr
    assert "serving wide-s0.5-stage1" in out.stdout and "/v1" in out.stdout
    # main stopped its loop when uvicorn returned; a test client on the same app sees its models
    assert TestClient(served["app"]).get("/v1/models").json()["data"][0]["id"] == "wide-s0.5-stage1"


def test_bad_flags_end_in_one_line(ckpt, capsys, tmp_path):
    assert_one_line_error(stopped(capsys, serve.main, "--checkpoint", ckpt, "--port", "70000"), "--port")
    assert_one_line_error(stopped(capsys, serve.main, "--checkpoint", str(tmp_path / "nope"), "--port",
                                  str(free_port())), "does not exist")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert_one_line_error(stopped(capsys, serve.main, "--checkpoint", ckpt, "--port", str(s.getsockname()[1])),
                              "cannot listen", "--port")
    assert_one_line_error(stopped(capsys, serve.main, "--checkpoint", ckpt, "--port", str(free_port()),
                                  "--slot-len", "1000"), "--slot-len", "context")


def test_a_failing_step_ends_the_requests_in_flight_with_a_500_and_the_server_goes_on(ckpt):
    r = Running(ckpt, slots=2)
    try:
        tick, broken = r.server.tick, [True]

        def tick_once_broken(now):
            if broken.pop() if broken else False:
                raise RuntimeError("a bug in the step")
            return tick(now)
        r.server.tick = tick_once_broken
        bad = httpx.post(r.url + "/v1/completions", json=dict(prompt="ROMEO:", max_tokens=4, temperature=0), timeout=30)
        assert bad.status_code == 500 and "a bug in the step" in bad.json()["error"]["message"]
        good = r.client.completions.create(model=r.name, prompt="ROMEO:", max_tokens=4, temperature=0)
        assert good.choices[0].text == r.alone("ROMEO:", 4)
    finally:
        r.close()
