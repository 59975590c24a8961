"""
The specification of the baselines WIDE is compared with: layer-skip (dynamic depth, trained like WIDE:
wide.py), static width and TEAL-style thresholds (training-free: baselines.py). The models are the small
ones of tiny_models.py (2 layers, 2 head groups and 4 channel groups per layer).
"""
import pytest
import torch
import torch.nn as nn

import baselines
import wide
from conftest import assert_close
from tiny_models import V, random_model, run, tokens, wide_config, wide_model


class ForcedMask(nn.Module):
    """A stand-in router returning a fixed per-token mask [B, T, G]."""

    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, x):
        return self.mask


def calibration_batches(n=4, seed=5):
    return [tokens(8, 16, seed=seed + i) for i in range(n)]


# ----------------------------------------------------------------------------------------------------
# layer-skip (wide.py, method "layerskip")


def test_a_layer_skipped_token_passes_through_the_layer_unchanged():
    model, _ = wide_model(method="layerskip")
    idx = tokens(2, 6)
    gate = torch.ones(2, 6, 1)
    gate[0, 3] = 0
    layer = model.layers[0]
    layer.layer_router = ForcedMask(gate)
    seen = {}
    layer.register_forward_hook(lambda m, inputs, out: seen.update(x=inputs[0], y=out))
    _, masks = run(model, idx)
    assert torch.equal(masks["layer 0 layer"], gate)  # the gate is what the bookkeeping reads
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
    r = wide.Router(32, 1, 8).train()
    with torch.no_grad():
        r.up.bias.copy_(torch.tensor([0.0, 50.0]))  # skip with probability 1 - sigmoid(-50)
    layer.layer_router = r
    model(idx)
    assert torch.equal(seen["y"], seen["x"])


# ----------------------------------------------------------------------------------------------------
# static width


def test_capture_inputs_collects_what_each_projection_sees():
    model = random_model()
    batches = calibration_batches(2)
    acts = baselines.capture_inputs(model, batches, ("o_proj", "down_proj"))
    assert set(acts) == {(i, n) for i in range(2) for n in ("o_proj", "down_proj")}
    assert acts[(1, "down_proj")].shape == (2 * 8 * 16, 64)  # every token of every batch, FFN width 64
    seen = []
    model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].reshape(-1, 64)))
    for x in batches:
        model(x)
    assert torch.equal(acts[(1, "down_proj")], torch.cat(seen))


@pytest.mark.parametrize("target,kept", [(0.5, (1, 2)), (0.25, (2, 3)), (0.0, (2, 4))])
def test_static_width_keeps_the_most_important_groups_for_every_token(target, kept):
    # Make the importance obvious: scale the o_proj / down_proj columns of some groups by 100, so their
    # contribution to the output dwarfs the others'. Those are the groups static width must keep.
    model = random_model()
    important = {(0, "attn"): [1], (1, "attn"): [0], (0, "ffn"): [1, 3], (1, "ffn"): [0, 2]}
    with torch.no_grad():
        for (i, kind), groups in important.items():
            proj = model.layers[i].self_attn.o_proj if kind == "attn" else model.layers[i].mlp.down_proj
            size = 16 if kind == "ffn" else 2 * 8  # channels per group: 16, or 2 heads of dim 8
            for g in groups:
                proj.weight[:, g * size:(g + 1) * size] *= 100
    wcfg = wide_config(target=target)
    baselines.calibrate_static_width(model, wcfg, calibration_batches())
    n_attn_kept, n_ffn_kept = kept  # of 2 head groups and 4 channel groups: G - round(s * G)
    for (i, kind), groups in important.items():
        mask = getattr(model.layers[i], f"{kind}_router").mask
        assert mask.sum().item() == (n_attn_kept if kind == "attn" else n_ffn_kept)
        assert all(mask[g] == 1 for g in groups), f"layer {i} {kind}: kept {mask.tolist()}, not groups {groups}"
    # Every token gets the same mask, and the skip rates follow from it.
    masks = {}
    model(tokens(3, 7), masks=masks)
    for kind, n_groups, n_kept in (("attn", 2, n_attn_kept), ("ffn", 4, n_ffn_kept)):
        for i, m in enumerate(masks[kind]):
            assert torch.equal(m, getattr(model.layers[i], f"{kind}_router").mask.expand(3, 7, -1))
        assert_close(wide.skip_rates(masks)[kind], 1 - n_kept / n_groups, atol=1e-7, what=f"{kind} rate")


# ----------------------------------------------------------------------------------------------------
# TEAL-style thresholds


@pytest.mark.parametrize("sparsity", [0.25, 0.6])
def test_teal_zeroes_the_share_s_of_the_calibration_inputs(sparsity):
    # The threshold is the s-quantile of |input|: rerunning the calibration text zeroes a share s of the
    # first layer's Q/K/V inputs (up to ties: a token repeated in the text repeats its inputs), and about
    # s everywhere (deeper layers see inputs that the earlier thresholds have already changed).
    model = random_model()
    batches = calibration_batches()
    acts = baselines.capture_inputs(model, batches, ("q_proj",))
    baselines.calibrate_teal(model, sparsity, batches)
    q = model.layers[0].self_attn.q_proj
    assert isinstance(q, baselines.TealLinear)
    x = acts[(0, "q_proj")].abs().flatten()
    assert q.threshold == x.kthvalue(int(sparsity * x.numel())).values.item()
    for x in batches:
        model(x)
    for i, layer in enumerate(model.layers):
        for parent, name in wide.LORA_TARGETS:
            m = getattr(getattr(layer, parent), name)
            share = m.zeroed / m.total
            bound = 0.005 if i == 0 and name in ("q_proj", "k_proj", "v_proj") else 0.1
            assert abs(share - sparsity) <= bound, f"layer {i} {name}: zeroed {share:.3f}, target {sparsity}"


def test_teal_at_sparsity_0_zeroes_nothing_and_keeps_the_logits():
    model = random_model()
    idx = tokens(2, 10)
    expected = model(idx)
    baselines.calibrate_teal(model, 0.0, calibration_batches(1))
    assert torch.equal(model(idx), expected)


def test_teal_flop_fraction_counts_each_projection_by_its_zeroed_share():
    model = random_model(vocab_size=50)  # D 32, 4 query heads and 2 KV heads of dim 8, FFN 64, 2 layers
    baselines.calibrate_teal(model, 0.5, [x % 50 for x in calibration_batches(1)])
    q = o = 32 * 4 * 8
    kv = 2 * 32 * 2 * 8
    ffn = 3 * 32 * 64
    head = 32 * 50
    dense = 2 * (q + kv + o + ffn) + head
    for layer in model.layers:  # set the counts by hand: q zeroes 1/4 of its input, down_proj all of it
        for parent, name in wide.LORA_TARGETS:
            m = getattr(getattr(layer, parent), name)
            m.zeroed, m.total = {"q_proj": (1, 4), "down_proj": (4, 4)}.get(name, (0, 4))
    assert baselines.teal_flop_fraction(model) == pytest.approx((dense - 2 * (0.25 * q + ffn / 3)) / dense)
