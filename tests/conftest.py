import os
import sys

# Without a GPU, Triton kernels run on the CPU through the Triton interpreter. The variable must be
# set before triton is first imported, so it is decided here, before any test module loads.
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
