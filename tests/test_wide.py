"""
The specification of wide.py, one property per test.

Everything runs on the CPU in fp32 with a two-layer model of width 32 (4 query heads sharing 2 KV heads,
FFN width 64), so routers have 2 head groups (one KV group each) and 4 channel groups of 16. The random
models get weights of std 0.3: with the default 0.02 init the residual stream is so small that every
router logit sits near zero, and routing tests would only ever see near-ties.

The last tests train: routers on a frozen "teacher" model (a random model whose own samples are the
data, so executing everything is optimal and skipping has a real cost), and the stage-1/stage-2 driver
of train.py on a few steps, to check that the temperature restarts with each stage.
"""
import math
import types
from dataclasses import asdict

import pytest
import torch
import torch.nn as nn

import train
import wide
from model import CheckpointError, ModelConfig, Transformer, save_checkpoint
from wide import Router, WideConfig


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These models are tiny: one thread is faster than two fighting over the cores with anything else.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def assert_close(actual, expected, atol, what="tensors"):
    """Like torch.testing.assert_close, but the message says how far apart the tensors are."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.numel() == 0:
        return
    diff = (actual.double() - expected.double()).abs()
    assert diff.max().item() <= atol, (
        f"{what} differ: max abs diff {diff.max().item():.3g}, mean {diff.mean().item():.3g} (allowed {atol:g})")


V = 64  # vocabulary of the test models


def small_config(**overrides):
    cfg = dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64, max_seq_len=64)
    cfg.update(overrides)
    return ModelConfig(**cfg)


def random_model(seed=0, **overrides):
    """A dense model with weight matrices of std 0.3 and norm gains 1 + 0.2 * noise (see the docstring)."""
    torch.manual_seed(seed)
    model = Transformer(small_config(**overrides))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if p.dim() == 1 else 0.3 * noise)
    return model.eval()


def wide_config(**overrides):
    # 2 head groups (attn_group_size defaults to n_heads / n_kv_heads = 2), 4 channel groups of 16.
    cfg = dict(ffn_group_size=16, rank=8)
    cfg.update(overrides)
    return WideConfig(**cfg)


def wide_model(seed=0, **overrides):
    """A random model with freshly initialised routers, in eval mode (deterministic routing)."""
    model, wcfg = random_model(seed), wide_config(**overrides)
    torch.manual_seed(100 + seed)
    wide.install_routers(model, wcfg)
    return model.eval(), wcfg


def tokens(B, T, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def masks(model):
    """The masks every router chose in the last forward, by name."""
    return {f"layer {i} {name}": getattr(layer, f"{name}_router").keep
            for i, layer in enumerate(model.layers) for name in ("attn", "ffn", "layer")
            if getattr(layer, f"{name}_router") is not None}


def router_params(model):
    return [p for n, p in model.named_parameters() if "router" in n]


def penalty_term(wcfg):
    """The extra_loss train.py hands to train_loop in stage 1 and 2: the sparsity penalty, and the rates."""
    def penalty(model):
        rates = wide.skip_rates(model)
        return wide.sparsity_penalty(rates, wcfg), {k: v.detach() for k, v in rates.items()}
    return penalty


def loop_args(**overrides):
    """The few command-line settings train.train_loop reads."""
    args = dict(device="cpu", seed=0, batch_size=16, block_size=32, eval_interval=10**6, grad_clip=1.0)
    args.update(overrides)
    return types.SimpleNamespace(**args)


class ForcedMask(nn.Module):
    """A stand-in router returning a fixed per-token mask [B, T, G], kept where the bookkeeping reads it."""

    def __init__(self, keep):
        super().__init__()
        self.keep = keep

    def forward(self, x):
        return self.keep


# ----------------------------------------------------------------------------------------------------
# the router


def test_router_is_two_linears_with_kaiming_init_zero_biases_and_rank_clipped_to_width():
    torch.manual_seed(0)
    r = Router(dim=64, n_groups=4, rank=32)
    assert (r.down.in_features, r.down.out_features, r.up.out_features) == (64, 32, 8)  # 2 logits per group
    assert not r.down.bias.any() and not r.up.bias.any()
    # Kaiming-uniform with the linear gain: U(-sqrt(3 / fan_in), +sqrt(3 / fan_in)), wider than
    # PyTorch's default Linear init, whose bound is 1 / sqrt(fan_in).
    for lin in (r.down, r.up):
        bound = math.sqrt(3 / lin.in_features)
        assert lin.weight.abs().max() <= bound
        assert lin.weight.abs().max() > 1.5 / math.sqrt(lin.in_features)
    # A router never has a bottleneck wider than the model.
    assert Router(dim=16, n_groups=3, rank=32).down.out_features == 16
    assert Router(dim=16, n_groups=3, rank=32).logits(torch.randn(2, 5, 16)).shape == (2, 5, 3, 2)


def test_training_masks_are_exactly_binary_with_gumbel_noise():
    model, _ = wide_model()
    model.train()
    for tau in (5.0, 0.5):
        wide.set_temperature(model, tau)
        model(tokens(4, 16))
        for name, keep in masks(model).items():
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
        assert_close(keep.mean((0, 1)), expected, 0.02, f"execute frequency at tau {tau}")


def test_gradients_reach_both_router_linears_through_cross_entropy_and_penalty():
    model, wcfg = wide_model(target=0.2)  # far from the ~0.5 rate at init, so the penalty has a slope
    model.requires_grad_(False)
    for p in router_params(model):
        p.requires_grad_(True)
    model.train()
    idx, targets = tokens(4, 16), tokens(4, 16, seed=1)
    for term in ("cross-entropy", "penalty", "cross-entropy + penalty"):
        model.zero_grad(set_to_none=True)
        _, ce = model(idx, targets)
        penalty = wide.sparsity_penalty(wide.skip_rates(model), wcfg)
        loss = {"cross-entropy": ce, "penalty": penalty, "cross-entropy + penalty": ce + penalty}[term]
        loss.backward()
        for n, p in model.named_parameters():
            if "router" in n:
                assert p.grad is not None and p.grad.abs().sum() > 0, f"{term}: no gradient reaches {n}"
            else:
                assert p.grad is None, f"{term}: the frozen backbone parameter {n} got a gradient"


def test_training_routers_leaves_a_frozen_backbone_untouched():
    model, wcfg = wide_model()
    model.requires_grad_(False)
    params = router_params(model)
    for p in params:
        p.requires_grad_(True)
    backbone = {k: v.clone() for k, v in model.state_dict().items() if "router" not in k}
    routers = {k: v.clone() for k, v in model.state_dict().items() if "router" in k}
    val = (tokens(2, 16), tokens(2, 16, seed=1))
    train.train_loop(model, params, tokens(1, 500, seed=2)[0], val, loop_args(batch_size=4, block_size=16),
                     steps=3, lr=1e-2, min_lr=0.0, warmup=1, weight_decay=0.01, name="test",
                     extra_loss=penalty_term(wcfg))
    after = model.state_dict()
    for k, v in backbone.items():
        assert torch.equal(after[k], v), f"frozen backbone tensor {k} changed"
    assert any(not torch.equal(after[k], v) for k, v in routers.items()), "the routers did not train"


def test_eval_routing_is_deterministic():
    model, _ = wide_model()
    idx = tokens(3, 16)
    logits1, masks1 = model(idx), {k: v.clone() for k, v in masks(model).items()}
    logits2, masks2 = model(idx), masks(model)
    assert torch.equal(logits1, logits2)
    for name in masks1:
        assert torch.equal(masks1[name], masks2[name]), f"{name} changed between two identical calls"
        assert (masks1[name] == 0).any() and (masks1[name] == 1).any(), f"{name} should mix skips and executes"


def test_a_tokens_routing_and_logits_ignore_its_batch_mates_and_right_padding():
    model, _ = wide_model()
    seq = tokens(1, 10)
    alone_logits, alone = model(seq), {k: v.clone() for k, v in masks(model).items()}
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
            logits = model(batch)
            for name, keep in masks(model).items():
                assert torch.equal(keep[row, :10], alone[name][0]), f"{name} mask of the sequence {how}"
            assert_close(logits[row, :10], alone_logits[0], 1e-5, f"logits of the sequence {how}")


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


# ----------------------------------------------------------------------------------------------------
# sparsity bookkeeping and the penalty


def test_penalty_with_a_shared_target_is_20_times_the_gap_to_the_mean_rate():
    rates = dict(attn=torch.tensor(0.3), ffn=torch.tensor(0.5))
    # 20 * |0.5 - (0.3 + 0.5) / 2| = 20 * 0.1
    assert_close(wide.sparsity_penalty(rates, WideConfig(target=0.5)), 2.0, 1e-5, "penalty")
    # Rates above the target cost as much as rates below it.
    assert_close(wide.sparsity_penalty(rates, WideConfig(target=0.3)), 20 * 0.1, 1e-5, "penalty")


def test_penalty_with_separate_targets_is_the_mean_of_the_two_gaps():
    rates = dict(attn=torch.tensor(0.3), ffn=torch.tensor(0.5))
    wcfg = WideConfig(attn_target=0.6, ffn_target=0.2)
    # 20 * (|0.6 - 0.3| + |0.2 - 0.5|) / 2: the two gaps would cancel under a shared target of 0.4.
    assert_close(wide.sparsity_penalty(rates, wcfg), 20 * 0.5 * (0.3 + 0.3), 1e-5, "penalty")


def test_layer_skip_penalty_is_20_times_the_gap_to_the_layer_rate():
    rates = dict(layer=torch.tensor(0.4))
    assert_close(wide.sparsity_penalty(rates, WideConfig(method="layerskip", target=0.25)), 20 * 0.15, 1e-5,
                 "penalty")


def test_skip_rates_count_only_valid_tokens():
    model, _ = wide_model()
    a, b = tokens(1, 8), tokens(1, 5, seed=1)
    # Skipped groups per router, counted on each sequence alone.
    skipped, n_groups = {}, {}
    for seq in (a, b):
        model(seq)
        for name, keep in masks(model).items():
            skipped[name] = skipped.get(name, 0) + (1 - keep).sum().item()
            n_groups[name] = keep.shape[-1]
    # The same two sequences as one batch, the shorter right-padded with 3 tokens.
    batch = torch.cat([a, torch.cat([b, tokens(1, 3, seed=2)], 1)])
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, 5:] = False
    model(batch)
    rates = wide.skip_rates(model, valid)
    for kind in ("attn", "ffn"):
        per_layer = [skipped[f"layer {i} {kind}"] / (13 * n_groups[f"layer {i} {kind}"]) for i in range(2)]
        assert_close(rates[kind], sum(per_layer) / 2, 1e-6, f"{kind} rate over the 13 real tokens")
    # Whatever the routers decide on padding, the rates do not move.
    for decision in (0.0, 1.0):
        for keep in masks(model).values():
            keep[1, 5:] = decision
        for kind, rate in wide.skip_rates(model, valid).items():
            assert torch.equal(rate, rates[kind]), f"{kind} rate moved with padding decisions {decision}"
    # Without a valid mask every position counts.
    plain = wide.skip_rates(model)
    for kind in ("attn", "ffn"):
        expected = torch.stack([1 - masks(model)[f"layer {i} {kind}"].mean() for i in range(2)]).mean()
        assert_close(plain[kind], expected, 1e-6, f"{kind} rate over all positions")


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
# the temperature schedule


def test_temperature_falls_linearly_from_5_to_0_5_over_a_stage():
    taus = [wide.temperature(step, 10) for step in range(10)]
    assert_close(torch.tensor(taus), torch.linspace(5.0, 0.5, 10), 1e-6, "temperatures")
    assert wide.temperature(0, 1) == 5.0  # a one-step stage never divides by zero


@pytest.mark.parametrize("method", ["wide", "layerskip"])
def test_set_temperature_reaches_every_router(method):
    model, _ = wide_model(method=method)
    wide.set_temperature(model, 1.25)
    routers = list(wide.routers(model))
    assert len(routers) == (4 if method == "wide" else 2)
    assert all(isinstance(r, Router) and r.tau == 1.25 for r in routers)


# ----------------------------------------------------------------------------------------------------
# the layer-skip baseline


def test_a_layer_skipped_token_passes_through_the_layer_unchanged():
    model, _ = wide_model(method="layerskip")
    idx = tokens(2, 6)
    keep = torch.ones(2, 6, 1)
    keep[0, 3] = 0
    layer = model.layers[0]
    layer.layer_router = ForcedMask(keep)
    seen = {}
    layer.register_forward_hook(lambda m, inputs, out: seen.update(x=inputs[0], y=out))
    model(idx)
    x, y = seen["x"], seen["y"]
    assert torch.equal(y[0, 3], x[0, 3]), "the skipped token changed"
    change = (y - x).abs().amax(-1)
    change[0, 3] = 1.0
    assert (change > 1e-3).all(), "tokens that execute the layer should change"
    # The skipped token still writes K/V: a later token in the layer sees a change to it.
    changed = idx.clone()
    changed[0, 3] = (changed[0, 3] + 1) % V
    model(changed)
    assert (seen["y"][0, 4] - y[0, 4]).abs().max() > 1e-4

    # The same with a real router in training: the straight-through gate is an exact 0 in the forward.
    torch.manual_seed(0)
    r = Router(32, 1, 8).train()
    with torch.no_grad():
        r.up.bias.copy_(torch.tensor([0.0, 50.0]))  # skip with probability 1 - sigmoid(-50)
    layer.layer_router = r
    model(idx)
    assert torch.equal(seen["y"], seen["x"])


# ----------------------------------------------------------------------------------------------------
# LoRA


def with_lora(model, rank=4, alpha=8.0, seed=0):
    """LoRA on every projection, with B made non-zero (a freshly installed LoRA is an exact no-op)."""
    wide.install_lora(model, rank, alpha)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, wide.LoRALinear):
                m.lora_B.copy_(0.1 * torch.randn(m.lora_B.shape, generator=g))
    return model.eval()


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
    assert_close(model.layers[0].self_attn.q_proj.weight, expected, 1e-6, "merged q_proj weight")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=["bf16", "fp64"])
def test_merged_lora_keeps_the_dtype_of_the_base_weight(dtype):
    lora = wide.LoRALinear(nn.Linear(8, 6, bias=False, dtype=dtype), rank=2, alpha=4.0)
    assert lora.merged().weight.dtype == dtype


def test_merged_lora_equals_unmerged_lora_with_routers():
    model, _ = wide_model()
    with_lora(model)  # eval mode: dropout off, deterministic routing
    idx = tokens(2, 10)
    unmerged, unmerged_masks = model(idx), {k: v.clone() for k, v in masks(model).items()}
    wide.merge_lora(model)
    merged = model(idx)
    # fp32 rounding of two summation orders; these logits reach ~7, so the bound is relative.
    assert_close(merged, unmerged, 1e-5 * unmerged.abs().max().item(), "logits, merged vs unmerged LoRA")
    for name, keep in masks(model).items():
        assert torch.equal(keep, unmerged_masks[name]), f"{name} routes differently after the merge"


# ----------------------------------------------------------------------------------------------------
# checkpoints


@pytest.fixture(scope="module")
def tokenizer():
    return train.train_tokenizer(["To be, or not to be, that is the question."] * 4, 300)


def router_and_lora_tensors(model):
    return {k: v for k, v in model.state_dict().items() if "router" in k or "lora_" in k}


@pytest.mark.parametrize("method", ["wide", "layerskip"])
def test_router_and_lora_checkpoint_round_trips(tmp_path, tokenizer, method):
    model, wcfg = wide_model(method=method, lora_rank=4, lora_alpha=8.0, stage=2)
    with_lora(model)
    idx = tokens(2, 10)
    expected = model(idx)
    expected_masks = {k: v.clone() for k, v in masks(model).items()}
    path = str(tmp_path / "ckpt")
    wide.save_wide(path, model, tokenizer, wcfg)

    loaded, wcfg2 = wide.load_wide(path, merge=False)
    loaded.eval()
    assert asdict(wcfg2) == asdict(wcfg)
    saved, got = router_and_lora_tensors(model), router_and_lora_tensors(loaded)
    assert saved.keys() == got.keys() and len(saved) > 0
    for k in saved:
        assert torch.equal(got[k], saved[k]), f"{k} changed in the round trip"
    assert_close(loaded(idx), expected, 0.0, "logits after load_wide(merge=False)")
    for name, keep in masks(loaded).items():
        assert torch.equal(keep, expected_masks[name]), f"{name} routes differently after loading"

    merged, _ = wide.load_wide(path)  # merge=True is the default, for inference
    merged.eval()
    assert not any(isinstance(m, wide.LoRALinear) for m in merged.modules())
    assert_close(merged(idx), expected, 1e-5 * expected.abs().max().item(), "logits after load_wide(merge=True)")


def test_load_wide_in_bf16_merges_lora_into_bf16_weights(tmp_path, tokenizer):
    # What generate.py does on a GPU with a stage-2 checkpoint.
    model, wcfg = wide_model(lora_rank=4, lora_alpha=8.0, stage=2)
    with_lora(model)
    idx = tokens(2, 10)
    expected = model(idx)
    path = str(tmp_path / "ckpt")
    wide.save_wide(path, model, tokenizer, wcfg)
    loaded, _ = wide.load_wide(path, dtype=torch.bfloat16)
    loaded.eval()
    wrong = [n for n, p in loaded.named_parameters() if "router" not in n and p.dtype != torch.bfloat16]
    assert not wrong, f"backbone weights not in bf16 after the merge: {wrong[:3]}"
    # The same as merging in fp32 and then casting the backbone to bf16 (routers stay fp32). This random
    # model is chaotic (std 0.3 weights), so bf16 vs fp32 logits are not compared here; the kernels'
    # GPU tests hold the bf16 tolerances.
    wide.merge_lora(model)
    for name, p in model.named_parameters():
        if "router" not in name:
            p.data = p.data.to(torch.bfloat16)
    assert torch.equal(loaded(idx), model(idx))


def test_load_wide_of_a_dense_checkpoint_raises_checkpoint_error(tmp_path, tokenizer):
    path = str(tmp_path / "dense")
    save_checkpoint(path, random_model(), tokenizer)
    with pytest.raises(CheckpointError, match="wide.json"):
        wide.load_wide(path)


# ----------------------------------------------------------------------------------------------------
# FLOP accounting


def test_flop_fraction_matches_a_hand_count():
    cfg = small_config(vocab_size=50)  # D 32, 2 layers, 4 query heads and 2 KV heads of dim 8, FFN 64
    # Multiply-adds per token, written out:
    q = o = 32 * 4 * 8                    # 1024 each
    kv = 2 * 32 * 2 * 8                   # 1024: K and V always run (the KV cache stays complete)
    ffn = 3 * 32 * 64                     # 6144: gate, up, down
    head = 32 * 50                        # 1600: once per token, never skipped
    router = (32 * 8 + 8 * 2 * 2) + (32 * 8 + 8 * 2 * 4)  # rank 8; 2 head groups, 4 channel groups: 608
    dense = 2 * (q + kv + o + ffn) + head
    assert dense == 20032

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


# ----------------------------------------------------------------------------------------------------
# training: stage 1 reaches its target, and each stage restarts the temperature


@pytest.fixture(scope="module")
def teacher():
    """A frozen random model and samples drawn from it: data on which skipping has a real cost."""
    model = random_model(seed=0)

    @torch.no_grad()
    def sample(n, T, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(V, (n, 1), generator=g)
        for _ in range(T - 1):
            p = torch.softmax(model(x)[:, -1], -1)
            x = torch.cat([x, torch.multinomial(p, 1, generator=g)], 1)
        return x

    data = sample(128, 33, seed=1).reshape(-1)  # one stream; train.get_batch cuts windows from it
    val = sample(32, 33, seed=2)
    return model, data, (val[:, :-1].contiguous(), val[:, 1:].contiguous())


@pytest.mark.parametrize("target", [0.25, 0.75])
def test_stage_1_moves_deterministic_sparsity_to_within_0_1_of_the_target(teacher, target):
    base, data, (vx, vy) = teacher
    model = Transformer(base.config)
    model.load_state_dict(base.state_dict())
    model.requires_grad_(False)
    wcfg = wide_config(target=target)
    torch.manual_seed(0)
    wide.install_routers(model, wcfg)
    params = router_params(model)
    for p in params:
        p.requires_grad_(True)

    def realized_rate():
        model.eval()
        with torch.no_grad():
            model(vx)
        rates = wide.skip_rates(model)
        return ((rates["attn"] + rates["ffn"]) / 2).item()

    start = realized_rate()
    assert abs(start - target) > 0.15, f"routers start at {start:.2f}, too close to {target} to show anything"

    # Stage 1 as train.py runs it (AdamW, 10% warm-up then cosine, clip 1, wd 0.01, tau 5 -> 0.5), with
    # a learning rate 10x the paper's 2e-3 so that 200 steps are enough.
    steps = 200
    train.train_loop(model, params, data, (vx, vy), loop_args(), steps=steps, lr=2e-2, min_lr=0.0,
                     warmup=steps // 10, weight_decay=0.01, name="stage 1", extra_loss=penalty_term(wcfg),
                     on_step=lambda step: wide.set_temperature(model, wide.temperature(step, steps)))
    end = realized_rate()
    assert abs(end - target) < 0.1, (
        f"deterministic sparsity {end:.3f} after stage 1 (it started at {start:.3f}), target {target}")


def test_each_stage_restarts_the_temperature_at_5(teacher, tokenizer, tmp_path, monkeypatch):
    base, data, val = teacher
    args = loop_args(batch_size=4, block_size=16, out_dir=str(tmp_path), base_dir=str(tmp_path / "base"),
                      stage1_steps=4, stage1_lr=2e-3, stage2_steps=3, stage2_lr=2e-4, lora_rank=4, lora_alpha=8.0)
    save_checkpoint(args.base_dir, base, tokenizer)
    set_temperature = wide.set_temperature
    taus = []

    def recording(model, tau):
        set_temperature(model, tau)
        assert all(r.tau == tau for r in wide.routers(model)), "set_temperature missed a router"
        taus.append(tau)

    monkeypatch.setattr(wide, "set_temperature", recording)
    wcfg = wide_config()
    train.train_stage(args, wcfg, 1, tokenizer, data, val)
    stage1, taus[:] = taus[:], []
    train.train_stage(args, wcfg, 2, tokenizer, data, val)
    assert stage1 == pytest.approx([5.0, 3.5, 2.0, 0.5])
    assert taus == pytest.approx([5.0, 2.75, 0.5])
    _, saved = wide.load_wide(train.run_dir(args, wcfg, 2))
    assert (saved.stage, saved.lora_rank) == (2, 4)


def test_merged_lora_equals_unmerged_within_1e_5_at_the_usual_weight_scale():
    # The bound, absolute: with the model's own init (std 0.02) logits are O(1), so fp32
    # rounding of the two summation orders stays far below 1e-5.
    torch.manual_seed(0)
    model = Transformer(small_config())
    wide.install_routers(model, wide_config())
    with_lora(model)
    idx = tokens(2, 10)
    unmerged = model(idx)
    wide.merge_lora(model)
    assert_close(model(idx), unmerged, 1e-5, "logits, merged vs unmerged LoRA")
