"""The router's rule applied by the decode GEMV (kernels_step.norm_route_deferred, then gemm_mn(decision=...)): in a
one-token step norm_route stops after the router's first Linear, and every program of the GEMV after it makes the
mask from z while its first program writes the mask, its float copy and the live list for the kernels after it.
The result must be exactly what norm_route deciding by itself gives: the same masks, list and outputs."""
import pytest
import torch

import engine
import kernels
import kernels_base
import kernels_step
import wide
from model import RMSNorm
from policy import Policy
from test_e2e import wide_model
from test_plan import decode_step_logits
from test_skipped_work import per_row, recorded_loads

pytestmark = pytest.mark.skipif(not kernels_base.INTERPRET, reason="the CPU test setup (TRITON_INTERPRET=1)")
GS, D = 16, 64


def router_and_norm(G, bias, seed=0):
    """A wide.Router over G groups (bias: "random", or every group's exec / skip logit raised: "all on", "all off")
    and an RMSNorm whose weights are not all ones."""
    torch.manual_seed(seed)
    r = wide.Router(D, G, 32)
    with torch.no_grad():
        r.up.bias.normal_(0, 0.5)
        if bias != "random":
            r.up.bias[0 if bias == "all on" else 1::2] += 100.0
    norm = RMSNorm(D, 1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    return r, norm


@pytest.mark.parametrize("bias", ["random", "all on", "all off"])
@pytest.mark.parametrize("fmt", ["fp32", "fp8"])
@pytest.mark.parametrize("fused", [True, False])
def test_the_gemv_makes_norm_routes_mask_list_and_outputs(bias, fmt, fused):
    G = 8
    r, norm = router_and_norm(G, bias)
    x, res = torch.randn(1, 1, D), torch.randn(1, 1, D)
    (h, y), keep, keepf, live = kernels_step.norm_route(x, norm, r, res)
    (h2, y2), dec = kernels_step.norm_route_deferred(x, norm, r, res)
    assert torch.equal(h, h2) and torch.equal(y, y2)
    assert dec.live.eq(-1).all() and dec.keepf.isnan().all(), "poisoned until the GEMV writes them"
    w, ws = torch.randn(G * GS, D) / 8, None
    w_up, wus = (torch.randn(G * GS, D) / 8, None) if fused else (None, None)
    tail = 0 if fused else 2 * GS  # Q's routed groups with K and V as the dense tail
    if not fused:
        w = torch.cat([w, torch.randn(tail, D) / 8])
    if fmt == "fp8":
        w, ws = kernels.quantize_fp8(w)
        if fused:
            w_up, wus = kernels.quantize_fp8(w_up)
    args = dict(w_up=w_up, w_scale=ws, w_up_scale=wus, dense_tail=tail)
    ref = kernels.gemm_mn(y.view(1, D), w, keep, GS, **args)
    out = kernels.gemm_mn(y2.view(1, D), w, dec.keep, GS, decision=dec, **args)
    assert torch.equal(keep, dec.keep) and torch.equal(keepf, dec.keepf) and torch.equal(live, dec.live)
    assert torch.equal(out, ref)
    n_on = int(keep.sum())
    assert n_on == {"all on": G, "all off": 0}.get(bias, n_on) and (bias != "random" or 0 < n_on < G)


def test_the_deferred_rule_is_the_routers_and_reads_no_dead_groups_rows():
    G = 8
    r, norm = router_and_norm(G, "random", seed=3)
    x = torch.randn(1, 1, D)
    want, _ = kernels_step.route_ref(r, x)
    w = torch.randn(G * GS, D) / 8
    with recorded_loads() as rec:
        y, dec = kernels_step.norm_route_deferred(x, norm, r)
        kernels.gemm_mn(y.view(1, D), w, dec.keep, GS, decision=dec)
    assert torch.equal(dec.keep, want) and torch.equal(dec.live, kernels_step.live_ref(want))
    assert torch.equal(rec.reads("_gemv_mn_kernel", "w"), per_row(want.view(G).long(), D)), "live rows once"
    assert not rec.reads("_gemv_mn_kernel", "mask").any(), "the mask is made, not read"
    programs = kernels_base.CONFIGS["gemv_mn_1"]["programs_per_sm"] * kernels_base.num_sms(x.device)
    assert rec.reads("_gemv_mn_kernel", "z").eq(programs).all(), "every program makes the mask from z itself"


def test_the_gemv_takes_a_decision_for_one_token_only():
    r, norm = router_and_norm(8, "random")
    with pytest.raises(AssertionError, match="one token"):
        kernels_step.norm_route_deferred(torch.randn(1, 2, D), norm, r)
    y, dec = kernels_step.norm_route_deferred(torch.randn(1, 1, D), norm, r)
    with pytest.raises(AssertionError, match="G groups"):  # a decision over other groups than the weight's
        kernels.gemm_mn(y.view(1, D), torch.randn(4 * GS, D), torch.ones(1, 4, dtype=torch.bool), GS, decision=dec)


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_a_one_token_step_is_the_same_with_the_rule_in_the_gemv_or_in_norm_route(weights):
    # The engine's batch-1 decode step, both ways: the same logits and masks, bit for bit; and the plan says which.
    m = wide_model()
    got = {}
    for rule_in_gemv in (True, False):
        e = engine.Engine(m, Policy(router_rule_in_gemv=rule_in_gemv), weights)
        kinds = {op.kind for op in e.step_plan(1, True, 0).layers[0].values()}
        assert ("norm_route_deferred" in kinds) == rule_in_gemv and ("norm_route" in kinds) != rule_in_gemv
        masks = {}
        with torch.no_grad():
            logits = decode_step_logits(e, 1, masks)
        got[rule_in_gemv] = logits, masks
    (a, ma), (b, mb) = got[True], got[False]
    assert torch.equal(a, b)
    assert ma.keys() == mb.keys() and all(torch.equal(x, y) for k in ma for x, y in zip(ma[k], mb[k]))
    assert 0 < torch.cat([t.flatten() for t in ma["ffn"]]).mean() < 1, "the routers skip some groups, not all"


def test_down_never_prefetches_a_live_list_the_gate_up_gemv_just_wrote(launches):
    # gemm_k's PREFETCH reads the live list before its PDL wait, which is safe only for a list written two or
    # more launches before: after the GEMV that applied the rule (live_fresh) it must stay off.
    G = 4
    a, w = torch.randn(1, G * GS), torch.randn(D, G * GS)
    mask = torch.tensor([[True, False, True, False]])
    live = kernels_step.live_ref(mask)
    with kernels_base.configs_tried({key: dict(PREFETCH=True) for key in ("gemm_k_small_1", "gemm_k_small_long_k")}):
        for fresh in (False, True):
            out = kernels.gemm_k(a, w, mask, GS, live=live, live_fresh=fresh)
            assert torch.allclose(out, kernels.gemm_k_ref(a, w, mask, GS), atol=1e-4)
    assert [c["PREFETCH"] for c in launches.constants["gemm_k_kernel"]] == [True, False]
