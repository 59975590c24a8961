"""generate.py as a user runs it: the two backends give the same text, the width it reports is each
row's own, and bad flags end in one line.

In-process runs call generate.main under the Triton interpreter (conftest), so the launch recorder
sees which kernels the Triton backend ran; subprocess runs check exit codes and stderr."""
import os
import subprocess
import sys

import pytest
import torch

import checkpoints
import data
import wide
from generate import generate, main, sample, token_widths
from conftest import assert_one_line_error, run_main, stopped
from model import ModelConfig, Transformer, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n\n" * 5
SKIPPING = ("gemv_mn_kernel", "gemm_k_kernel", "attn_decode_kernel")  # a short prompt: the decode kernels


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    """out/wide-s0.5-stage1 as train.py writes it: a router checkpoint shaped as the kernels need
    (head_dim 16, attention groups of one KV head, FFN groups of 32 channels), random routers."""
    out = tmp_path_factory.mktemp("out")
    tok = data.train_tokenizer([TEXT], 300)
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=tok.get_vocab_size(), dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                intermediate_size=128, max_seq_len=64))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)  # clear argmax margins
    wcfg = wide.WideConfig(ffn_group_size=32)
    wide.install_routers(m, wcfg)
    checkpoints.save_wide(str(out / "wide-s0.5-stage1"), m, tok, wcfg)
    return str(out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="compares fp32 text under the CPU interpreter; on a GPU "
                    "generate.py runs bf16 (test_e2e compares fp32 greedy tokens on the GPU)")
def test_triton_backend_gives_the_reference_text_with_the_skipping_kernels_launched(out_dir, capsys, launches):
    common = ("--out-dir", out_dir, "--sparsity", "0.5", "--temperature", "0", "--max-new-tokens", "12",
              "--prompt", "ROMEO:", "--prompt", "But soft, what light")
    ref = run_main(capsys, main, *common, "--backend", "torch").stdout
    assert not launches.grids, "the torch backend launches no Triton kernel"
    out = run_main(capsys, main, *common, "--backend", "triton").stdout
    plan = "backend triton; where each op runs:\n" + "a prefill of "
    assert plan in out, "generate.py --backend triton prints where each op runs"
    policy = out[out.index("backend triton"):out.index("\n", out.index("lm_head", out.index("a decode step"))) + 1]
    samples = lambda o: o.replace(policy, "").split(" tokens in ")[0]  # everything before the timing line
    assert samples(out) == samples(ref), f"{ref}\n---\n{out}"
    for name in SKIPPING:
        assert launches.count(name) > 0, f"{name} never ran"
    assert "library GEMM on the masked input" in out and "backend triton" in out and "backend torch" in ref


@pytest.mark.skipif(torch.cuda.is_available(), reason="compares fp32 text under the CPU interpreter")
def test_fp8_gptq_weights_generate_as_the_model_with_gptqs_codes(out_dir, capsys, monkeypatch):
    import engine
    import kernels
    calls = []
    real = kernels.calibrate_fp8
    monkeypatch.setattr(kernels, "calibrate_fp8", lambda m, batches: calls.append(list(batches)) or real(m, batches))
    common = ("--out-dir", out_dir, "--sparsity", "0.5", "--temperature", "0", "--max-new-tokens", "8",
              "--prompt", "ROMEO:")
    out = run_main(capsys, main, *common, "--backend", "triton", "--weights", "fp8-gptq").stdout
    assert len(calls) == 1 and all(b.shape[0] <= 16 for b in calls[0]) and sum(len(b) for b in calls[0]) == 64
    # the reference: the same checkpoint, calibrated the same way, its weights as the fp8 codes stand for
    path, model, _, _ = checkpoints.load_for_inference(None, None, out_dir, "wide", 0.5, None, None,
                                                       windows=data.dial_windows, device="cpu", dtype=torch.float32)
    tok = checkpoints.tokenizer_for(path, None)
    assert engine.fp8_weights(model.eval(), "fp8-gptq", tok) == "fp8"
    ref_model = engine.fp8_model(model)
    idx = torch.tensor([tok.encode("ROMEO:").ids])
    with torch.no_grad():
        ref = tok.decode(generate(ref_model, idx, 8)[0].tolist())
    assert ref in out, f"{ref!r}\n---\n{out}"


@pytest.mark.parametrize("weights", ["fp8", "fp8-gptq"])
def test_fp8_weights_on_the_torch_backend_stop_in_one_line_before_any_calibration(out_dir, capsys, monkeypatch, weights):
    import kernels
    monkeypatch.setattr(kernels, "calibrate_fp8", lambda *a: pytest.fail("calibrated before the backend check"))
    r = stopped(capsys, main, "--out-dir", out_dir, "--sparsity", "0.5", "--backend", "torch", "--weights", weights,
                "--max-new-tokens", "2")
    assert_one_line_error(r, f"--weights {weights}", "--backend triton")


def test_show_width_reports_each_rows_own_tokens_not_the_padding(out_dir):
    # Prompts of different lengths are right-padded: after the prefill, position P-1 is padding for
    # the shorter rows. The width of each row's first new token must be that of its own last prompt
    # token, exactly what the row gets when it is generated alone.
    m, wcfg = checkpoints.load_wide(os.path.join(out_dir, "wide-s0.5-stage1"))
    prompts = [[5, 17, 3, 44, 9, 2, 7], [6, 5], [3, 5, 8]]
    last = torch.tensor([len(p) - 1 for p in prompts])

    def widths(idx, lengths=None, at=None):
        seen = []
        generate(m, idx, 4, lengths=lengths,
                 on_token=lambda i, t, masks: seen.append(token_widths(masks, m.config, wcfg, at if i == 0 else None)))
        return seen

    together = widths(torch.tensor([p + [0] * (7 - len(p)) for p in prompts]), [len(p) for p in prompts], last)
    for b, p in enumerate(prompts):
        alone = widths(torch.tensor([p]), at=torch.tensor([len(p) - 1]))
        for step_t, step_a in zip(together, alone):
            for k in step_a:
                assert step_t[k][b].item() == pytest.approx(step_a[k][0].item(), abs=1e-6), (b, k)
    # and the values are the shares of groups the routers ran (not a constant)
    assert len({round(s["attn"][0].item(), 4) for s in together}) > 1 or len({round(s["ffn"][0].item(), 4) for s in together}) > 1


def test_realized_sparsity_line_is_the_mean_over_each_rows_own_tokens(out_dir, capsys):
    prompts = ["ROMEO:", "But soft, what light through"]
    out = run_main(capsys, main, "--out-dir", out_dir, "--sparsity", "0.5", "--temperature", "0", "--max-new-tokens",
                   "6", "--backend", "torch", "--device", "cpu", "--prompt", prompts[0], "--prompt", prompts[1]).stdout
    line = next(l for l in out.splitlines() if l.startswith("realized sparsity"))
    printed = [float(line.split(f"{k} ")[1].split("%")[0]) for k in ("attention", "FFN")]
    # The same numbers from each prompt generated alone (greedy: the same tokens as in the batch).
    m, wcfg = checkpoints.load_wide(os.path.join(out_dir, "wide-s0.5-stage1"))
    tok = load_tokenizer(os.path.join(out_dir, "wide-s0.5-stage1"))
    seen = []
    for p in prompts:
        ids = tok.encode(p).ids
        generate(m, torch.tensor([ids]), 6, on_token=lambda i, t, masks: seen.append(
            token_widths(masks, m.config, wcfg, torch.tensor([len(ids) - 1]) if i == 0 else None)))
    expected = [100 * (1 - torch.cat([s[k] for s in seen]).mean().item()) for k in ("attn", "ffn")]
    assert printed == pytest.approx(expected, abs=0.051), (line, expected)


@pytest.mark.parametrize("flags, words", [
    (("--top-k", "-5"), ("--top-k", "-5")),
    (("--device", "tpu"), ("--device", "tpu")),
    (("--backend", "cuda"), ("--backend",)),
    (("--sparsity", "1.5"), ("outside [0, 1)",)),
    (("--temperature", "-1"), ("--temperature",)),
])
def test_every_invalid_flag_ends_in_one_line_and_a_nonzero_exit(out_dir, capsys, flags, words):
    assert_one_line_error(stopped(capsys, main, "--out-dir", out_dir, "--max-new-tokens", "2", *flags), *words)


@pytest.mark.parametrize("flags, words", [
    (("--max-new-tokens", "0"), ("--max-new-tokens", ">= 1")),
    (("--max-new-tokens", "2.5"), ("--max-new-tokens", "whole number")),
    (("--temperature", "nan"), ("--temperature", "finite")),
    (("--temperature", "inf"), ("--temperature", "finite")),
    (("--top-k", "1.5"), ("--top-k", "whole number")),
    (("--num-samples", "0"), ("--num-samples",)),
    (("--seed", "-1"), ("--seed",)),
    (("--sparsity", "nan"), ("--sparsity", "finite")),
    (("--attn-sparsity", "1", "--ffn-sparsity", "0.5"), ("--attn-sparsity", "[0, 1)")),
    (("--sparsity", "0.5", "--attn-sparsity", "0.5", "--ffn-sparsity", "0.5"), ("not a mix",)),
])
def test_a_bad_number_stops_generate_before_any_work_in_one_line(tmp_path, capsys, flags, words):
    # An empty --out-dir: a flag that slipped through would end in "no checkpoint", not in these words.
    r = stopped(capsys, main, "--out-dir", str(tmp_path), "--device", "cpu", *flags)
    assert_one_line_error(r, *words)


def test_triton_backend_without_a_gpu_or_the_interpreter_is_one_line(out_dir):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "generate.py", "--out-dir", out_dir, "--sparsity", "0.5", "--backend", "triton",
                        "--max-new-tokens", "2"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "TRITON_INTERPRET=1" in r.stderr, r.stderr


def test_generate_cli_compares_wide_with_dense_in_the_same_engine(out_dir, capsys):
    r = run_main(capsys, main, "--out-dir", out_dir, "--sparsity", "0.5", "--compare-dense", "--max-new-tokens", "6",
                 "--prompt", "ROMEO:", "--prompt", "But soft")
    assert r.returncode == 0, r.stderr
    assert "dense (routers off, same engine)" in r.stdout and "WIDE / dense decode speed" in r.stdout
    assert "batch 2" in r.stdout and "backend torch" in r.stdout


# ----------------------------------------------------------------------------------------------------
# top-k sampling (sample): draws go beyond the argmax, and never outside each row's top k

def test_top_k_sampling_draws_beyond_the_argmax_but_never_outside_each_rows_top_k():
    k, n = 4, 2000
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    rows = logits.repeat_interleave(n, 0)  # n draws from each row, one generator: many independent seeds
    draws = sample(rows, temperature=1.0, top_k=k, generator=torch.Generator().manual_seed(1))
    for r in range(2):
        seen = set(draws[r * n:(r + 1) * n].flatten().tolist())
        top = set(torch.topk(logits[r], k).indices.tolist())
        assert seen == top, f"row {r}: drew {sorted(seen)}, its top {k} are {sorted(top)}"
