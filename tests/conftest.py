import os
import sys

# Without a GPU, Triton kernels run on the CPU through the Triton interpreter. The variable must be
# set before triton is first imported, so it is decided here, before any test module loads.
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The project is a set of flat scripts at the repository root; make them importable from tests.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
