"""
The specification of wide.py, one property per test, in the file's order: the router, straight-through,
the temperature schedule, skip rates, the penalty, LoRA, FLOPs (router checkpoints: test_checkpoints.py).
The models are the small ones of tiny_models.py (2 layers, 2 head groups and 4 channel groups per layer).
"""
import math
from dataclasses import asdict

import pytest
import torch
import torch.nn as nn

import wide
from conftest import assert_close
from model import Transformer
from tiny_models import random_model, run, router_params, small_config, tokens, wide_config, wide_model, with_lora
from wide import Router, WideConfig


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread for tiny models


def test_wide_config_defaults_are_the_papers():
    assert asdict(WideConfig()) == dict(
        method="wide", target=0.5, attn_target=None, ffn_target=None,
        attn_group_size=0,   # one KV group of query heads per decision
        ffn_group_size=32,   # 32 contiguous channels per decision
        rank=32,             # router bottleneck
        lora_rank=0, lora_alpha=32.0, stage=1,
        offsets=None)        # no dial until a stage calibrates one (dial.calibrate)
    assert wide.PENALTY_WEIGHT == 20.0


# ----------------------------------------------------------------------------------------------------
# 1. the router


def test_router_is_two_linears_with_kaiming_init_zero_biases_and_rank_clipped_to_width():
    torch.manual_seed(0)
    r = Router(dim=64, n_groups=4, rank=32)
    assert (r.down.in_features, r.down.out_features, r.up.out_features) == (64, 32, 8)  # 2 logits per group
    assert not r.down.bias.any() and not r.up.bias.any()
    # Kaiming-uniform with the linear gain: U(-sqrt(3 / fan_in), +sqrt(3 / fan_in)), wider than
    # PyTorch's default Linear init, whose bound is 1 / sqrt(fan_in), narrower than the ReLU gain's.
    for lin in (r.down, r.up):
        bound = math.sqrt(3 / lin.in_features)
        assert lin.weight.abs().max() <= bound
        assert lin.weight.abs().max() > 1.5 / math.sqrt(lin.in_features)
    # A router never has a bottleneck wider than the model.
    assert Router(dim=16, n_groups=3, rank=32).down.out_features == 16
    assert Router(dim=16, n_groups=3, rank=32).logits(torch.randn(2, 5, 16)).shape == (2, 5, 3, 2)


@pytest.mark.parametrize("method", ["wide", "layerskip"])
def test_install_routers_gives_every_layer_routers_of_the_configured_rank_and_groups(method):
    model, _ = wide_model(method=method, rank=8)
    for layer in model.layers:
        got = [(r.down.out_features, r.n_groups) if r is not None else None
               for r in (layer.attn_router, layer.ffn_router, layer.layer_router)]
        assert got == ([(8, 2), (8, 4), None] if method == "wide" else [None, None, (8, 1)])


def test_router_logits_stay_fp32_under_bf16_autocast():
    # The routers are kept in fp32 (a named deviation): under a bf16 autocast their logits are exactly
    # the fp32 ones of the (bf16) input, so a decision never depends on the backbone's precision.
    torch.manual_seed(0)
    r = Router(dim=16, n_groups=3, rank=8).eval()
    x = torch.randn(2, 5, 16).bfloat16()
    expected = r.logits(x.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = r.logits(x)
        keep = r(x)
    assert z.dtype == torch.float32 and r.down.weight.dtype == torch.float32
    assert_close(z, expected, atol=0.0, what="router logits under bf16 autocast")
    assert torch.equal(keep, (expected[..., 1] <= expected[..., 0]).float())


def test_eval_skips_a_group_iff_its_skip_logit_exceeds_its_execute_logit_and_ties_execute():
    torch.manual_seed(0)
    r = Router(dim=8, n_groups=3, rank=4).eval()
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        # All weights and biases zero: every logit pair ties, and a tie executes.
        for lin in (r.down, r.up):
            lin.weight.zero_()
            lin.bias.zero_()
        assert torch.equal(r(x), torch.ones(2, 5, 3))
        # Logits come in (execute, skip) pairs per group: nudge group 0's skip up, group 1's execute up.
        r.up.bias.copy_(torch.tensor([0.0, 1e-3, 1e-3, 0.0, 0.0, 0.0]))
        assert torch.equal(r(x), torch.tensor([0.0, 1.0, 1.0]).expand(2, 5, 3))
        # A random router: the mask is exactly the sign test on each pair.
        r = Router(dim=8, n_groups=3, rank=4).eval()
        z = r.logits(x)
        keep = r(x)
        assert torch.equal(keep, (z[..., 0] >= z[..., 1]).float())
        assert (keep == 0).any() and (keep == 1).any()


def test_eval_routing_is_deterministic():
    model, _ = wide_model()
    idx = tokens(3, 16)
    logits1, masks1 = run(model, idx)
    logits2, masks2 = run(model, idx)
    assert torch.equal(logits1, logits2)
    assert masks1.keys() == masks2.keys() and len(masks1) == 4  # 2 layers x (head_mask, channel_mask)
    for name in masks1:
        assert torch.equal(masks1[name], masks2[name]), f"{name} changed between two identical calls"
        assert (masks1[name] == 0).any() and (masks1[name] == 1).any(), f"{name} should mix skips and executes"


def test_a_tokens_routing_and_logits_ignore_its_batch_mates_and_right_padding():
    model, _ = wide_model()
    seq = tokens(1, 10)
    alone_logits, alone = run(model, seq)
    others = tokens(2, 10, seed=1)
    padding = tokens(1, 6, seed=2)
    batches = {
        "in a batch": (torch.cat([others[:1], seq, others[1:]]), 1),
        "right-padded": (torch.cat([seq, padding], 1), 0),
        "right-padded in a batch": (torch.cat([torch.cat([others, others[:, :6]], 1),
                                               torch.cat([seq, padding], 1)]), 2),
    }
    with torch.no_grad():
        for how, (batch, row) in batches.items():
            logits, masks = run(model, batch)
            for name, keep in masks.items():
                assert torch.equal(keep[row, :10], alone[name][0]), f"{name} mask of the sequence {how}"
            assert_close(logits[row, :10], alone_logits[0], atol=1e-5, what=f"logits of the sequence {how}")


# ----------------------------------------------------------------------------------------------------
# 2. straight-through


def test_training_masks_are_exactly_binary_with_gumbel_noise():
    model, _ = wide_model()
    model.train()
    for tau in (5.0, 0.5):
        wide.set_temperature(model, tau)
        _, masks = run(model, tokens(4, 16))
        for name, keep in masks.items():
            assert ((keep == 0) | (keep == 1)).all(), f"{name} at tau {tau} has values other than 0 and 1"
            assert keep.requires_grad, f"{name} carries no straight-through gradient"
            assert (keep == 0).any() and (keep == 1).any(), f"{name} should mix skips and executes here"


def test_training_masks_execute_with_the_softmax_probability_of_the_logits_at_any_temperature():
    # Hard Gumbel-softmax = a sample from softmax(z): P(execute) = sigmoid(z_exec - z_skip). The
    # temperature shapes only the straight-through gradient, never the forward sample.
    r = Router(dim=8, n_groups=2, rank=4).train()
    with torch.no_grad():
        r.down.weight.zero_()
        r.up.weight.zero_()
        r.up.bias.copy_(torch.tensor([1.0, 0.0, -0.5, 0.5]))  # (execute, skip) for group 0, then group 1
    expected = torch.sigmoid(torch.tensor([1.0, -1.0]))
    torch.manual_seed(0)
    for tau in (5.0, 0.5):
        r.tau = tau
        keep = r(torch.zeros(1, 20000, 8))
        # 20000 samples: the standard error of a frequency is below 0.0035.
        assert_close(keep.mean((0, 1)), expected, atol=0.02, what=f"execute frequency at tau {tau}")


@pytest.mark.parametrize("tau", [5.0, 0.5])
def test_straight_through_gradient_is_the_gradient_of_the_soft_sample(tau):
    # Written out by hand for one group: with noisy logits a = z_exec + g_exec, b = z_skip + g_skip, the
    # soft sample is p = softmax((a, b) / tau)[0] = sigmoid((a - b) / tau), and the forward value is the
    # hard sample 1[a >= b]. For a loss sum(w * keep): d/dz_exec = w p (1 - p) / tau = -d/dz_skip.
    torch.manual_seed(0)
    r = Router(dim=8, n_groups=3, rank=4).train()
    r.tau = tau
    x = torch.randn(2, 40, 8)
    z = (2 * r.logits(x)).detach().requires_grad_()  # spread the logits: some near-certain, some close
    r.logits = lambda x: z                             # so that d loss / d logits is z.grad
    w = torch.randn(2, 40, 3)
    torch.manual_seed(1)
    keep = r(x)
    (w * keep).sum().backward()

    torch.manual_seed(1)
    gumbel = -torch.empty_like(z).exponential_().log()  # the same noise the router drew
    a, b = (z + gumbel).detach().unbind(-1)
    p = torch.sigmoid((a - b) / tau)
    assert torch.equal(keep, (a >= b).float())
    expected = (w * p * (1 - p) / tau).unsqueeze(-1) * torch.tensor([1.0, -1.0])
    assert expected.abs().max() > 1e-2  # the comparison is not between two zeros
    assert_close(z.grad, expected, atol=1e-6, what=f"d loss / d logits at tau {tau}")


def test_gradients_reach_both_router_linears_through_cross_entropy_and_penalty():
    model, wcfg = wide_model(target=0.2)  # far from the ~0.5 rate at init, so the penalty has a slope
    model.requires_grad_(False)
    for p in router_params(model):
        p.requires_grad_(True)
    model.train()
    idx, targets = tokens(4, 16), tokens(4, 16, seed=1)
    for term in ("cross-entropy", "penalty", "cross-entropy + penalty"):
        model.zero_grad(set_to_none=True)
        masks = {}
        _, ce = model(idx, targets, masks=masks)
        penalty = wide.sparsity_penalty(wide.skip_rates(masks), wcfg)
        loss = {"cross-entropy": ce, "penalty": penalty, "cross-entropy + penalty": ce + penalty}[term]
        loss.backward()
        for n, p in model.named_parameters():
            if "router" in n:
                assert p.grad is not None and p.grad.abs().sum() > 0, f"{term}: no gradient reaches {n}"
            else:
                assert p.grad is None, f"{term}: the frozen backbone parameter {n} got a gradient"


# ----------------------------------------------------------------------------------------------------
# 3. the temperature schedule


def test_temperature_falls_linearly_from_5_to_0_5_over_a_stage():
    taus = [wide.temperature(step, 10) for step in range(10)]
    assert_close(torch.tensor(taus), torch.linspace(5.0, 0.5, 10), atol=1e-6, what="temperatures")
    assert wide.temperature(0, 1) == 5.0  # a one-step stage never divides by zero
    assert Router(8, 2, 4).tau == 5.0     # a fresh router starts where the schedule does


@pytest.mark.parametrize("method", ["wide", "layerskip"])
def test_set_temperature_reaches_every_router(method):
    model, _ = wide_model(method=method)
    wide.set_temperature(model, 1.25)
    routers = list(wide.routers(model))
    assert len(routers) == (4 if method == "wide" else 2)
    assert all(isinstance(r, Router) and r.tau == 1.25 for r in routers)


# ----------------------------------------------------------------------------------------------------
# 4. skip rates and 5. the penalty


def test_skip_rates_count_only_valid_tokens():
    model, _ = wide_model()
    a, b = tokens(1, 8), tokens(1, 5, seed=1)
    # Skipped groups per router, counted on each sequence alone.
    skipped, n_groups = {}, {}
    for seq in (a, b):
        for name, keep in run(model, seq)[1].items():
            skipped[name] = skipped.get(name, 0) + (1 - keep).sum().item()
            n_groups[name] = keep.shape[-1]
    # The same two sequences as one batch, the shorter right-padded with 3 tokens.
    batch = torch.cat([a, torch.cat([b, tokens(1, 3, seed=2)], 1)])
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, 5:] = False
    masks = {}
    model(batch, masks=masks)
    rates = wide.skip_rates(masks, valid)
    for kind in ("attn", "ffn"):
        per_layer = [skipped[f"layer {i} {kind}"] / (13 * n_groups[f"layer {i} {kind}"]) for i in range(2)]
        assert_close(rates[kind], sum(per_layer) / 2, atol=1e-6, what=f"{kind} rate over the 13 real tokens")
    # Whatever the routers decide on padding, the rates do not move.
    for decision in (0.0, 1.0):
        for per_layer in masks.values():
            for keep in per_layer:
                keep[1, 5:] = decision
        for kind, rate in wide.skip_rates(masks, valid).items():
            assert torch.equal(rate, rates[kind]), f"{kind} rate moved with padding decisions {decision}"
    # Without a valid mask every position counts.
    plain = wide.skip_rates(masks)
    for kind in ("attn", "ffn"):
        expected = torch.stack([1 - keep.mean() for keep in masks[kind]]).mean()
        assert_close(plain[kind], expected, atol=1e-6, what=f"{kind} rate over all positions")


def test_penalty_with_a_shared_target_is_20_times_the_gap_to_the_mean_rate():
    rates = dict(attn=torch.tensor(0.3), ffn=torch.tensor(0.5))
    # 20 * |0.5 - (0.3 + 0.5) / 2| = 20 * 0.1
    assert_close(wide.sparsity_penalty(rates, WideConfig(target=0.5)), 2.0, atol=1e-5, what="penalty")
    # Rates above the target cost as much as rates below it.
    assert_close(wide.sparsity_penalty(rates, WideConfig(target=0.3)), 20 * 0.1, atol=1e-5, what="penalty")


def test_penalty_with_separate_targets_is_the_mean_of_the_two_gaps():
    rates = dict(attn=torch.tensor(0.3), ffn=torch.tensor(0.5))
    wcfg = WideConfig(attn_target=0.6, ffn_target=0.2)
    # 20 * (|0.6 - 0.3| + |0.2 - 0.5|) / 2: the two gaps would cancel under a shared target of 0.4.
    assert_close(wide.sparsity_penalty(rates, wcfg), 20 * 0.5 * (0.3 + 0.3), atol=1e-5, what="penalty")


def test_layer_skip_penalty_is_20_times_the_gap_to_the_layer_rate():
    rates = dict(layer=torch.tensor(0.4))
    assert_close(wide.sparsity_penalty(rates, WideConfig(method="layerskip", target=0.25)), 20 * 0.15,
                 atol=1e-5, what="penalty")


def test_the_dense_base_model_has_no_penalty():
    assert wide.sparsity_penalty({}, None) == 0.0


# ----------------------------------------------------------------------------------------------------
# configuration errors


def test_default_attn_group_size_is_one_kv_group():
    wcfg = wide_config()
    assert wide.check_groups(small_config(), wcfg) == (2, 4)  # 4 query heads / 2 KV heads; 64 / 16
    assert wcfg.attn_group_size == 2


def test_group_sizes_that_do_not_divide_raise_value_error_naming_the_size():
    cfg = small_config()  # 4 query heads, FFN width 64
    with pytest.raises(ValueError, match=r"attn_group_size 3 does not divide the 4 query heads"):
        wide.check_groups(cfg, wide_config(attn_group_size=3))
    with pytest.raises(ValueError, match=r"ffn_group_size 24 does not divide the FFN size 64"):
        wide.check_groups(cfg, wide_config(ffn_group_size=24))
    # install_routers checks before it touches the model.
    model = random_model()
    with pytest.raises(ValueError, match="ffn_group_size 24"):
        wide.install_routers(model, wide_config(ffn_group_size=24))
    assert all(layer.attn_router is None and layer.ffn_router is None for layer in model.layers)


@pytest.mark.parametrize("field,size", [("attn_group_size", -2), ("ffn_group_size", 0), ("ffn_group_size", -16)])
def test_group_sizes_that_are_not_positive_raise_value_error(field, size):
    with pytest.raises(ValueError, match=field):
        wide.check_groups(small_config(), wide_config(**{field: size}))


@pytest.mark.parametrize("targets", [dict(target=1.0), dict(target=-0.1), dict(target=float("nan")),
                                     dict(attn_target=1.0, ffn_target=0.5), dict(attn_target=0.5, ffn_target=-0.5)])
def test_sparsity_outside_0_1_raises_value_error(targets):
    with pytest.raises(ValueError, match=r"outside \[0, 1\)"):
        wide.check_groups(small_config(), wide_config(**targets))


def test_sparsity_in_0_1_is_accepted_and_separate_targets_come_in_pairs():
    for targets in (dict(target=0.0), dict(target=0.99), dict(attn_target=0.0, ffn_target=0.9)):
        wide.check_groups(small_config(), wide_config(**targets))
    with pytest.raises(ValueError, match="both"):
        wide.check_groups(small_config(), wide_config(attn_target=0.5))


def test_unknown_method_raises_value_error():
    with pytest.raises(ValueError, match="unknown method 'teal'"):
        wide.install_routers(random_model(), wide_config(method="teal"))


# ----------------------------------------------------------------------------------------------------
# 6. LoRA


def test_lora_wraps_all_seven_projections_of_every_layer():
    model = wide.install_lora(random_model(), 4, 8.0)
    wrapped = {n for n, m in model.named_modules() if isinstance(m, wide.LoRALinear)}
    assert wrapped == {f"layers.{i}.{proj}" for i in range(2) for proj in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def test_lora_drops_10_percent_of_its_input_in_training_by_default():
    # With W = 0 and B A = identity, the layer returns (alpha / r) * dropout(x): the dropped entries
    # are exact zeros, the others x / 0.9.
    torch.manual_seed(0)
    lora = wide.LoRALinear(nn.Linear(64, 64, bias=False), rank=64, alpha=64.0)
    with torch.no_grad():
        lora.base.weight.zero_()
        lora.lora_A.copy_(torch.eye(64))
        lora.lora_B.copy_(torch.eye(64))
    x = torch.rand(200, 64) + 1.0  # no zeros of its own
    y = lora.train()(x)
    dropped = y == 0
    assert abs(dropped.float().mean().item() - 0.1) < 0.01, f"dropped share {dropped.float().mean():.3f}"
    assert_close(y[~dropped], x[~dropped] / 0.9, atol=1e-5, what="kept inputs")
    assert torch.equal(lora.eval()(x), x)  # no dropout at inference
    # install_lora uses the same default: stage 2 trains with dropout 0.1.
    model = wide.install_lora(random_model(), 4, 8.0)
    assert {m.dropout.p for m in model.modules() if isinstance(m, wide.LoRALinear)} == {0.1}


def test_fresh_lora_leaves_the_model_unchanged():
    model, _ = wide_model()
    idx = tokens(2, 10)
    before = model(idx)
    wide.install_lora(model, 4, 8.0)
    model.eval()
    assert torch.equal(model(idx), before)


def test_merged_lora_weight_is_w_plus_alpha_over_r_times_b_a():
    model = with_lora(random_model())
    q = model.layers[0].self_attn.q_proj
    expected = q.base.weight.double() + (8.0 / 4) * q.lora_B.double() @ q.lora_A.double()
    wide.merge_lora(model)
    assert not any(isinstance(m, wide.LoRALinear) for m in model.modules())
    assert_close(model.layers[0].self_attn.q_proj.weight, expected, atol=1e-6, what="merged q_proj weight")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=["bf16", "fp64"])
def test_merged_lora_keeps_the_dtype_of_the_base_weight(dtype):
    lora = wide.LoRALinear(nn.Linear(8, 6, bias=False, dtype=dtype), rank=2, alpha=4.0)
    assert lora.merged().weight.dtype == dtype


def test_merged_lora_equals_unmerged_lora_with_routers():
    model, _ = wide_model()
    with_lora(model)  # eval mode: dropout off, deterministic routing
    idx = tokens(2, 10)
    unmerged, unmerged_masks = run(model, idx)
    wide.merge_lora(model)
    merged, merged_masks = run(model, idx)
    # fp32 rounding of two summation orders; these logits reach ~7, so the bound is relative.
    assert_close(merged, unmerged, atol=1e-5 * unmerged.abs().max().item(), what="logits, merged vs unmerged LoRA")
    for name, keep in merged_masks.items():
        assert torch.equal(keep, unmerged_masks[name]), f"{name} routes differently after the merge"


def test_merged_lora_equals_unmerged_within_1e_5_at_the_usual_weight_scale():
    # An absolute bound: with the model's own init (std 0.02) logits are O(1), so fp32 rounding of the
    # two summation orders stays far below 1e-5.
    torch.manual_seed(0)
    model = Transformer(small_config())
    wide.install_routers(model, wide_config())
    with_lora(model)
    idx = tokens(2, 10)
    unmerged = model(idx)
    wide.merge_lora(model)
    assert_close(model(idx), unmerged, atol=1e-5, what="logits, merged vs unmerged LoRA")


# ----------------------------------------------------------------------------------------------------
# 7. FLOP accounting


def test_flop_fraction_matches_a_hand_count():
    cfg = small_config(vocab_size=50)  # D 32, 2 layers, 4 query heads and 2 KV heads of dim 8, FFN 64
    # Multiply-adds per token, written out:
    q = o = 32 * 4 * 8                    # 1024 each
    kv = 2 * 32 * 2 * 8                   # 1024: K and V always run (the KV cache stays complete)
    ffn = 3 * 32 * 64                     # 6144: gate, up, down
    head = 32 * 50                        # 1600: once per token, never skipped
    router = (32 * 8 + 8 * 2 * 2) + (32 * 8 + 8 * 2 * 4)  # rank 8; 2 head groups, 4 channel groups: 608
    dense = 2 * (q + kv + o + ffn) + head
    assert dense == 20032 == wide.dense_flops(cfg)  # the denominator of every fraction, routers or not

    assert wide.flop_fraction(cfg, None, [1, 1], [1, 1]) == 1.0  # dense accounting, no routers
    # With routers, keeping every group costs slightly more than the dense model.
    wcfg = wide_config()
    assert wide.flop_fraction(cfg, wcfg, [1, 1], [1, 1]) == pytest.approx((dense + 2 * router) / dense)
    assert wide.flop_fraction(cfg, wcfg, [1, 1], [1, 1]) > 1.0
    # Attention keeps half its heads in both layers; the FFN keeps a quarter, then three quarters.
    assert wide.flop_fraction(cfg, wcfg, [0.5, 0.5], [0.25, 0.75]) == pytest.approx(
        (head + 2 * (kv + router) + 2 * 0.5 * (q + o) + (0.25 + 0.75) * ffn) / dense)
    # Skipping everything still pays for K/V, the head and the routers.
    assert wide.flop_fraction(cfg, wcfg, [0, 0], [0, 0]) == pytest.approx(4864 / dense)
    assert head + 2 * (kv + router) == 4864

    # Layer skip: one router of one group per layer; a skipped layer still computes its K/V.
    lcfg = wide_config(method="layerskip")
    layer_router = 32 * 8 + 8 * 2 * 1
    assert wide.flop_fraction(cfg, lcfg, None, None, keep_layer=[1, 0]) == pytest.approx(
        (head + 2 * (kv + layer_router) + (q + o + ffn)) / dense)


def test_last_width_is_each_tokens_share_of_groups_run_and_its_flop_fraction():
    model, wcfg = wide_model()
    masks = {}
    model(tokens(2, 6), masks=masks)
    width = wide.last_width(masks, model.config, wcfg)
    for kind in ("attn", "ffn"):
        expected = (masks[kind][0].mean(-1) + masks[kind][1].mean(-1)) / 2  # [B, T], over groups then layers
        assert_close(width[kind], expected, atol=1e-7, what=f"{kind} width")
    L = model.config.n_layers
    b, t = 1, 4
    one = wide.flop_fraction(model.config, wcfg, [width["attn"][b, t].item()] * L, [width["ffn"][b, t].item()] * L)
    assert width["flops"][b, t].item() == pytest.approx(one)
