"""The engine runs what policy.py plans, and nothing else.

`Policy.plan(shape, routers)` is the one place that decides where each op of a step runs. These tests run
steps of several shapes through the engine under the launch recorder (conftest.py) and assert that the
Triton kernels that launched are exactly the ones the plan lists: decode at batch 1 and 8, a prefill at
Policy.sparse_prefill_min_tokens (where gemm_mn's sorted tiles take over; lowered to 96 tokens here,
as the interpreter pays per program), a later chunk of a
prompt, the dense model, and fp8 weights. (The thresholds themselves, 2048 and 4096 tokens included,
are checked on the plan alone.) A plan the engine is handed is followed, and the text generate.py prints comes from the plan.
"""
import contextlib
from collections import Counter

import pytest
import torch

import engine
import policy
from policy import Policy
from wide import FFNRule
from test_e2e import ALL_SPARSE, DEV, wide_model

SHAPES = {  # name -> (routers, weights, batch, tokens per row, chunk start or None for a decode step)
    "decode B1": (True, "bf16", 1, 1, None),
    "decode B8": (True, "bf16", 8, 1, None),  # the batch rule: the FFN runs dense, attention stays routed
    "decode B8, FFN rule off": (True, "bf16", 8, 1, None),
    "decode B20, all sparse": (True, "bf16", 20, 1, None),  # more rows than the GEMV takes: sorted tiles
    "prefill at the sorted-tile threshold": (True, "bf16", 2, 48, 0),  # gemm_mn's sorted tiles (96 tokens)
    "later chunk": (True, "bf16", 2, 24, 40),
    "dense decode B1": (False, "bf16", 1, 1, None),  # Policy.dense_gemv_max_tokens: WIDE's kernels, every group live
    "dense decode B1, cuBLAS linears": (False, "bf16", 1, 1, None),
    "dense later chunk": (False, "bf16", 2, 24, 40),
    "fp8 decode B1": (True, "fp8", 1, 1, None),
    "fp8 dense decode B8": (False, "fp8", 8, 1, None),  # _scaled_mm, the norms quantize its inputs
    "fp8 dense decode B8, WIDE kernels": (False, "fp8", 8, 1, None),  # Policy.fp8_scaled_mm_min_tokens above it
    "fp8 prefill": (True, "fp8", 2, 24, 0),
}


def run_step(e, m, B, T, start):
    """One step through the engine: a decode step after a short prefill, or a prefill (chunk) at `start`."""
    gen = torch.Generator().manual_seed(B * 100 + T)
    e.setup_caches(B)
    if start is None:  # the prefill that fills the cache is not what is counted
        e(torch.randint(0, 96, (B, 5), generator=gen).to(DEV), input_pos=torch.arange(5, device=DEV))
        return lambda: e(torch.randint(0, 96, (B, 1), generator=gen).to(DEV),
                         input_pos=torch.full((B, 1), 5, device=DEV))
    if start:
        e(torch.randint(0, 96, (B, start), generator=gen).to(DEV), input_pos=torch.arange(start, device=DEV))
    return lambda: e(torch.randint(0, 96, (B, T), generator=gen).to(DEV),
                     input_pos=torch.arange(start, start + T, device=DEV))


@pytest.mark.parametrize("name", list(SHAPES))
def test_what_launches_is_exactly_what_the_plan_lists(name, launches, one_thread):
    routers, weights, B, T, start = SHAPES[name]
    m = wide_model(routers=routers)
    if "rule off" in name or "all sparse" in name:  # routed FFN at more than 4 rows (wide.FFNRule)
        m.ffn_rule = FFNRule(max_rows=None)
    pol = ALL_SPARSE if "all sparse" in name else Policy(dense_gemv_max_tokens=0) if "cuBLAS" in name else None
    if "WIDE kernels" in name:
        pol = Policy(fp8_scaled_mm_min_tokens=10 ** 9)
    if "threshold" in name:  # at the default 1024 tokens the interpreter takes much longer for the same plan
        pol = Policy(sparse_prefill_min_tokens=B * T, live_attention_min_tokens=B * T)
    e = engine.Engine(m, pol, weights)
    with torch.no_grad():
        step = run_step(e, m, B, T, start)
        launches.clear()
        step()
    plan = e.step_plan(B * T, start is None, start or 0)
    launched = Counter({k: len(v) for k, v in launches.grids.items()})
    assert launched == plan.launches(), f"{name}:\n{plan.text()}"
    kinds = {op.kind for op in plan.layers[0].values()}
    expected = {"decode B1": {"gemv", "gemv_fused", "gemm_k", "decode_live", "norm_route_deferred"},
                "decode B8": {"cublas_every_head", "cublas", "cublas_masked_input", "decode_live", "norm"},
                "decode B8, FFN rule off": {"cublas_every_head", "cublas_masked", "cublas_masked_input", "decode_live"},
                "decode B20, all sparse": {"layout", "tiles", "tiles_fused", "gemm_k", "decode_live"},
                "prefill at the sorted-tile threshold": {"layout", "tiles", "tiles_fused", "prefill_live", "cublas_masked_input"},
                "later chunk": {"prefill_every_zeroed", "cublas_every_head", "cublas_masked"},
                "dense decode B1": {"gemv_all", "gemv_fused_all", "gemm_k_all", "decode_every", "norm"},
                "dense decode B1, cuBLAS linears": {"cublas", "decode_every", "norm"},
                "dense later chunk": {"cublas", "prefill_every"},
                "fp8 decode B1": {"gemv", "gemv_fused", "gemm_k"},
                "fp8 dense decode B8": {"norm_fp8", "cublas", "decode_every"},
                "fp8 dense decode B8, WIDE kernels": {"gemv_all", "gemv_fused_all", "gemm_k_all", "decode_every"},
                "fp8 prefill": {"cublas_every_head", "sdpa_causal_zeroed"}}[name]
    assert expected <= kinds, f"{name}: {kinds}"
    if name == "decode B1":  # one token: each norm_route leaves the rule to the GEMV after it
        assert "norm_route" not in kinds
    if name == "decode B8":  # the FFN routers are not asked at all: no mask, no masked GEMM
        assert "cublas_masked" not in kinds and plan.layers[0]["ffn_norm"].kind == "norm" and plan.shape.dense_ffn


def decode_step_logits(forward, B, masks=None, seed=0, between=lambda: None):
    # A prefill of 5 tokens per row, then (after `between`) one decode step at per-row positions 5: its logits.
    gen = torch.Generator().manual_seed(seed)
    forward.setup_caches(B)
    forward(torch.randint(0, 96, (B, 5), generator=gen).to(DEV), input_pos=torch.arange(5, device=DEV))
    between()
    return forward(torch.randint(0, 96, (B, 1), generator=gen).to(DEV), input_pos=torch.full((B, 1), 5, device=DEV),
                   masks=masks)


def test_the_batch_rule_runs_the_whole_ffn_of_a_decode_step_of_many_rows():
    # The reference (model.py): a decode step of more rows than ffn_rule.max_rows does not ask its
    # FFN routers, so it equals the same model with the FFN routers removed for that step, and the masks
    # it records say every group ran; at 4 rows the routers still decide. Prefill is never affected.
    m = wide_model()
    with torch.no_grad():
        for B, ruled in ((8, True), (4, False)):
            got = {}
            out = decode_step_logits(m, B, got)
            ffn_ran = torch.stack([g.float() for g in got["ffn"]])
            assert bool(ffn_ran.eq(1).all()) == ruled, B
            routers = [l.ffn_router for l in m.layers]
            m.ffn_rule = FFNRule(max_rows=None)  # route every step
            routed = decode_step_logits(m, B)

            def drop_ffn_routers():  # the same routed prefill, then a decode step without FFN routers
                for l in m.layers:
                    l.ffn_router = None
            unrouted_ffn = decode_step_logits(m, B, between=drop_ffn_routers)
            for l, r in zip(m.layers, routers):
                l.ffn_router = r
            m.ffn_rule = FFNRule()
            want = unrouted_ffn if ruled else routed
            assert torch.allclose(out, want, atol=1e-5) and not torch.allclose(routed, unrouted_ffn, atol=1e-3), B
        assert m.ffn_rule.routes(8, decode=False) and m.ffn_rule.routes(4, decode=True) and not m.ffn_rule.routes(5, decode=True)


@pytest.mark.parametrize("limit", [4, None])
def test_the_engine_follows_the_batch_rule_of_its_model(limit, one_thread):
    # Engine and reference agree at 8 rows with the rule on (FFN dense) and off (FFN routed, cuBLAS on the
    # masked input), and record the same masks.
    m, ref = wide_model(), wide_model()
    m.ffn_rule = ref.ffn_rule = FFNRule(max_rows=limit)
    got, want_masks = {}, {}
    with torch.no_grad():
        out = decode_step_logits(engine.Engine(m), 8, got)
        want = decode_step_logits(ref, 8, want_masks)
    assert torch.allclose(out, want, atol=1e-4, rtol=1e-4)
    for kind in ("attn", "ffn"):
        assert all(torch.equal(a.float(), b.float()) for a, b in zip(got[kind], want_masks[kind])), kind


def test_an_fp8_step_reads_codes_only_where_the_plan_says():
    # Routed linears: the decode kernels read the codes up to GEMV_MAX_TOKENS; beyond, the library GEMMs run
    # _scaled_mm on the codes and per-token fp8 inputs, and gemm_mn's sorted tiles the values the codes stand for.
    routers = [("wide", "wide")]
    weights = lambda p, tokens: {k: op.weights for k, op in p.plan(
        policy.Shape(tokens, tokens <= 16, dtype="bf16", fp8=True), routers).layers[0].items() if op.weights}
    for tokens, want in ((1, "fp8"), (16, "fp8"), (17, "fp8 x fp8")):
        assert set(weights(policy.Policy(), tokens).values()) == {want}, tokens
    assert weights(policy.Policy(), 4096) == dict(qkv="fp8 -> bf16", o="fp8 x fp8", gate_up="fp8 -> bf16", down="fp8 x fp8")
    never = policy.Policy(fp8_scaled_mm_min_tokens=10 ** 9)  # the weights-only engine: dequantized past 16 tokens
    for tokens, want in ((16, "fp8"), (17, "fp8 -> bf16"), (4096, "fp8 -> bf16")):
        assert set(weights(never, tokens).values()) == {want}, tokens
    # an fp16 model's GEMMs never take _scaled_mm (its per-row scales give bf16 on a GPU)
    assert "fp8 x fp8" not in policy.Policy().plan(policy.Shape(64, False, dtype="fp16", fp8=True), routers).text()


def test_the_dense_fp8_linears_run_scaled_mm_from_the_policys_threshold():
    # The dense model's fp8 linears: _scaled_mm from fp8_scaled_mm_min_tokens, WIDE's kernels with every group
    # live on the codes below it; the norms quantize _scaled_mm's input (Q, K, V; gate + up) in their launch,
    # O and down quantize theirs (down's forms silu(gate) * up as it does).
    dense = [(None, None)]
    ops = lambda p, M: p.plan(policy.Shape(M, True, dtype="bf16", fp8=True), dense).layers[0]
    for M in (1, 8, 16):
        got = ops(policy.Policy(), M)
        assert {k: (op.kind, op.runs, op.weights, op.kernels) for k, op in got.items() if k != "attention"} == {
            "attn_norm": ("norm_fp8", "Triton", "", ("rms_norm_kernel",)),
            "qkv": ("cublas", "_scaled_mm", "fp8 x fp8", ()), "rope": ("rope", "Triton", "", ("rope_kernel",)),
            "o": ("cublas", "_scaled_mm", "fp8 x fp8", ("quantize_rows_kernel",)),
            "ffn_norm": ("norm_fp8", "Triton", "", ("rms_norm_kernel",)),
            "gate_up": ("cublas", "_scaled_mm", "fp8 x fp8", ()),
            "down": ("cublas", "_scaled_mm", "fp8 x fp8", ("quantize_rows_kernel",))}, M
    p4 = policy.Policy(fp8_scaled_mm_min_tokens=4)
    assert {op.kind for op in ops(p4, 3).values()} >= {"norm", "gemv_all", "gemv_fused_all", "gemm_k_all"}
    assert ops(p4, 4)["qkv"].runs == "_scaled_mm"


def test_the_thresholds_move_ops_between_triton_and_cublas():
    p = policy.Policy()
    routed = [("wide", "wide")]
    where = lambda tokens, decode, op: p.plan(policy.Shape(tokens, decode), routed).layers[0][op].runs
    assert [where(M, True, "o") for M in (1, 4, 5, 16)] == ["Triton", "Triton", "cuBLAS", "cuBLAS"]
    assert [where(M, False, "qkv") for M in (64, 1023, 1024, 2048)] == ["cuBLAS", "cuBLAS"] + ["Triton + cuBLAS"] * 2
    assert [where(M, False, "gate_up") for M in (1023, 2048, 4096)] == ["cuBLAS", "Triton", "Triton"]
    assert [where(M, False, "down") for M in (1024, 4096)] == ["cuBLAS", "cuBLAS"]  # gemm_k cannot skip in prefill
    kernels = lambda pol, M: pol.plan(policy.Shape(M, False), routed).layers[0]["attn_norm"].kernels
    chunk = ("norm_route_part_kernel", "norm_route_finish_kernel")  # a prefill chunk: D split, then added up
    assert kernels(p, 64) == ("norm_route_kernel",) and kernels(p, 65) == chunk
    split = policy.Policy(router_split_max_tokens=256)
    assert kernels(split, 256) == ("norm_route_kernel",) and kernels(split, 257) == chunk
    assert where(4096, False, "attn_norm") == "Triton"  # the router in the norm's launch at any length
    assert kernels(policy.Policy(router_max_tokens=64), 65) == ("rms_norm_kernel",)  # then the module itself
    # WIDE's short prefill chunks: attention over every head as dense runs it (no layout), the pruned heads zeroed
    every = policy.Policy(live_attention_min_tokens=512)
    plan = lambda M, start: every.plan(policy.Shape(M, False, start), routed)
    assert [plan(511, s).layers[0]["attention"].kind for s in (0, 8)] == ["sdpa_causal_zeroed", "prefill_every_zeroed"]
    assert "attn_layout" not in plan(511, 0).layers[0] and "step_every_head" in plan(511, 8).step
    assert plan(512, 8).layers[0]["attention"].kind == "prefill_live" and "attn_layout" in plan(512, 8).layers[0]
    assert "step_every_head" not in plan(512, 8).step
    assert plan(511, 8).layers[0]["attention"].kernels == ("attn_prefill_kernel",)
    assert every.plan(policy.Shape(4, True), routed).layers[0]["attention"].kind == "decode_live"
    sdpa = policy.Policy(live_attention_min_tokens=512, dense_chunk_attention="sdpa")
    assert sdpa.plan(policy.Shape(100, False, 8), routed).layers[0]["attention"].kind == "sdpa_rows_zeroed"
    # the dense model's linears: WIDE's kernels with every group live up to dense_gemv_max_tokens, then cuBLAS
    linears = lambda pol, M: {op.kind for name, op in pol.plan(policy.Shape(M, True), [(None, None)]).layers[0].items()
                              if name in ("qkv", "o", "gate_up", "down")}
    assert linears(p, 1) == {"gemv_all", "gemv_fused_all", "gemm_k_all"} and linears(p, 2) == {"cublas"}
    assert linears(policy.Policy(dense_gemv_max_tokens=0), 1) == {"cublas"}
    assert linears(policy.Policy(dense_gemv_max_tokens=4), 4) == {"gemv_all", "gemv_fused_all", "gemm_k_all"}


def test_the_router_goes_to_the_side_stream_only_where_nothing_reads_its_mask_before_the_gemms():
    routed = [("wide", "wide")]
    side = policy.Policy(router_side_stream=True)
    norms = lambda pol, M, decode=False, start=0: [pol.plan(policy.Shape(M, decode, start), routed).layers[0][n].kind
                                                   for n in ("attn_norm", "ffn_norm")]
    beside = ["norm_route_side"] * 2
    assert norms(side, 100) == norms(side, 100, start=8) == norms(side, 1023) == beside  # both: masks read late
    assert norms(policy.Policy(), 100) == ["norm_route"] * 2, "off by default"
    # attention over the live tiles with Q for every head reads the layout before any GEMM: the attention
    # router stays in the norm's launch, as does the FFN's where gate+up's tiles read its layout
    assert norms(side, 1024) == ["norm_route_side", "norm_route"], "Q's tiles: K and V's GEMM first, beside it"
    assert norms(policy.Policy(router_side_stream=True, live_attention_min_tokens=64), 100) == [
        "norm_route", "norm_route_side"]
    # decode steps: the GEMVs of a few rows read the mask at once; past them Q, K, V run for every head and
    # decode attention is the first to read it (and the FFN's SwiGLU, unless the vote rule reads it first)
    assert norms(side, 1, decode=True) == ["norm_route_deferred"] * 2 and norms(side, 4, decode=True) == [
        "norm_route"] * 2
    assert norms(side, 32, decode=True) == beside
    voted = side.plan(policy.Shape(32, True, ffn_vote=2), routed).layers[0]
    assert [voted[n].kind for n in ("attn_norm", "ffn_norm")] == ["norm_route_side", "norm_route"]
    other = side.plan(policy.Shape(100, False), [("other", None)]).layers[0]  # the module itself, beside
    assert other["attn_norm"].kind == "norm_then_router_side" and other["ffn_norm"].kind == "norm"
    module = policy.Policy(router_side_stream=True, router_max_tokens=64).plan(policy.Shape(100, False), routed)
    assert module.layers[0]["attn_norm"].kind == "norm_then_router_side"
    text = side.plan(policy.Shape(100, False), routed).text()
    assert "side stream" in text, "the printed plan says where the router runs"


class FakeStream:
    """Stands in for a CUDA stream on the CPU: what the engine asks of its streams goes into a log."""
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")


@pytest.mark.parametrize("module", [False, True], ids=["norm_route's decision", "the router module"])
def test_the_side_streams_router_is_forked_after_the_norm_and_joined_before_its_mask_is_read(monkeypatch, module):
    log, on = [], []
    main = FakeStream("main", log)
    m = wide_model()
    e = engine.Engine(m, Policy(router_side_stream=True, router_max_tokens=0 if module else 1 << 20))
    e.side = FakeStream("side", log)

    class OnStream:  # torch.cuda.stream(s): the block's work goes to s
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            on.append(self.s.name)

        def __exit__(self, *exc):
            on.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: main)
    monkeypatch.setattr(torch.cuda, "stream", OnStream)
    where = lambda: f"router on {on[-1] if on else 'main'}"
    route = engine.norm_route  # the routers' decision: norm_route's (with tickets of its own), or the module's
    monkeypatch.setattr(engine, "norm_route", lambda *a, **k: log.append(
        where() + ("" if a[4] is e.side_tickets else " with the main stream's tickets")) or route(*a, **k))
    for layer in m.layers:
        for r in (layer.attn_router, layer.ffn_router):
            r.register_forward_hook(lambda *_: log.append(where()))
    matmul, swiglu = e.matmul, engine.swiglu_rows
    monkeypatch.setattr(e, "matmul", lambda x, layer, name, op: log.append(name) or matmul(x, layer, name, op))
    monkeypatch.setattr(engine, "swiglu_rows", lambda *a, **k: log.append("swiglu") or swiglu(*a, **k))
    attend = engine.attention_decode
    monkeypatch.setattr(engine, "attention_decode", lambda *a, **k: log.append("attention") or attend(*a, **k))
    fork, join = "side waits for main", "main waits for side"
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a prefill chunk: the mask is first read after attention (zeroing) and after gate+up
        e.setup_caches(5, 16)
        e(torch.randint(0, 96, (5, 13), generator=gen).to(DEV), input_pos=torch.arange(13, device=DEV))
        layer = [fork, "router on side", "qkv", join, "o", fork, "router on side", "gu", join, "swiglu", "down"]
        assert log == layer * len(m.layers), "per layer: fork, router, the GEMMs beside it, join, the mask's reader"
        log.clear()  # a decode step of 5 rows: decode attention reads it; the batch rule runs the FFN dense
        e(torch.randint(0, 96, (5, 1), generator=gen).to(DEV), input_pos=torch.full((5, 1), 13, device=DEV))
        assert log == [fork, "router on side", "qkv", join, "attention", "o", "gu", "swiglu", "down"] * len(m.layers)


def test_with_qs_tiles_the_side_streams_router_runs_beside_k_and_vs_gemm(monkeypatch):
    log = []
    m = wide_model()
    e = engine.Engine(m, Policy(router_side_stream=True, sparse_prefill_min_tokens=65, live_attention_min_tokens=65))
    e.side = FakeStream("side", log)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: FakeStream("main", log))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext(log.append("router")))
    for name in ("layout", "norm_route"):
        fn = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, fn=fn, name=name, **k: log.append(name) or fn(*a, **k))
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: log.append("linear") or linear(*a, **k))
    with torch.no_grad():
        e(torch.randint(0, 96, (5, 13), generator=torch.Generator().manual_seed(2)).to(DEV))
    assert e.step_plan(65, False).layers[0]["qkv"].kind == "tiles"
    attention = ["side waits for main", "router", "norm_route", "linear", "main waits for side", "layout"]
    layers = [log[i:i + 6] for i, x in enumerate(log) if x == "side waits for main"]
    assert layers == [attention] * len(m.layers), "K and V's GEMM between the fork and the join, then the layout"


def test_the_engine_follows_a_plan_it_is_handed(launches, monkeypatch, one_thread):
    # A plan that sends the decode O projection to cuBLAS: the engine must not run gemm_k there anyway.
    real = policy.Policy.layer_plan

    def o_on_cublas(self, shape, a, f):
        ops = real(self, shape, a, f)
        ops["o"] = policy.Op("cublas_masked_input", "cuBLAS", ops["o"].weights)
        return ops
    monkeypatch.setattr(policy.Policy, "layer_plan", o_on_cublas)
    m = wide_model()
    ref = wide_model()
    e = engine.Engine(m)
    with torch.no_grad():
        step = run_step(e, m, 1, 1, None)
        launches.clear()
        out = step()
        ref.setup_caches(1)
        gen = torch.Generator().manual_seed(101)
        ref(torch.randint(0, 96, (1, 5), generator=gen).to(DEV), input_pos=torch.arange(5, device=DEV))
        want = ref(torch.randint(0, 96, (1, 1), generator=gen).to(DEV), input_pos=torch.full((1, 1), 5, device=DEV))
    assert launches.count("gemm_k_kernel") == len(m.layers)  # the down projections only
    assert torch.allclose(out, want, atol=1e-4, rtol=1e-4)


def test_the_printed_plan_names_every_op_where_it_runs():
    e = engine.Engine(wide_model())
    text = e.describe(2, 37)
    prefill, decode = text.split("a decode step")
    assert prefill.startswith("a prefill of 74 tokens, fp32 weights:")
    for name in ("Q, K, V", "attention", "O proj", "gate + up", "down proj", "lm_head"):
        assert name in prefill and name in decode
    assert "cuBLAS         one library GEMM on the masked input" in prefill  # O and down at 74 tokens
    assert "gemm_mn's decode GEMV, its live-group list" in decode and "router's live list" in decode and "only the KV heads whose head group runs" in decode
    assert "RoPE and the KV-cache write in its epilogue" in decode and "RoPE + cache" in prefill  # one launch fewer
    dense8 = engine.Engine(wide_model(routers=False)).step_plan(8, True)  # no FFN router: no rule to print
    assert not dense8.shape.dense_ffn and "batch rule" not in dense8.text()
    fp8 = engine.Engine(wide_model(routers=False), weights="fp8").step_plan(1, True).text()
    assert "fp8 weights for the prunable linears" in fp8 and "[fp8 x fp8]" in fp8 and "lm_head" in fp8


@pytest.mark.parametrize("k", [2, 5])
def test_the_vote_rule_shares_one_ffn_mask_per_decode_step(k):
    # The reference (model.py) under FFNRule(vote=k): at 8 rows a channel group runs for every row
    # iff >= k rows' routers want it, and the step equals the same model with each FFN router's decision
    # replaced by that vote; a step of fewer rows than k needs all of them; prefill is never voted.
    m = wide_model()
    routers = [l.ffn_router for l in m.layers]

    class Voted(torch.nn.Module):  # the vote, by hand: the decision of the wrapped router, shared
        def __init__(self, r, k):
            super().__init__()
            self.r, self.k = r, k

        def forward(self, h):
            want = self.r(h)
            return (want.sum(0, keepdim=True) >= self.k).to(want.dtype).expand_as(want)

    with torch.no_grad():
        for B in (8, 3):
            m.ffn_rule = FFNRule(vote=k)
            got = {}
            out = decode_step_logits(m, B, got)
            m.ffn_rule = FFNRule(max_rows=None)  # per-token routing at any batch, by hand

            def by_hand():
                for l, r in zip(m.layers, routers):
                    l.ffn_router = Voted(r, min(k, B))
            want = decode_step_logits(m, B, between=by_hand)
            for l, r in zip(m.layers, routers):
                l.ffn_router = r
            plain = decode_step_logits(m, B)
            m.ffn_rule = FFNRule()
            assert torch.allclose(out, want, atol=1e-5) and not torch.allclose(out, plain, atol=1e-3), (B, k)
            for mask in got["ffn"]:
                assert bool((mask == mask[:1]).all()), "every row of a voted step runs the same groups"
    assert m.ffn_rule.votes_needed(8, decode=True) is None and m.ffn_rule.routes(8, decode=True) is False  # off by default


@pytest.mark.parametrize("k", [2, 4])
def test_the_engine_follows_the_vote_rule_and_its_kernels_skip_what_the_vote_drops(k, launches, one_thread):
    # Engine == reference at 8 rows under the vote; the FFN runs through gemm_mn's decode GEMV and gemm_k (which skip the
    # groups no row runs: with one shared mask, the ones the vote drops), as the plan lists.
    m, ref = wide_model(), wide_model()
    m.ffn_rule = ref.ffn_rule = FFNRule(vote=k)
    e = engine.Engine(m)
    got, want_masks = {}, {}
    with torch.no_grad():
        step = run_step(e, m, 8, 1, None)
        launches.clear()
        out = step()
        launched = Counter({n: len(v) for n, v in launches.grids.items()})
        out_masks = decode_step_logits(e, 8, got)
        want = decode_step_logits(ref, 8, want_masks)
    plan = e.step_plan(8, True)
    assert plan.shape.ffn_vote and not plan.shape.dense_ffn and launched == plan.launches()
    assert {plan.layers[0]["gate_up"].kind, plan.layers[0]["down"].kind} == {"gemv_fused", "gemm_k"}
    assert torch.allclose(out_masks, want, atol=1e-4, rtol=1e-4)
    for a, b in zip(got["ffn"], want_masks["ffn"]):
        assert torch.equal(a.float(), b.float())
    assert "the vote rule" in plan.text()
