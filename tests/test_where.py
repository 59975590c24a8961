"""research/where.py: TEAL in one place only, routers that decide in one place only, the place's FLOPs, the matched
TEAL solve, and the token buckets."""
import math

import pytest
import torch

import baselines
import wide
from research import where
from test_baselines import zeroed_shares
from tiny_models import random_model, tokens, wide_model


def batches(n=4, seed=5):
    return [tokens(8, 16, seed=seed + i) for i in range(n)]


def test_teal_with_a_rate_per_place_zeroes_only_that_place():
    model = random_model()
    cal = batches()
    baselines.calibrate_teal(model, lambda i, n: 0.5 if (i, n) == (1, "gate_proj") else 0.0, cal)
    for x in cal:
        model(x)
    for (i, name), share in zeroed_shares(model).items():
        if i == 1 and name in ("gate_proj", "up_proj"):  # gate and up share their input and threshold
            assert abs(share - 0.5) <= 0.02, f"layer 1 {name}: zeroed {share:.3f}"
        else:
            assert share == 0, f"layer {i} {name} zeroed {share:.3f} outside the place"


def masks_of(model, idx):
    masks = {}
    logits = model(idx, masks=masks)
    return logits, masks


def test_routed_only_forces_every_other_router_to_run_and_undoes_itself():
    model, _ = wide_model()
    idx = tokens(2, 12)
    logits, free = masks_of(model, idx)
    assert any((m == 0).any() for m in free["attn"] + free["ffn"]), "the test model must skip something"
    with where.routed_only(model, "ffn", [1]):
        _, only = masks_of(model, idx)
    assert all(torch.all(m == 1) for m in only["attn"]) and torch.all(only["ffn"][0] == 1)
    # layer 1's FFN router decides on what reaches it when every group before it ran
    router = model.layers[1].ffn_router
    seen = []
    h = router.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with where.routed_only(model, None, []):
        _, none = masks_of(model, idx)
    h.remove()
    assert all(torch.all(m == 1) for m in none["attn"] + none["ffn"])
    assert torch.equal(only["ffn"][1], router(seen[0]))
    assert (only["ffn"][1] == 0).any()
    again, back = masks_of(model, idx)  # the hooks are gone
    assert torch.equal(again, logits) and all(torch.equal(a, b) for a, b in zip(back["ffn"], free["ffn"]))


def test_place_flops_count_the_place_and_its_own_routers_only():
    model, wcfg = wide_model()
    cfg = model.config
    keep = [torch.tensor([0.5, 1.0]), torch.tensor([0.25, 0.25])]  # per token, layer 0 and layer 1
    got = where.wide_place_flops(cfg, wcfg, "attn", [0, 1], keep)
    # wide.flop_fraction counts every router; with the FFN's groups all running its routers would not run
    everywhere = wide.flop_fraction(cfg, wcfg, [0.75, 0.25], [1.0, 1.0])
    n_attn, n_ffn = wide.check_groups(cfg, wcfg)
    r = min(wcfg.rank, cfg.dim)
    ffn_routers = cfg.n_layers * r * (cfg.dim + 2 * n_ffn)
    assert got == pytest.approx(everywhere - ffn_routers / wide.dense_flops(cfg))
    f = wide.linear_flops(cfg)
    assert where.place_share(cfg, "ffn", [1]) == pytest.approx(f["ffn"] / wide.dense_flops(cfg))
    assert where.place_share(cfg, "attn", [0, 1]) == pytest.approx(2 * (f["q"] + f["kv"] + f["o"]) / wide.dense_flops(cfg))


def test_matched_teal_is_corrected_once_and_interpolated_at_the_goal(monkeypatch):
    # A fake TEAL whose realized FLOPs miss the nominal ones by +0.02 and whose log-ppl is linear in s:
    # the corrected second point brackets the goal, and interpolation is then exact.
    share, goal = 0.6, 0.7
    calls = []

    def fake(base_dir, kind, layers, s, calib, x, y, args):
        calls.append(s)
        return math.exp(2 * s), 1 - share * s + 0.02, torch.full((3,), float(s))
    monkeypatch.setattr(where, "teal_at", fake)
    ppl, points, nll = where.teal_matched("base", "ffn", [0], goal, share, None, None, None, None)
    assert calls[0] == pytest.approx((1 - goal) / share) and len(calls) == 2
    s_exact = (1 - goal + 0.02) / share
    assert ppl == pytest.approx(math.exp(2 * s_exact), rel=1e-3)
    assert min(f for f, _ in points) <= goal <= max(f for f, _ in points)
    assert torch.allclose(nll, torch.full((3,), calls[1]))  # the nearer measurement's NLLs


def test_token_kinds_and_buckets():
    assert [where.token_kind(t) for t in (" the", "ing", ",", "\n", " ", " ,")] == \
        ["word start", "word piece", "punctuation", "newline", "space", "punctuation"]
    dense = torch.tensor([1.0, 2.0, 3.0, 4.0])
    w, t = dense + torch.tensor([0.1, 0.2, 0.3, 0.4]), dense + 0.05
    width = torch.tensor([0.5, 0.6, 0.7, 0.8])
    rows = where.buckets(["a", "b", "a", "b"], ["a", "b", "c"], dense, w, t, width)
    assert [r["bucket"] for r in rows] == ["a", "b"]  # an empty bucket is left out
    assert rows[0]["share"] == 0.5 and rows[0]["wide_dnll"] == pytest.approx(0.2) and rows[0]["teal_dnll"] == pytest.approx(0.05)
    assert rows[1]["wide_flops"] == pytest.approx(0.7) and rows[1]["dense_nll"] == pytest.approx(3.0)
    by_index = where.buckets(torch.tensor([1, 1, 0, 0]), range(2), dense, w, t, width)
    assert by_index[0]["dense_nll"] == pytest.approx(3.5)


def test_an_untrained_target_is_one_line_before_any_scoring(tmp_path):
    import data
    from model import save_checkpoint
    tok = data.train_tokenizer(["To be, or not to be, that is the question."] * 4, 300)
    save_checkpoint(str(tmp_path / "base"), random_model(), tok)
    with pytest.raises(SystemExit, match="wide-s0.3-stage1 is not trained"):
        where.main(["--out-dir", str(tmp_path), "--target", "0.3", "--device", "cpu"])


def test_a_router_checkpoints_backbone_is_its_merged_model_without_routers(tmp_path):
    import checkpoints
    import data
    from tiny_models import with_lora
    tok = data.train_tokenizer(["To be, or not to be, that is the question."] * 4, 300)
    model, wcfg = wide_model()
    with_lora(model)
    wcfg.lora_rank, wcfg.lora_alpha = 4, 8.0
    checkpoints.save_wide(str(tmp_path / "wide-s0.5-stage2"), model, tok, wcfg)
    dense = where.backbone(str(tmp_path / "wide-s0.5-stage2"), "cpu")
    assert all(l.attn_router is None and l.ffn_router is None for l in dense.layers)
    loaded, _ = checkpoints.load_wide(str(tmp_path / "wide-s0.5-stage2"))
    idx = tokens(2, 10)
    with where.routed_only(loaded, None, []):  # every group run: the same function as the backbone
        expected = loaded(idx)
    assert torch.allclose(dense(idx), expected, atol=1e-5)
    with torch.no_grad():
        plain = model(idx)  # with LoRA unmerged and the routers deciding: not the backbone
    assert not torch.allclose(dense(idx), plain, atol=1e-3)
