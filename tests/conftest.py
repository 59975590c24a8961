import os
import sys
from types import SimpleNamespace

# Without a GPU, Triton kernels run on the CPU through the Triton interpreter. The variable must be
# set before triton is first imported, so it is decided here, before any test module loads.
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (pytest.ini: -n auto) each worker takes its share of the cores: the test models are
# tiny, and workers whose threads fight over the same cores are slower than one thread each.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# The project is a set of flat scripts at the repository root; make them importable from tests.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def assert_close(actual, expected, atol=None, rtol=None, what="tensors"):
    """The one closeness check of the suite: an absolute bound on every element (atol) and/or a bound on
    the relative error ||actual - expected|| / ||expected|| (rtol). On failure it says how far apart the
    tensors are (max and mean difference), and it fails on NaN (an output slot that was never written)."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert atol is not None or rtol is not None, "give atol, rtol or both"
    if actual.numel() == 0:
        return
    assert not torch.isnan(actual).any() or torch.isnan(expected).any(), f"{what}: NaN (a slot never written?)"
    diff = (actual.double() - expected.double()).abs()
    report = f"max abs diff {diff.max().item():.3g}, mean {diff.mean().item():.3g}"
    if atol is not None:
        assert diff.max().item() <= atol, f"{what} differ: {report} (allowed {atol:g})"
    if rtol is not None:
        rel = (diff.norm() / expected.double().norm().clamp_min(1e-30)).item()
        assert rel <= rtol, f"{what} differ: relative error {rel:.3g} > {rtol:g}; {report}"


class LaunchRecorder:
    """Records every launch of the project's Triton kernels (name -> list of grids), by wrapping the
    `*_kernel` objects of the kernel files and engine.py for one test. It is how the
    CPU tests prove that the width-skipping kernels really ran, not a PyTorch twin in their place."""

    def __init__(self, monkeypatch):
        import engine
        import kernels
        import kernels_attention
        import kernels_gemv
        import kernels_layout
        import kernels_step
        self.grids, self.constants = {}, {}  # name -> grids; name -> the launches' int/bool keyword args
        self.keys = set()  # (name, specialization): what Triton would compile each launch for (specialization)
        self.dry = False  # True: record the launches without running them (their outputs stay unwritten)
        for mod in (kernels, kernels_gemv, kernels_layout, kernels_attention, kernels_step, engine):
            for name, fn in list(vars(mod).items()):
                if name.endswith("_kernel") and hasattr(fn, "__getitem__"):
                    monkeypatch.setattr(mod, name, self._spy(name.strip("_"), fn))

    def _spy(self, name, fn):
        recorder = self

        class Spy:
            def __getitem__(self, grid):
                launch = fn[grid]

                def run(*args, **kwargs):
                    recorder.grids.setdefault(name, []).append(tuple(grid))
                    recorder.constants.setdefault(name, []).append(
                        {k: v for k, v in kwargs.items() if isinstance(v, (bool, int))})
                    recorder.keys.add((name, specialization(fn, args, kwargs)))
                    return None if recorder.dry else launch(*args, **kwargs)
                return run
        return Spy()

    def count(self, name):
        return len(self.grids.get(name, []))

    def clear(self):
        self.grids.clear()
        self.constants.clear()
        self.keys.clear()


def specialization(fn, args, kwargs):
    """The key a compiled (not interpreted) Triton kernel is looked up by, as far as a launch decides it: each
    constexpr's value; each int's class (1, a multiple of 16, other) unless the kernel marks it
    do_not_specialize; each tensor's dtype and 16-byte alignment; the launch options. A launch whose key no
    earlier launch had would compile (or load) a new binary on a GPU. The interpreter has no such cache, so
    tests emulate it here (tests/test_serve.py: a warmed-up server compiles nothing while it serves)."""
    import inspect
    import triton.language as tl
    params = inspect.signature(fn.fn).parameters
    constexpr = {n for n, p in params.items() if p.annotation is tl.constexpr or p.annotation == "tl.constexpr"}
    free = set((fn.kwargs.get("do_not_specialize") if hasattr(fn, "kwargs") else fn.do_not_specialize) or ())
    bound = dict(zip(fn.arg_names, args), **{k: v for k, v in kwargs.items() if k in params})
    key = []
    for i, name in enumerate(fn.arg_names):
        v = bound.get(name)
        if name in constexpr:
            key.append(v)
        elif isinstance(v, torch.Tensor):
            key.append((v.dtype, v.data_ptr() % 16 == 0))
        elif isinstance(v, bool) or not isinstance(v, int):
            key.append(type(v).__name__)
        else:
            key.append("int" if name in free or i in free else ("1" if v == 1 else "D" if v % 16 == 0 else "int"))
    return tuple(key) + tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))


@pytest.fixture
def launches(monkeypatch):
    return LaunchRecorder(monkeypatch)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(*args, timeout=300):
    """python <args> from the repository root, as a user runs it; no GPU visible, so the scripts behave
    the same on a GPU machine."""
    import subprocess
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


def run_main(capsys, main, *args):
    """cli.run(main, args) in this process, as a script's `__main__` calls it: the run as run_script reports
    it (returncode, stdout, stderr), for assert_one_line_error. Much faster than a subprocess, which only
    adds the interpreter's start (and a GPU hidden from it: tests of that keep run_script)."""
    import cli
    code = 0
    try:
        cli.run(main, list(args))
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    # argparse prints its line and exits 2; cli.fail's line is the SystemExit's message (exit code 1)
    message = code if isinstance(code, str) else ""
    return SimpleNamespace(returncode=1 if message else (code or 0), stdout=out.out, stderr=out.err + message)


def stopped(capsys, main, *args):
    """run_main for a command line that must stop before any work (a bad flag)."""
    r = run_main(capsys, main, *args)
    assert r.returncode != 0, f"the command ran to its end:\n{r.stdout[-2000:]}"
    return r


def assert_one_line_error(result, *words):
    """A non-zero exit with exactly one line on stderr (no traceback) that contains every word."""
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    lines = [l for l in result.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, result.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture(scope="module")
def one_thread():
    # The test models are tiny: one thread is faster than two fighting over the cores.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
