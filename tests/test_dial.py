"""
The specification of the sparsity dial (dial.py): per-(layer, router type) offsets on the
skip-minus-execute gap, calibrated on training windows so that deterministic routing realizes a
requested sparsity, folded into the routers' skip biases at load time; the dialled checkpoints and their
cache (checkpoints.py); and generate.py's dial flags.
The models are the small ones of tiny_models.py (2 layers, 2 head groups and 4 channel groups per layer).
"""
import copy
import json
import os
import types

import pytest
import torch

import checkpoints
import data
import dial
import wide
from conftest import assert_one_line_error, run_main, stopped
from model import CheckpointError, Transformer, save_checkpoint
from tiny_models import random_model, tokens, wide_config, wide_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n\n"
WINDOWS = tokens(16, 32, seed=1)  # 512 tokens: each router's rate moves in steps of 1/512


def realized(model, idx, offsets=None):
    """{kind: mean skip rate} of deterministic routing on idx, with the offsets folded into a copy."""
    m = copy.deepcopy(model)
    if offsets:
        dial.fold_offsets(m, offsets)
    masks = {}
    with torch.no_grad():
        m.eval()(idx, masks=masks)
    return {k: v.item() for k, v in wide.skip_rates(masks).items()}


def uniform(model, o):
    return {k: [o] * len(model.layers) for k in ("attn", "ffn")}


# ----------------------------------------------------------------------------------------------------
# the rule: skip iff z_skip - z_exec + offset > 0, a tie executes


def test_a_larger_offset_never_skips_fewer_groups():
    model, _ = wide_model()
    rates = [realized(model, WINDOWS, uniform(model, o)) for o in torch.linspace(-16, 16, 33).tolist()]
    for kind in ("attn", "ffn"):
        seq = [r[kind] for r in rates]
        assert all(a <= b for a, b in zip(seq, seq[1:])), f"{kind} skip rate not monotone in the offset: {seq}"
        assert seq[0] < 0.05 and seq[-1] > 0.95, f"{kind}: the sweep should span almost nothing to almost all: {seq}"


def test_folded_offset_is_the_gap_rule_and_a_tie_still_executes():
    r = wide.Router(dim=4, n_groups=1, rank=2).eval()
    with torch.no_grad():
        r.up.weight.zero_()
        r.up.bias.copy_(torch.tensor([0.5, 0.25]))  # z_exec = 0.5, z_skip = 0.25: the gap is -0.25
    x = torch.randn(3, 4)
    wrapped = type("M", (), {})()  # fold_offsets walks model.layers
    for offset, keep in ((0.25, 1.0), (0.2500001, 0.0), (0.0, 1.0)):
        rr = copy.deepcopy(r)
        wrapped.layers = [type("L", (), dict(attn_router=rr, ffn_router=None, layer_router=None))()]
        dial.fold_offsets(wrapped, {"attn": [offset]})
        assert (rr(x) == keep).all(), f"offset {offset}: expected keep {keep} (a tie executes)"


def test_hooked_offsets_and_folded_biases_route_identically():
    # calibrate() applies offsets through forward hooks; inference folds them into the biases.
    model, _ = wide_model()
    offsets, _ = dial.calibrate(model, WINDOWS, 0.4)
    idx = tokens(4, 32, seed=9)
    hooked = {}
    with dial.dialled(model, offsets), torch.no_grad():
        model(idx, masks=hooked)
    folded = copy.deepcopy(model)
    dial.fold_offsets(folded, offsets)
    masks = {}
    with torch.no_grad():
        folded(idx, masks=masks)
    for kind in ("attn", "ffn"):
        for a, b in zip(hooked[kind], masks[kind]):
            assert torch.equal(a, b), f"{kind}: hooked and folded offsets disagree"


# ----------------------------------------------------------------------------------------------------
# calibration


@pytest.mark.parametrize("target", [0.1, 0.3, 0.5, 0.8])
def test_calibration_hits_the_target_on_its_windows(target):
    model, _ = wide_model()
    offsets, per_layer = dial.calibrate(model, WINDOWS, target)
    got = realized(model, WINDOWS, offsets)
    assert abs((got["attn"] + got["ffn"]) / 2 - target) < 0.01, (got, target)
    assert got["attn"] == pytest.approx(sum(per_layer["attn"]) / 2), "calibrate reports what the folded dial realizes"


def test_one_pass_gives_the_offsets_of_a_pass_per_router():
    # The twin of solve_in_order: a full pass per router, in forward order, each solving its offset from its
    # gaps with the earlier routers' offsets applied. A one-pass solve that did not apply them would differ.
    model, _ = wide_model()
    want = {(k, i): 0.2 + 0.05 * i + (0.1 if k == "ffn" else 0.0) for k, i, _ in dial.router_list(model)}
    offsets = {k: [0.0] * len(model.layers) for k in ("attn", "ffn")}
    dial.solve_in_order(model, WINDOWS, want, offsets)
    twin = {k: [0.0] * len(model.layers) for k in ("attn", "ffn")}
    for kind, i, _ in dial.router_list(model):
        twin[kind][i] = dial.solve_offset(dial.collect_gaps(model, WINDOWS, twin)[(kind, i)], want[(kind, i)])
    for kind in twin:
        assert offsets[kind] == pytest.approx(twin[kind], abs=1e-5), kind


def test_calibration_hits_separate_targets_and_a_layer_skip_target():
    model, _ = wide_model()
    offsets, _ = dial.calibrate(model, WINDOWS, attn_target=0.7, ffn_target=0.2)
    got = realized(model, WINDOWS, offsets)
    assert got["attn"] == pytest.approx(0.7, abs=0.01) and got["ffn"] == pytest.approx(0.2, abs=0.01), got
    ls, _ = wide_model(method="layerskip")
    offsets, _ = dial.calibrate(ls, WINDOWS, 0.4)
    assert realized(ls, WINDOWS, offsets)["layer"] == pytest.approx(0.4, abs=0.01)


def test_calibration_generalizes_to_other_windows_of_the_same_text():
    model, _ = wide_model()
    offsets, _ = dial.calibrate(model, tokens(64, 32, seed=3), 0.5)
    got = realized(model, tokens(64, 32, seed=4), offsets)
    assert abs((got["attn"] + got["ffn"]) / 2 - 0.5) < 0.03, got


def test_calibration_is_deterministic():
    model, _ = wide_model()
    a, _ = dial.calibrate(model, WINDOWS, 0.35)
    b, _ = dial.calibrate(copy.deepcopy(model), WINDOWS.clone(), 0.35)
    assert a == b, "two calibrations of the same routers on the same windows must give the same offsets"


def test_realized_sparsity_rises_with_the_requested_target():
    model, _ = wide_model()
    seq = []
    for t in (0.0, 0.2, 0.4, 0.6, 0.8, 0.95):
        got = realized(model, WINDOWS, dial.calibrate(model, WINDOWS, t)[0])
        seq.append((got["attn"] + got["ffn"]) / 2)
    assert all(a <= b for a, b in zip(seq, seq[1:])), seq
    assert seq[0] < 0.01, "target 0 skips nothing"


def test_keep_power_raises_every_kept_share_to_one_power():
    rates = [0.1, 0.4, 0.8]
    for target in (0.2, 0.5, 0.7):
        a = dial.solve_power(rates, target)
        moved = [1 - (1 - r) ** a for r in rates]
        assert sum(moved) / 3 == pytest.approx(target, abs=1e-9)
        assert moved == sorted(moved), "the routers keep their order"
    up = [1 - (1 - r) ** dial.solve_power(rates, 0.7) for r in rates]
    # dialled up, the router that skipped most moves furthest in kept share (a power, not a logit shift)
    assert (1 - rates[2]) / (1 - up[2]) > (1 - rates[0]) / (1 - up[0])


@pytest.mark.parametrize("target", [0.2, 0.7])
def test_the_keep_power_rule_hits_the_target_and_is_not_the_shift_rule(target):
    model, _ = wide_model()
    offsets, per_layer = dial.calibrate(model, WINDOWS, target, rule="keep_power")
    got = realized(model, WINDOWS, offsets)
    assert abs((got["attn"] + got["ffn"]) / 2 - target) < 0.01, (got, target)
    shifted, _ = dial.calibrate(model, WINDOWS, target)
    assert offsets != shifted
    with pytest.raises(ValueError, match="keep_power"):
        dial.calibrate(model, WINDOWS, target, rule="nope")


def test_calibration_leaves_the_model_untouched():
    model, _ = wide_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dial.calibrate(model, WINDOWS, 0.6)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(not r._forward_hooks for _, _, r in dial.router_list(model)), "a hook was left behind"


# ----------------------------------------------------------------------------------------------------
# checkpoints: offsets in wide.json, folded at load; the nearest checkpoint; the cache


@pytest.fixture(scope="module")
def tokenizer():
    return data.train_tokenizer([TEXT * 4], 300)


def save_router_checkpoint(path, tokenizer, offsets_for=None, seed=0, **wcfg):
    model, w = random_model(seed, vocab_size=tokenizer.get_vocab_size()), wide_config(**wcfg)
    torch.manual_seed(100 + seed)
    wide.install_routers(model, w)
    if offsets_for is not None:
        w.offsets, _ = dial.calibrate(model, WINDOWS, offsets_for)
    checkpoints.save_wide(str(path), model, tokenizer, w)
    return model, w


def test_offsets_travel_in_wide_json_and_load_wide_folds_them(tmp_path, tokenizer):
    model, w = save_router_checkpoint(tmp_path / "c", tokenizer, offsets_for=0.3, target=0.3)
    loaded, w2 = checkpoints.load_wide(str(tmp_path / "c"))
    assert w2.offsets == w.offsets
    assert realized(loaded, WINDOWS) == realized(model, WINDOWS, w.offsets)
    raw, _ = checkpoints.load_wide(str(tmp_path / "c"), offsets=False)  # stage 2 starts from the raw routers
    assert realized(raw, WINDOWS) == realized(model, WINDOWS)


def test_nearest_checkpoint_prefers_the_nearest_target_then_stage_2(tmp_path, tokenizer):
    for name in ("wide-s0.25-stage1", "wide-s0.5-stage1", "wide-s0.5-stage2", "wide-a0.8-f0.6-stage1",
                 "wide-a0.75-f0.25-stage2"):  # (mean 0.5: a shared target of 0.5 comes first)
        save_router_checkpoint(tmp_path / name, tokenizer)
    near = lambda t: os.path.basename(checkpoints.nearest_checkpoint(str(tmp_path), "wide", t))
    assert near(0.3) == "wide-s0.25-stage1"
    assert near(0.45) == "wide-s0.5-stage2"
    assert near(0.75) == "wide-a0.8-f0.6-stage1"  # separate targets count by their mean, 0.7
    with pytest.raises(CheckpointError, match="python train.py --method layerskip --sparsity 0.3"):
        checkpoints.nearest_checkpoint(str(tmp_path), "layerskip", 0.3)


def test_load_dialled_calibrates_once_on_the_callers_windows_and_caches_atomically(tmp_path, tokenizer):
    path = str(tmp_path / "wide-s0.5-stage2")
    model, _ = save_router_checkpoint(path, tokenizer, offsets_for=0.5)
    windows = data.calibration_windows(data.encode_plays(tokenizer, [TEXT * 40]), 32, dial.CALIB_WINDOWS,
                                       dial.CALIB_SEED)
    asked = []  # the caller's window maker is asked only when the cache cannot answer

    def make(tok, block_size, n, seed):
        asked.append((tok.to_str() == tokenizer.to_str(), block_size, n, seed))
        return windows

    load = lambda target: checkpoints.load_dialled(path, target=target, windows=make, block_size=32, rule="shift")
    m1, _, d1 = load(0.3)
    assert asked == [(True, 32, dial.CALIB_WINDOWS, dial.CALIB_SEED)], "the checkpoint's own tokenizer, once"
    assert "calibrated on" in d1["source"] and os.path.isfile(os.path.join(path, "dial.json"))
    assert not os.path.exists(os.path.join(path, "dial.json.tmp"))
    m2, _, d2 = load(0.3)
    assert "cached in" in d2["source"] and d2["offsets"] == d1["offsets"] and len(asked) == 1
    got = realized(m1, windows)
    assert abs((got["attn"] + got["ffn"]) / 2 - 0.3) < 0.01, got
    _, _, own = load(0.5)  # its own target: training's dial
    assert own["source"].startswith("calibrated in training") and len(asked) == 1
    with open(os.path.join(path, "dial.json"), "w") as f:
        f.write("{damaged")
    _, _, again = load(0.3)
    assert again["offsets"] == d1["offsets"], "a damaged cache is recomputed, to the same offsets"
    assert json.load(open(os.path.join(path, "dial.json"))) and len(asked) == 2
    # another rule is another cache entry: calibrated once, not answered by the shift rule's offsets; keep_power
    # is the default
    _, _, kp = checkpoints.load_dialled(path, target=0.3, windows=make, block_size=32)
    assert "calibrated on" in kp["source"] and kp["offsets"] != d1["offsets"] and len(asked) == 3
    _, _, kp2 = checkpoints.load_dialled(path, target=0.3, windows=make, block_size=32, rule="keep_power")
    assert kp2["offsets"] == kp["offsets"] and len(asked) == 3


def test_dial_windows_are_training_windows_in_the_checkpoints_tokenizer(tokenizer, monkeypatch):
    monkeypatch.setattr(data, "split_plays", lambda: ([TEXT * 40], [TEXT]))  # small "training plays"
    got = data.dial_windows(tokenizer, 32, 8, 5)
    stream = data.encode_plays(tokenizer, [TEXT * 40])
    assert torch.equal(got, data.calibration_windows(stream, 32, 8, 5)) and got.shape == (8, 32)


# ----------------------------------------------------------------------------------------------------
# generate.py: the dial from the command line


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("out")
    torch.manual_seed(0)
    model = random_model(vocab_size=tokenizer.get_vocab_size(), max_seq_len=160)
    save_checkpoint(str(out / "base"), model, tokenizer)
    wcfg = wide.WideConfig(ffn_group_size=16, rank=8)
    wide.install_routers(model, wcfg)
    checkpoints.save_wide(str(out / "wide-s0.5-stage1"), model, tokenizer, wcfg)
    return str(out)


def test_generate_dials_any_sparsity_and_names_the_checkpoint_and_offsets(out_dir, capsys, monkeypatch):
    import generate
    monkeypatch.setattr(data, "split_plays", lambda: ([TEXT * 40], [TEXT]))  # calibrate on less text
    r = run_main(capsys, generate.main, "--out-dir", out_dir, "--sparsity", "0.3", "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert f"checkpoint: {out_dir}/wide-s0.5-stage1 (wide, target 0.5, stage 1)" in r.stdout
    assert "dial: sparsity 0.3; offsets attn [" in r.stdout and "ffn [" in r.stdout, r.stdout
    assert "(target 0.3)" in r.stdout


def test_generate_dials_attention_and_ffn_separately(out_dir, capsys, monkeypatch):
    import generate
    monkeypatch.setattr(data, "split_plays", lambda: ([TEXT * 40], [TEXT]))  # calibrate on less text
    generate.main(["--out-dir", out_dir, "--attn-sparsity", "0.6", "--ffn-sparsity", "0.1", "--max-new-tokens", "4",
                   "--backend", "torch"])
    out = capsys.readouterr().out
    assert "dial: attn 0.6 ffn 0.1; offsets attn [" in out, out


def test_generate_dial_errors_are_one_line(out_dir, tmp_path, capsys):
    from generate import main
    assert_one_line_error(stopped(capsys, main, "--out-dir", str(tmp_path), "--sparsity", "0.3"),
                          "no wide router checkpoint", "python train.py")
    assert_one_line_error(stopped(capsys, main, "--checkpoint", f"{out_dir}/base", "--sparsity", "0.3"),
                          "needs a router checkpoint", "dense model")
    assert_one_line_error(stopped(capsys, main, "--checkpoint", str(tmp_path / "nope"), "--sparsity", "0.3"),
                          "does not exist")
    assert_one_line_error(stopped(capsys, main, "--out-dir", out_dir, "--attn-sparsity", "0.3"), "--ffn-sparsity")
    assert_one_line_error(stopped(capsys, main, "--out-dir", out_dir, "--ffn-sparsity", "1.2",
                                  "--attn-sparsity", "0.1"), "outside [0, 1)")
    broken = tmp_path / "wide-s0.5-stage1"
    save_checkpoint(str(broken), Transformer.from_pretrained(f"{out_dir}/base"), data.train_tokenizer([TEXT], 300))
    (broken / "wide.json").write_text("{not json")
    assert_one_line_error(stopped(capsys, main, "--out-dir", str(tmp_path), "--sparsity", "0.3"), "corrupt")


# ----------------------------------------------------------------------------------------------------
# calibrate's split of a target over the routers (one common shift per target, so each router keeps its
# own share, not the target itself), and the tie rule inside the calibration hook (dial.dialled: a gap
# exactly at the offset executes, as the folded bias does)

@pytest.mark.parametrize("targets", [dict(target=0.4), dict(attn_target=0.6, ffn_target=0.2)],
                         ids=["shared target", "separate targets"])
def test_calibration_gives_each_router_its_own_sampled_rate_under_one_shift_per_target(targets):
    model, _ = wide_model()
    with torch.no_grad():  # FFN routers that lean to skipping: a shared target must not split evenly
        for layer in model.layers:
            layer.ffn_router.up.bias[1::2] += 1.5
    offsets, realized = dial.calibrate(model, WINDOWS, **targets)
    gaps = dial.collect_gaps(model, WINDOWS, None)  # {(kind, layer): skip-minus-execute gaps}, no dial
    if "target" in targets:
        members = {("attn", "ffn"): targets["target"]}
    else:
        members = {("attn",): targets["attn_target"], ("ffn",): targets["ffn_target"]}
    for kinds, t in members.items():
        mine = {key: g for key, g in gaps.items() if key[0] in kinds}
        c = dial.solve_shift(list(mine.values()), t)  # one shift for every router of this target
        share = {key: torch.sigmoid(g + c).mean().item() for key, g in mine.items()}
        assert sum(share.values()) / len(share) == pytest.approx(t, abs=1e-6)
        assert max(share.values()) - min(share.values()) > 0.03, "the routers' shares should differ"
        for (kind, i), want in share.items():
            # As near as equal gaps allow (a token that recurs has one gap): well within 0.01 here.
            assert realized[kind][i] == pytest.approx(want, abs=0.01), f"{kind} router of layer {i}"


def test_inside_the_calibration_hook_a_gap_exactly_at_the_offset_executes():
    router = wide.Router(dim=4, n_groups=2, rank=2).eval()
    with torch.no_grad():
        router.up.weight.zero_()
        router.up.bias.copy_(torch.tensor([0.5, 0.25, 0.5, 0.75]))  # gaps z_skip - z_exec: -0.25, +0.25
    model = types.SimpleNamespace(layers=[types.SimpleNamespace(attn_router=router, ffn_router=None, layer_router=None)])
    x = torch.randn(3, 5, 4)
    for offset, keep in ((0.25, [1.0, 0.0]), (-0.25, [1.0, 1.0]), (0.2500001, [0.0, 0.0])):
        with dial.dialled(model, {"attn": [offset]}), torch.no_grad():
            out = router(x)
        assert torch.equal(out, torch.tensor(keep).expand(3, 5, 2)), f"offset {offset}: a tie executes"


def test_eval_scores_the_calibration_only_comparison(tmp_path, tokenizer, monkeypatch, capsys):
    # eval.py as --model smollm2 runs it, on tiny models: layer-skip's stage-1 routers dialled to bracket WIDE's
    # FLOPs, matched-FLOP rows for stage 1 as well as stage 2, bf16 autocast, no serving or fp8 rows.
    import json
    import eval as evaluate
    out = tmp_path / "out"
    save_checkpoint(str(out / "base"), random_model(vocab_size=tokenizer.get_vocab_size()), tokenizer)
    for name, seed, w in (("wide-s0.5-stage1", 0, {}), ("wide-s0.5-stage2", 1, dict(stage=2)),
                          ("layerskip-s0.5-stage1", 2, dict(method="layerskip"))):
        save_router_checkpoint(out / name, tokenizer, offsets_for=0.5, seed=seed, **w)
    monkeypatch.setattr(data, "split_plays", lambda: ([TEXT * 40], [TEXT * 4]))
    r = run_main(capsys, evaluate.main, "--out-dir", str(out), "--results", str(tmp_path / "res"), "--name", "q",
                 "--block-size", "16", "--batch-size", "8", "--max-windows", "6", "--calib-batches", "1",
                 "--dial", "0.3", "--dial-rules", "keep_power", "--layerskip-dial", "0.4", "--matched-stages", "1",
                 "2", "--no-serving", "--no-fp8", "--shared-batch", "--no-plot", "--bf16", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    rec = json.loads((tmp_path / "res" / "q.json").read_text())
    assert rec["precision"] == "bf16 autocast" and rec["held_out_tokens"] == 6 * 16 and rec["fp8"] == []
    assert not (tmp_path / "res" / "q_serving.json").exists()
    ls = [(r["stage"], r["target_sparsity"], r.get("trained_target")) for r in rec["rows"] if r["method"] == "layerskip"]
    assert sorted(ls, key=str) == sorted([(1, 0.5, None), (1, 0.4, 0.5)], key=str)
    dialled = [r for r in rec["rows"] if r["method"] == "wide dial"]
    assert [(r["target_sparsity"], r["dial_rule"]) for r in dialled] == [(0.3, "keep_power")]
    matched = {(m["wide_method"], m["wide_stage"]) for m in rec["matched_flops"]}
    assert matched == {("wide", 1), ("wide", 2), ("wide dial", 2)}


def test_eval_fp8_only_scores_dense_and_wide_in_both_fp8_schemes(tmp_path, tokenizer, monkeypatch, capsys):
    # --fp8-only: results/NAME_fp8.* alone, dense and WIDE stage 2 each in its dtype, with fp8 weights, and with
    # fp8 weights and per-token fp8 activations (engine.fp8_model), the quality table untouched.
    import json
    import eval as evaluate
    import kernels
    from engine import fp8_model
    out = tmp_path / "out"
    save_checkpoint(str(out / "base"), random_model(vocab_size=tokenizer.get_vocab_size()), tokenizer)
    save_router_checkpoint(out / "wide-s0.5-stage2", tokenizer, offsets_for=0.5, seed=1, stage=2)
    monkeypatch.setattr(data, "split_plays", lambda: ([TEXT * 40], [TEXT * 4]))
    r = run_main(capsys, evaluate.main, "--out-dir", str(out), "--results", str(tmp_path / "res"), "--name", "q",
                 "--block-size", "16", "--batch-size", "8", "--max-windows", "6", "--fp8-only", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "res").iterdir()) == ["q_fp8.json", "q_fp8.md"]
    rows = json.loads((tmp_path / "res" / "q_fp8.json").read_text())["fp8"]
    assert [(row["method"], row["rounding"]) for row in rows] == [
        ("dense", "nearest"), ("dense", "gptq"), ("wide", "nearest"), ("wide", "gptq")]
    for row in rows:
        assert row["val_ppl"] != row["fp8_val_ppl"] != row["w8a8_val_ppl"], "three different models"
        for scheme in ("fp8", "w8a8"):
            assert row[f"{scheme}_vs_model"] == round(row[f"{scheme}_val_ppl"] / row["val_ppl"], 4)
    for nearest, gptq in (rows[:2], rows[2:]):  # the same model, other codes
        assert nearest["val_ppl"] == gptq["val_ppl"] and nearest["fp8_val_ppl"] != gptq["fp8_val_ppl"]
    args = evaluate.parse_args(["--out-dir", str(out), "--block-size", "16", "--max-windows", "6", "--device", "cpu"])
    x, y, calib = evaluate.texts(args)
    both, _ = evaluate.score(fp8_model(evaluate.base_model(args), activations=True), x, y, args)
    assert rows[0]["w8a8_val_ppl"] == round(both, 3), "the dense row's weights-and-activations scheme"
    gptq, _ = evaluate.score(fp8_model(kernels.calibrate_fp8(evaluate.base_model(args), calib)), x, y, args)
    assert rows[1]["fp8_val_ppl"] == round(gptq, 3), "the dense row's GPTQ codes, weights only"
    md = (tmp_path / "res" / "q_fp8.md").read_text()
    assert md.startswith("# Held-out perplexity") and "| fp8 weights and activations |" in md and "| gptq |" in md
