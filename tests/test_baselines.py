"""
The specification of the baselines WIDE is compared with: layer-skip (dynamic depth, trained like WIDE:
wide.py), static width and TEAL-style thresholds (training-free: baselines.py). The models are the small
ones of tiny_models.py (2 layers, 2 head groups and 4 channel groups per layer).
"""
import pytest
import torch
import torch.nn as nn

import baselines
import checkpoints
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


def zeroed_shares(model):
    """{(layer, projection): the share of its inputs TEAL zeroed} since the counts were reset."""
    return {(i, name): getattr(getattr(layer, parent), name).zeroed / getattr(getattr(layer, parent), name).total
            for i, layer in enumerate(model.layers) for parent, name in wide.LORA_TARGETS}


@pytest.mark.parametrize("sparsity", [0.25, 0.6])
def test_teal_zeroes_the_share_s_of_the_calibration_inputs(sparsity):
    # The threshold is the s-quantile of |input|: rerunning the calibration text zeroes a share s of every
    # projection's inputs (up to ties: a token repeated in the text repeats its inputs), deeper ones too,
    # since each is calibrated on the inputs the thresholds before it let through.
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
    for (i, name), share in zeroed_shares(model).items():
        assert abs(share - sparsity) <= 0.01, f"layer {i} {name}: zeroed {share:.3f}, target {sparsity}"


def test_teals_one_pass_sets_the_thresholds_a_capture_per_projection_sets():
    # The twin of calibrate_teal's single forward: in forward order, capture one projection input's |x| over
    # every batch with the earlier thresholds in place, and take its s-quantile. Every threshold must agree,
    # deep layers included (a pass that forgot the earlier thresholds would see other inputs there).
    model, twin = random_model(), random_model()
    batches = calibration_batches()
    baselines.calibrate_teal(model, 0.5, batches)
    for i, layer in enumerate(twin.layers):
        for group in (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)):
            x = baselines.capture_inputs(twin, batches, group[:1], layers=[i])[(i, group[0])].abs().flatten()
            t = x.kthvalue(int(0.5 * x.numel())).values.item()
            for parent, name in wide.LORA_TARGETS:
                if name in group:
                    setattr(getattr(layer, parent), name, baselines.TealLinear(getattr(getattr(layer, parent), name), t))
            for name in group:
                ours = getattr(getattr(model.layers[i], "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj")
                                       else "mlp"), name).threshold
                assert ours == pytest.approx(t, rel=1e-5, abs=1e-6), f"layer {i} {name}: {ours} != {t}"


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


def test_teal_nominal_flops_zero_exactly_s_of_every_projection_input_and_keep_the_head():
    cfg = random_model(vocab_size=50).config
    q = o = 32 * 4 * 8
    kv, ffn, head = 2 * 32 * 2 * 8, 3 * 32 * 64, 32 * 50
    layers = 2 * (q + kv + o + ffn)
    assert baselines.teal_nominal_flop_fraction(cfg, 0.0) == 1.0
    assert baselines.teal_nominal_flop_fraction(cfg, 0.4) == pytest.approx((head + 0.6 * layers) / (head + layers))


# ----------------------------------------------------------------------------------------------------
# static width's FLOPs, and the matched-FLOP comparison of eval.py


def test_static_flop_fraction_counts_the_whole_groups_each_layer_keeps():
    cfg, wcfg = random_model().config, wide_config()  # 2 head groups, 4 channel groups of 16
    for target, keep_attn, keep_ffn in ((0.0, 1.0, 1.0), (0.5, 0.5, 0.5), (0.3, 0.5, 0.75), (0.9, 0.0, 0.0)):
        expected = wide.flop_fraction(cfg, None, [keep_attn] * 2, [keep_ffn] * 2)
        assert baselines.static_flop_fraction(cfg, wcfg, target) == pytest.approx(expected), target


def test_static_steps_are_every_reachable_flop_fraction_in_decreasing_order():
    cfg, wcfg = random_model().config, wide_config()
    steps = baselines.static_steps(cfg, wcfg)
    flops = [f for _, f in steps]
    assert flops[0] == 1.0 and all(a > b for a, b in zip(flops, flops[1:]))
    for t, f in steps:
        assert baselines.static_flop_fraction(cfg, wcfg, t) == f
    # Every (kept head groups, kept channel groups) pair the targets reach is there: 0..2 x 0..4 along t.
    grid = {baselines.static_flop_fraction(cfg, wcfg, i / 1000) for i in range(990)}
    assert set(flops) == {f for f in grid}


def fake_baseline(method, flops_of, ppl_of):
    calls = []

    def at(t):
        calls.append(t)
        f = flops_of(t)
        return dict(method=method, target_sparsity=t, linear_flop_fraction=f, val_ppl=ppl_of(f))
    return at, calls


def test_matched_flops_bracket_static_between_two_steps_and_correct_teal_once_by_its_realized_flops():
    import eval as ev
    cfg, wcfg = random_model().config, wide_config()
    steps = baselines.static_steps(cfg, wcfg)
    f = 0.7
    w = dict(method="wide", stage=2, target_sparsity=0.5, linear_flop_fraction=f, val_ppl=50.0)
    ppl = lambda x: 40.0 / x  # any decreasing curve
    static_at, static_calls = fake_baseline("static", lambda t: baselines.static_flop_fraction(cfg, wcfg, t), ppl)
    # TEAL realizes 0.05 less sparsity than its target: the first solve overshoots the FLOPs, the second corrects.
    nominal = lambda t: baselines.teal_nominal_flop_fraction(cfg, t)
    teal_at, teal_calls = fake_baseline("teal", lambda t: nominal(t - 0.05), ppl)
    m = ev.matched_entry(w, f, [w], 40.0, static_at, teal_at, steps, cfg)
    (f_hi, _), (f_lo, _) = m["static_points"]
    assert f_hi >= f >= f_lo and len(static_calls) == 2, "static width is measured on both sides of the FLOPs"
    assert m["static_ppl"] == pytest.approx(ev.interpolate(m["static_points"], f))
    assert len(teal_calls) == 2
    assert m["teal_points"][0][0] > f + 0.01, "the first TEAL solve runs more FLOPs than asked"
    assert m["teal_points"][1][0] == pytest.approx(f, abs=1e-3), "one correction lands on the FLOPs"
    assert m["teal_ppl"] == pytest.approx(ppl(f), rel=0.01)
    assert m["layerskip_ppl"] is None  # no layer-skip rows: nothing to interpolate


def test_eval_reads_runs_trained_with_separate_targets(tmp_path):
    # out/wide-a0.6-f0.4-stage1 (train.py --attn-sparsity 0.6 --ffn-sparsity 0.4) has no wide-s*-stage1
    # sibling: eval.py must take the group sizes from the run itself and label its target.
    import types
    import data
    import eval as ev
    tok = data.train_tokenizer(["To be, or not to be, that is the question."] * 4, 300)
    model, wcfg = wide_model(attn_target=0.6, ffn_target=0.4)
    checkpoints.save_wide(str(tmp_path / "wide-a0.6-f0.4-stage1"), model, tok, wcfg)
    args = types.SimpleNamespace(out_dir=str(tmp_path), batch_size=4, device="cpu")
    x = tokens(4, 16)
    rows, group_cfg = ev.router_rows(args, x, x.roll(-1, 1))
    assert (group_cfg.attn_group_size, group_cfg.ffn_group_size) == (2, 16)
    (r,) = rows
    assert (r["target_sparsity"], r["attn_target"], r["ffn_target"]) == (0.5, 0.6, 0.4)
    assert len(r["attn_per_layer"]) == 2 and len(r["ffn_per_layer"]) == 2
    meta = dict(held_out_plays=["a/b.md"], held_out_tokens=64, block_size=16, command="python eval.py",
                device="cpu", torch="x", date="today")
    md = ev.markdown(rows, [], 40.0, meta)
    assert "| a0.6/f0.4 |" in md


def test_batch_shared_ffn_routing_runs_a_group_iff_k_of_the_batch_want_it():
    # Serving-time routing shared by a decode batch (eval.BatchShared): rows 0-3 are one batch, rows 4-5
    # the next (a smaller last batch). k = 1 is the union of the batch's masks, k = batch the intersection.
    keep = torch.tensor([[[1, 0, 0, 1]], [[1, 1, 0, 0]], [[1, 0, 0, 0]], [[0, 0, 0, 1]],
                         [[0, 1, 1, 0]], [[0, 1, 0, 0]]], dtype=torch.float32)  # [6, T=1, G=4]
    import eval as ev
    router = lambda h: keep

    def shared(k):
        return ev.BatchShared(router, 4, k)(None)

    assert torch.equal(shared(1)[:4], torch.tensor([1., 1, 0, 1]).expand(4, 1, 4))
    assert torch.equal(shared(2)[:4], torch.tensor([1., 0, 0, 1]).expand(4, 1, 4))
    assert torch.equal(shared(4)[:4], torch.tensor([0., 0, 0, 0]).expand(4, 1, 4))
    assert torch.equal(shared(2)[4:], torch.tensor([0., 1, 0, 0]).expand(2, 1, 4))
    assert shared(1).shape == keep.shape and shared(1).dtype == keep.dtype


def test_shared_rows_use_full_batches_and_share_fewer_groups_as_k_grows(tmp_path):
    import types
    import data
    import eval as ev
    tok = data.train_tokenizer(["To be, or not to be, that is the question."] * 4, 300)
    model, wcfg = wide_model()
    checkpoints.save_wide(str(tmp_path / "wide-s0.5-stage2"), model, tok, wcfg)
    args = types.SimpleNamespace(out_dir=str(tmp_path), dial_from=str(tmp_path / "wide-s0.5-stage2"), batch_size=4,
                                 device="cpu", shared_batch=[2, 4])
    x = tokens(10, 16)
    rows = ev.shared_rows(args, x, x.roll(-1, 1))
    assert [(r["batch"], r["k"]) for r in rows] == [(2, 1), (2, 2), (4, 1), (4, 2)]
    assert all(r["windows"] == 8 for r in rows)  # 10 windows -> 8: every batch of 2 and of 4 is full
    live = {(r["batch"], r["k"]): r["ffn_live_in_batch"] for r in rows}
    assert live[2, 1] >= live[2, 2] and live[4, 1] >= live[4, 2] and live[4, 1] >= live[2, 1]
    assert live[4, 1] > 1 - rows[0]["per_token_ffn_skip"], "the union of 4 tokens runs more than one token"


def test_serving_rows_score_each_profile_per_token_and_under_the_batch_rule(tmp_path):
    # bench/serving.py's profiles: the routers trained at 0.5 and at a0.75/f0.25, per token and with the FFN
    # run whole (the batch rule at decode); a profile not trained gives no rows.
    import types
    import data
    import eval as ev
    tok = data.train_tokenizer(["To be, or not to be, that is the question."] * 4, 300)
    model, wcfg = wide_model()
    checkpoints.save_wide(str(tmp_path / "wide-s0.5-stage2"), model, tok, wcfg)
    args = types.SimpleNamespace(out_dir=str(tmp_path), dial_from=str(tmp_path / "wide-s0.5-stage2"), batch_size=4,
                                 device="cpu")
    x = tokens(8, 16)
    y = x.roll(-1, 1)
    rows = ev.serving_rows(args, x, y, dense_ppl=10.0)
    assert [(r["profile"], r["ffn_rule"]) for r in rows] == [("dense", "-"), ("50/50", "per token"),
                                                              ("50/50", "dense at decode")]
    per_token, ruled = rows[1], rows[2]
    assert per_token["ffn_skip"] > 0 and ruled["ffn_skip"] == 0 and ruled["attn_skip"] > 0  # attention stays routed
    want, _ = ev.score(model, x, y, args)  # the same routers, then with no FFN router
    assert per_token["val_ppl"] == round(want, 3) and per_token["ppl_vs_dense"] == round(want / 10.0, 4)
    for layer in model.layers:
        layer.ffn_router = None
    assert ruled["val_ppl"] == round(ev.score(model, x, y, args)[0], 3) != per_token["val_ppl"]
    md = ev.serving_markdown(rows, dict(device="cpu", torch="t", date="d", command="c", held_out_tokens=128,
                                        block_size=16))
    assert "| 50/50 | dense at decode |" in md and "| dense | - |" in md


def test_plot_lines_keep_the_control_and_other_dial_rules_apart_and_replot_redraws(tmp_path):
    import json
    import os
    import shutil
    import eval as ev
    rows = [dict(method="wide", stage=2, target_sparsity=0.5, checkpoint="out/wide-s0.5-stage2", val_ppl=47.0,
                 linear_flop_fraction=0.7),
            dict(method="wide", stage=2, target_sparsity=0.0, checkpoint="out/wide-s0-stage2", val_ppl=44.0,
                 linear_flop_fraction=1.03),
            dict(method="wide dial", stage=2, target_sparsity=0.4, checkpoint="out/wide-s0.5-stage2", val_ppl=46.0,
                 linear_flop_fraction=0.77),
            dict(method="wide dial (shift)", stage=2, target_sparsity=0.4, checkpoint="out/wide-s0.5-stage2",
                 val_ppl=46.5, linear_flop_fraction=0.78)]
    s = ev.plot_series(rows, [dict(method="teal", val_ppl=45.0, linear_flop_fraction=0.7)])
    assert [r["target_sparsity"] for r in s["WIDE stage 2 (trained)"]] == [0.5]
    assert [r["target_sparsity"] for r in s["dense + stage-2 LoRA (routers at 0)"]] == [0.0]
    assert [r["method"] for r in s["WIDE dial (stage 2 from 0.5)"]] == ["wide", "wide dial"]  # no "shift" row
    assert len(s["TEAL-style"]) == 1
    path = tmp_path / "quality_gpu.json"
    shutil.copy(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "quality_gpu.json"), path)
    ev.main(["--replot", str(path)])
    assert (tmp_path / "quality_gpu.png").stat().st_size > 10_000
    path.write_text(json.dumps(dict(rows=[])))
    with pytest.raises(SystemExit, match="--replot"):
        ev.main(["--replot", str(path)])
