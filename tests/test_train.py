"""
The specification of WIDE's training (train.py): what one step computes, the paper's settings of stage 1
and stage 2, and that stage 1 reaches its target. The models are the small ones of tiny_models.py.

The stage-1 test trains routers on a frozen "teacher" model: a random model whose own samples are the
data, so executing everything is optimal and skipping has a real cost.
"""
from dataclasses import asdict

import pytest
import torch

import checkpoints
import data
import train
import wide
from conftest import assert_close
from model import ModelConfig, Transformer, save_checkpoint
from tiny_models import V, loop_args, random_model, router_params, tokens, wide_config, wide_model


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread for tiny models


@pytest.fixture(scope="module")
def tokenizer():
    return data.train_tokenizer(["To be, or not to be, that is the question."] * 4, 300)


def routers_only(model):
    """Stage 1's trainable set: the routers; the backbone frozen."""
    model.requires_grad_(False)
    params = router_params(model)
    for p in params:
        p.requires_grad_(True)
    return params


# ----------------------------------------------------------------------------------------------------
# one training step


def test_each_step_descends_cross_entropy_plus_the_penalty_at_the_scheduled_temperature(monkeypatch):
    # Record what train_loop hands to the gradient clipping at each step (the routers' weights and
    # gradients), then compute the same step by hand: the step's batch and seed, tau from the schedule,
    # loss = CE + 20 * |s* - (r_attn + r_ffn) / 2|.
    steps, args = 3, loop_args(batch_size=4, block_size=16, seed=3, grad_clip=0.7)
    model, wcfg = wide_model(target=0.2)  # far from the ~0.5 rate at init, so the penalty has a slope
    params = routers_only(model)
    recorded = []

    def clip(ps, max_norm, *a, **k):
        ps = list(ps)
        recorded.append(dict(max_norm=max_norm, weights=[p.detach().clone() for p in ps],
                             grads=[p.grad.clone() for p in ps]))
        return torch.zeros(())

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    stream = tokens(1, 500, seed=2)[0]
    train.train_loop(model, params, stream, (tokens(2, 16), tokens(2, 16, seed=1)), args,
                     train.Schedule("test", steps, lr=1e-2, min_lr=0.0, warmup=1, weight_decay=0.01), wcfg=wcfg)
    assert len(recorded) == steps and all(r["max_norm"] == 0.7 for r in recorded)

    by_hand, _ = wide_model(target=0.2)
    mine = routers_only(by_hand)
    by_hand.train()
    gen = torch.Generator().manual_seed(args.seed)
    for step, r in enumerate(recorded):
        with torch.no_grad():
            for p, w in zip(mine, r["weights"]):
                p.copy_(w)
            for p in mine:
                p.grad = None
        torch.manual_seed(args.seed + 100_003 * step)
        x, y = data.get_batch(stream, args.batch_size, args.block_size, gen)
        wide.set_temperature(by_hand, [5.0, 2.75, 0.5][step])
        masks = {}
        _, ce = by_hand(x, y, masks=masks)
        rate = torch.stack([1 - m.mean() for m in masks["attn"] + masks["ffn"]]).mean()  # 2 layers each
        (ce + 20 * (0.2 - rate).abs()).backward()
        for p, g in zip(mine, r["grads"]):
            assert_close(g, p.grad, atol=1e-6, rtol=1e-5, what=f"router gradient at step {step}")


def test_training_routers_leaves_a_frozen_backbone_untouched():
    model, wcfg = wide_model()
    params = routers_only(model)
    backbone = {k: v.clone() for k, v in model.state_dict().items() if "router" not in k}
    routers = {k: v.clone() for k, v in model.state_dict().items() if "router" in k}
    val = (tokens(2, 16), tokens(2, 16, seed=1))
    train.train_loop(model, params, tokens(1, 500, seed=2)[0], val, loop_args(batch_size=4, block_size=16),
                     train.Schedule("test", 3, lr=1e-2, min_lr=0.0, warmup=1, weight_decay=0.01), wcfg=wcfg)
    after = model.state_dict()
    for k, v in backbone.items():
        assert torch.equal(after[k], v), f"frozen backbone tensor {k} changed"
    assert any(not torch.equal(after[k], v) for k, v in routers.items()), "the routers did not train"


# ----------------------------------------------------------------------------------------------------
# the paper's settings of each stage


def test_command_line_defaults_are_the_papers_settings():
    args, targets = train.parse_args(["--device", "cpu"])
    assert (args.stage1_lr, args.stage2_lr) == (2e-3, 3e-3)  # stage 2's is ours, not the paper's 2e-4 (README)
    assert (args.lora_rank, args.lora_alpha) == (16, 32.0)
    assert (args.rank, args.attn_group_size, args.ffn_group_size, args.grad_clip) == (32, 0, 32, 1.0)
    expected = wide.WideConfig(target=0.5)
    wide.check_groups(ModelConfig.from_name(args.preset), expected)  # one KV group of the preset's heads
    assert [asdict(w) for w in targets] == [asdict(expected)]


def test_a_recipe_moves_the_defaults_and_a_given_flag_still_wins():
    cpu, _ = train.parse_args(["--device", "cpu"])
    gpu, _ = train.parse_args(["--recipe", "gpu", "--device", "cpu", "--stage2-steps", "7"])
    assert vars(cpu) == vars(train.parse_args(["--recipe", "cpu", "--device", "cpu"])[0])  # cpu = the defaults
    assert (gpu.out_dir, gpu.batch_size, gpu.base_steps, gpu.stage1_steps) == ("out-gpu", 512, 500, 1600)
    assert gpu.stage2_steps == 7 and gpu.base_dir == "out-gpu/base"
    assert gpu.batch_size * gpu.stage1_steps >= 100 * cpu.batch_size * cpu.stage1_steps  # >= 100x the tokens
    if not torch.cuda.is_available():  # --recipe gpu asks for CUDA: one line, not a silent CPU run
        with pytest.raises(SystemExit, match="CUDA"):
            train.parse_args(["--recipe", "gpu"])


def test_the_gpu_recipe_sets_its_own_budget():
    # Every value --recipe gpu sets, none overridden by a flag (--device cpu aside, so that it parses here):
    # the test above overrides --stage2-steps, so it cannot see that value change.
    gpu, _ = train.parse_args(["--recipe", "gpu", "--device", "cpu"])
    assert (gpu.out_dir, gpu.batch_size, gpu.base_steps, gpu.stage1_steps, gpu.stage2_steps, gpu.ckpt_interval) == \
        ("out-gpu", 512, 500, 1600, 1600, 400)
    assert train.RECIPES["gpu"]["device"] == "cuda" and set(train.RECIPES["gpu"]) == {
        "out_dir", "device", "batch_size", "base_steps", "stage1_steps", "stage2_steps", "ckpt_interval"}


def test_the_smollm2_model_sets_its_own_budget_and_a_given_flag_still_wins():
    # --model smollm2: the pretrained base, its CPU budget in bf16, and layer-skip's stage 1 beside WIDE's
    m, targets = train.parse_args(["--model", "smollm2", "--device", "cpu"])
    assert (m.out_dir, m.base_dir, m.preset, m.batch_size, m.block_size, m.stage1_steps, m.stage2_steps) == \
        ("out-smollm2", "out-smollm2/base", "smollm2", 8, 256, 128, 128)
    assert (m.stage2_lr, m.eval_interval, m.val_windows, m.ckpt_interval, m.bf16, m.with_layerskip) == \
        (1e-3, 16, 8, 20, True, True)
    assert set(train.MODELS["smollm2"]) == {"out_dir", "preset", "batch_size", "block_size", "stage1_steps",
                                            "stage2_steps", "stage2_lr", "eval_interval", "val_windows",
                                            "ckpt_interval", "bf16", "with_layerskip"}
    # one KV group's 3 query heads per attention decision, FFN groups of 32: 3 and 48 groups per layer
    assert wide.check_groups(ModelConfig.from_name("smollm2"), targets[0]) == (3, 48)
    given, _ = train.parse_args(["--model", "smollm2", "--device", "cpu", "--stage1-steps", "5", "--no-bf16"])
    assert (given.stage1_steps, given.bf16, given.stage2_steps) == (5, False, 128)
    plain, _ = train.parse_args(["--device", "cpu"])
    assert (plain.model, plain.bf16, plain.with_layerskip) == (None, None, False)


def test_stages_train_with_the_papers_optimizer_settings_and_stage_2_adds_lora(tokenizer, tmp_path, monkeypatch):
    args, _ = train.parse_args(["--device", "cpu", "--out-dir", str(tmp_path), "--stage1-steps", "20",
                                "--stage2-steps", "30", "--lora-rank", "4", "--lora-alpha", "8",
                                "--block-size", "32"])
    save_checkpoint(args.base_dir, random_model(), tokenizer)
    calls = []

    def recording(model, params, data, val, args, sched, **settings):
        calls.append(dict(settings, sched=sched, model=model, params=params))
        return dict(steps=sched.steps, seconds=0.0, history=[])

    monkeypatch.setattr(train, "train_loop", recording)
    wcfg = wide_config()
    stream, val = tokens(1, 4000).reshape(-1), (tokens(4, 32, seed=1), tokens(4, 32, seed=2))
    train.train_stage(args, wcfg, 1, tokenizer, stream, val)
    train.train_stage(args, wcfg, 2, tokenizer, stream, val)
    one, two = calls
    # Both stages: the paper's AdamW (torch's defaults: betas 0.9/0.999, decay on every parameter) with
    # weight decay 0.01, 10% warm-up, cosine to 0, the stage's own schedule.
    for call, steps, lr, name in ((one, 20, 2e-3, "wide s1"), (two, 30, 3e-3, "wide s2")):
        assert asdict(call["sched"]) == dict(name=name, steps=steps, lr=lr, min_lr=0.0, warmup=steps // 10,
                                             weight_decay=0.01, betas=(0.9, 0.999), decay_1d=True)
        assert call["wcfg"] is wcfg  # the penalty and the temperature schedule are on
    # Stage 1 trains the routers alone.
    names = {id(p): n for n, p in one["model"].named_parameters()}
    assert {names[id(p)].split(".")[2] for p in one["params"]} == {"attn_router", "ffn_router"}
    assert len(one["params"]) == len(router_params(one["model"]))
    # Stage 2 adds LoRA (rank 4, alpha 8 here) with dropout 0.1 on all seven projections to the routers.
    m = two["model"]
    loras = [mod for mod in m.modules() if isinstance(mod, wide.LoRALinear)]
    assert len(loras) == 7 * 2
    assert all(l.lora_A.shape[0] == 4 and l.scale == 2.0 and l.dropout.p == 0.1 for l in loras)
    trainable = {id(p) for p in two["params"]}
    assert trainable == {id(p) for n, p in m.named_parameters() if "router" in n or "lora_" in n}
    assert all(p.requires_grad == (id(p) in trainable) for p in m.parameters())
    assert (wcfg.stage, wcfg.lora_rank, wcfg.lora_alpha) == (2, 4, 8.0)


# ----------------------------------------------------------------------------------------------------
# stage 1 reaches its target, and each stage restarts the temperature


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

    stream = sample(128, 33, seed=1).reshape(-1)  # one stream; data.get_batch cuts windows from it
    val = sample(32, 33, seed=2)
    return model, stream, (val[:, :-1].contiguous(), val[:, 1:].contiguous())


@pytest.mark.parametrize("target", [0.25, 0.75])
def test_stage_1_moves_deterministic_sparsity_to_within_0_1_of_the_target(teacher, target):
    base, stream, (vx, vy) = teacher
    model = Transformer(base.config)
    model.load_state_dict(base.state_dict())
    wcfg = wide_config(target=target)
    torch.manual_seed(0)
    wide.install_routers(model, wcfg)
    params = routers_only(model)

    def realized_rate():
        model.eval()
        masks = {}
        with torch.no_grad():
            model(vx, masks=masks)
        rates = wide.skip_rates(masks)
        return ((rates["attn"] + rates["ffn"]) / 2).item()

    start = realized_rate()
    assert abs(start - target) > 0.15, f"routers start at {start:.2f}, too close to {target} to show anything"

    # Stage 1 as train.py runs it (AdamW, 10% warm-up then cosine, clip 1, wd 0.01, tau 5 -> 0.5), with
    # a learning rate 10x the paper's 2e-3 so that 200 steps are enough.
    steps = 200
    train.train_loop(model, params, stream, (vx, vy), loop_args(), train.Schedule(
        "stage 1", steps, lr=2e-2, min_lr=0.0, warmup=steps // 10, weight_decay=0.01), wcfg=wcfg)
    end = realized_rate()
    assert abs(end - target) < 0.1, (
        f"deterministic sparsity {end:.3f} after stage 1 (it started at {start:.3f}), target {target}")


def test_each_stage_restarts_the_temperature_at_5(teacher, tokenizer, tmp_path, monkeypatch):
    base, stream, val = teacher
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
    train.train_stage(args, wcfg, 1, tokenizer, stream, val)
    stage1, taus[:] = taus[:], []
    train.train_stage(args, wcfg, 2, tokenizer, stream, val)
    assert stage1 == pytest.approx([5.0, 3.5, 2.0, 0.5])
    assert taus == pytest.approx([5.0, 2.75, 0.5])
    _, saved = checkpoints.load_wide(checkpoints.run_dir(args.out_dir, wcfg, 2))
    assert (saved.stage, saved.lora_rank) == (2, 4)


def test_distillation_is_off_by_default_and_stage_2_only(tokenizer, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(train, "train_loop", lambda model, params, data, val, args, sched, **kw: calls.append(
        dict(kw, args=args)) or dict(steps=sched.steps, seconds=0.0, history=[]))
    stream, val = tokens(1, 4000).reshape(-1), (tokens(4, 32, seed=1), tokens(4, 32, seed=2))
    for extra in ([], ["--distill", "0.5"]):
        args, _ = train.parse_args(["--device", "cpu", "--out-dir", str(tmp_path), "--block-size", "32", *extra])
        save_checkpoint(args.base_dir, random_model(), tokenizer)
        wcfg = wide_config()
        train.train_stage(args, wcfg, 1, tokenizer, stream, val)
        train.train_stage(args, wcfg, 2, tokenizer, stream, val)
    (d1, d2), (x1, x2) = calls[:2], calls[2:]
    assert d1["teacher"] is None and d2["teacher"] is None and args.distill == 0.5
    assert x1["teacher"] is None, "stage 1 never distills"
    assert isinstance(x2["teacher"], Transformer) and x2["args"].distill == 0.5
    assert not any(p.requires_grad for p in x2["teacher"].parameters())
