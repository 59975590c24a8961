"""The scripts as a user meets them: data, tokenizer, generation, and one-line errors for bad input."""
import importlib
import os

import pytest
import torch

import checkpoints
import cli
import data
import generate as gen
from conftest import assert_one_line_error, run_main, run_script, stopped
import train
import wide
from generate import generate
from model import ModelConfig, Transformer, load_tokenizer, save_checkpoint

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n\n" * 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny trained-nothing checkpoint with a real BPE tokenizer, as train.py would write it."""
    path = str(tmp_path_factory.mktemp("ckpt") / "base")
    tok = data.train_tokenizer([TEXT], 300)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      intermediate_size=64, max_seq_len=48)
    save_checkpoint(path, Transformer(cfg), tok)
    return path


# ----------------------------------------------------------------------------------------------------
# data and tokenizer


def test_held_out_plays_are_whole_and_never_trained_on():
    plays = data.read_plays()
    tr, va = data.split_plays()
    assert len(va) == len(data.HELD_OUT) and len(tr) + len(va) == len(plays)
    for name in data.HELD_OUT:
        assert plays[name] in va and plays[name] not in tr


def test_plays_are_cleaned_to_speaker_lines():
    text = data.clean_play("# Title\n\n## ACT I\n\n**ROMEO**  \nSoft,  \nwhat _light_.\n")
    assert text == "Title\n\nACT I\n\nROMEO:\nSoft,\nwhat light.\n"


def test_tokenizer_round_trips_any_text_and_trains_deterministically():
    tok = data.train_tokenizer([TEXT], 300)
    for s in [TEXT, "Ünïcödé — and emoji 🎭, tabs\tand\nnewlines", ""]:
        assert tok.decode(tok.encode(s).ids) == s
    assert tok.to_str() == data.train_tokenizer([TEXT], 300).to_str()


def test_validation_windows_cover_the_held_out_stream_without_overlap():
    stream = torch.arange(1000)
    x, y = data.val_windows(stream, 64)
    assert x.shape == (15, 64) and torch.equal(x[1, 0], torch.tensor(64)) and torch.equal(y, x + 1)


def test_learning_rate_warms_up_then_decays_to_min():
    lrs = [train.lr_at(s, 100, 1.0, 10, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(0.1, abs=1e-3)


# ----------------------------------------------------------------------------------------------------
# generation


def golden_model():
    torch.manual_seed(1234)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                      max_seq_len=64)
    model = Transformer(cfg)
    with torch.no_grad():  # large weights: clear argmax margins, so float noise cannot flip a token
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model.eval()


def test_greedy_generation_matches_golden_tokens(tmp_path):
    save_checkpoint(str(tmp_path / "g"), golden_model())
    model = Transformer.from_pretrained(str(tmp_path / "g")).eval()
    out = generate(model, torch.tensor([[1, 2, 3]]), 20, temperature=0.0)
    assert out.tolist() == [[1, 2, 3, 23, 20, 23, 23, 56, 56, 56, 23, 23, 28, 34, 51, 23, 58, 39, 60, 12, 60, 23, 56]]


def test_batched_generation_equals_one_sequence_at_a_time():
    model = golden_model()
    prompts = torch.tensor([[1, 2, 3], [7, 8, 9], [4, 4, 4]])
    together = generate(model, prompts, 12)
    for b in range(3):
        assert torch.equal(together[b:b + 1], generate(model, prompts[b:b + 1], 12))


def test_sampling_with_a_seed_is_reproducible():
    model = golden_model()
    runs = [generate(model, torch.tensor([[1, 2]]), 10, temperature=1.0, top_k=5,
                     generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


def test_generate_cli_prints_text_and_speed(checkpoint):
    r = run_script("generate.py", "--checkpoint", checkpoint, "--prompt", "ROMEO:", "--max-new-tokens", "5")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("checkpoint:") and "ROMEO:" in r.stdout and "tokens/s" in r.stdout


def test_empty_prompt_starts_a_new_passage(checkpoint, capsys):
    r = run_main(capsys, gen.main, "--checkpoint", checkpoint, "--prompt", "", "--max-new-tokens", "3")
    assert r.returncode == 0, r.stderr


# ----------------------------------------------------------------------------------------------------
# bad input: one clear line on stderr, a non-zero exit, no traceback (in this process, as cli.run runs a
# script's main; the subprocess tests keep the `__main__` of each script and a GPU hidden from it)


def test_missing_checkpoint_is_one_line_error(tmp_path, capsys):
    assert_one_line_error(stopped(capsys, gen.main, "--checkpoint", str(tmp_path / "nope")), "does not exist")


def test_corrupt_safetensors_is_one_line_error(checkpoint, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (bad / f).write_bytes(open(os.path.join(checkpoint, f), "rb").read())
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert_one_line_error(stopped(capsys, gen.main, "--checkpoint", str(bad)), "model.safetensors")


def test_prompt_longer_than_context_is_one_line_error(checkpoint, capsys):
    r = stopped(capsys, gen.main, "--checkpoint", checkpoint, "--prompt", "window " * 100)
    assert_one_line_error(r, "longer than the model's context")


def test_prompt_plus_new_tokens_beyond_context_is_one_line_error(checkpoint, capsys):
    r = stopped(capsys, gen.main, "--checkpoint", checkpoint, "--max-new-tokens", "100")
    assert_one_line_error(r, "--max-new-tokens")


def test_cuda_without_a_gpu_is_one_line_error(checkpoint):
    assert_one_line_error(run_script("generate.py", "--checkpoint", checkpoint, "--device", "cuda"), "no CUDA")
    assert_one_line_error(run_script("train.py", "--device", "cuda"), "no CUDA")


def test_unknown_preset_is_one_line_error(capsys):
    assert_one_line_error(stopped(capsys, train.main, "--preset", "huge"), "unknown preset", "tiny")


def test_sparsity_outside_unit_interval_is_one_line_error(capsys):
    assert_one_line_error(stopped(capsys, train.main, "--sparsity", "1.0"), "outside [0, 1)")
    assert_one_line_error(stopped(capsys, gen.main, "--sparsity", "-0.1"), "outside [0, 1)")


def test_group_size_that_does_not_divide_is_one_line_error(capsys):
    assert_one_line_error(stopped(capsys, train.main, "--ffn-group-size", "7"), "does not divide")
    assert_one_line_error(stopped(capsys, train.main, "--attn-group-size", "3"), "does not divide")


def test_sparsity_without_a_trained_router_names_the_command(tmp_path, capsys):
    r = stopped(capsys, gen.main, "--out-dir", str(tmp_path), "--sparsity", "0.3")
    assert_one_line_error(r, "python train.py", "0.3")


def test_show_width_on_a_router_checkpoint_colours_tokens(checkpoint, tmp_path, capsys):
    model = Transformer.from_pretrained(checkpoint)
    wcfg = wide.WideConfig(ffn_group_size=16)
    wide.install_routers(model, wcfg)
    path = str(tmp_path / "wide-s0.5-stage1")
    checkpoints.save_wide(path, model, load_tokenizer(checkpoint), wcfg)
    r = run_main(capsys, gen.main, "--out-dir", str(tmp_path), "--sparsity", "0.5", "--show-width",
                 "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert "\033[" in r.stdout and "realized sparsity" in r.stdout and "executed linear FLOPs" in r.stdout


# ----------------------------------------------------------------------------------------------------
# eval.py's matched-FLOP helpers


def test_matched_flops_interpolates_log_perplexity_between_bracketing_points():
    import eval as ev
    pts = [(0.5, 100.0), (0.8, 50.0)]
    assert ev.interpolate(pts, 0.5) == pytest.approx(100.0)
    assert ev.interpolate(pts, 0.65) == pytest.approx((100.0 * 50.0) ** 0.5)  # geometric midpoint
    assert ev.interpolate(pts, 0.9) is None  # never extrapolate


def test_solve_target_finds_the_sparsity_with_the_requested_flops():
    import eval as ev
    flops = lambda s: 1.0 - 0.6 * s
    assert flops(ev.solve_target(flops, 0.7)) == pytest.approx(0.7, abs=1e-4)


def test_cli_run_makes_one_line_of_a_user_error_and_keeps_the_traceback_of_a_bug():
    def mistake():
        raise cli.UserError("no checkpoint here; train one first")

    def bug():
        raise ValueError("an index went wrong")
    with pytest.raises(SystemExit, match="^error: no checkpoint here; train one first$"):
        cli.run(mistake)
    with pytest.raises(ValueError, match="an index went wrong"):  # not swallowed into one line
        cli.run(bug)


@pytest.mark.parametrize("module, flag, more", [
    ("train", "--out-dir", ()),
    ("eval", "--results", ("--out-dir", "EMPTY")),
    ("research.where", "--results", ("--out-dir", "EMPTY")),
    ("research.mask_union", "--out", ("--out-dir", "EMPTY")),
    ("research.sass", "--out", ()),
    ("bench.ops", "--out", ("--smoke",)),
])
def test_an_output_directory_that_cannot_be_written_is_one_line_before_any_work(capsys, tmp_path, module, flag, more):
    # A path under a file can be made by nobody (permission bits would not stop root). Nothing is trained,
    # scored or timed first: with an EMPTY --out-dir the missing model would be the next error, another line.
    (tmp_path / "a-file").write_text("")
    target = str(tmp_path / "a-file" / "out") + ("/prefix" if flag == "--out" else "")
    more = [str(tmp_path) if m == "EMPTY" else m for m in more]
    main = importlib.import_module(module).main
    assert_one_line_error(stopped(capsys, main, flag, target, *more), flag, "cannot write there")


def test_non_positive_sizes_and_a_missing_model_are_one_line_errors(tmp_path):
    assert_one_line_error(run_script("train.py", "--batch-size", "0"), "--batch-size")
    assert_one_line_error(run_script("eval.py", "--out-dir", str(tmp_path)), "does not exist", "python train.py")


# ----------------------------------------------------------------------------------------------------
# numeric flags: checked as they are read (cli.integer / real / fraction), one line before any work


@pytest.mark.parametrize("script", ["train", "eval"])
def test_every_numeric_flag_is_parsed_by_a_checking_type(script):
    import importlib
    flags = [a for a in importlib.import_module(script).parser()._actions if a.option_strings]
    unchecked = [a.option_strings[0] for a in flags if a.type in (int, float)]
    assert not unchecked, f"{script}.py reads {unchecked} with a bare int/float: a bad value ends in a traceback"
    assert any(a.type is not None for a in flags)


@pytest.mark.parametrize("script,flag,value,words", [
    ("train", "--base-steps", "-3", ("--base-steps", "outside >= 1")),
    ("train", "--stage1-lr", "nan", ("--stage1-lr", "not a finite number")),
    ("train", "--lora-alpha", "0", ("--lora-alpha", "outside > 0")),
    ("train", "--ckpt-interval", "2.5", ("--ckpt-interval", "not a whole number")),
    ("eval", "--dial", "1.5", ("--dial", "outside [0, 1)")),
    ("eval", "--shared-batch", "0", ("--shared-batch", "outside >= 1")),
])
def test_a_bad_number_is_one_line_error_before_any_work(tmp_path, capsys, script, flag, value, words):
    # --stage 1 / an empty --out-dir: a value that slipped through would fail on the missing base model
    # (another line), never start training.
    where = ["--out-dir", str(tmp_path)] + (["--stage", "1"] if script == "train" else [])
    main = importlib.import_module(script).main
    assert_one_line_error(stopped(capsys, main, *where, flag, value), *words)
