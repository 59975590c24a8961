"""Device only (the L2 prefetch of O, measured and not kept): batch-1 decode steps, decode attention's L2 prefetch of O's columns: variants."""
import sys
sys.path.insert(0, ".")
import torch
from bench.e2e import E2ESetup, time_decode
from bench.common import random_model, calibrate_routers, with_engine
from kernels_base import configs_tried
from policy import Policy
run = E2ESetup()
m, _ = random_model(run, max_seq_len=8192 + 128)
calibrate_routers(m, 0.5, run.calibrate_tokens)
V = {"off": (Policy(prefetch_o_max_tokens=0), {}),
     "idle": (Policy(), {}),
     "after": (Policy(), {"attn_decode": dict(prefetch_after=1)}),
     "after rb8": (Policy(), {"attn_decode": dict(prefetch_after=1, prefetch_rows=8)}),
     "idle rb8": (Policy(), {"attn_decode": dict(prefetch_rows=8)})}
cases = [(True, "bf16", 1024), (False, "bf16", 1024), (True, "bf16", 8192)]
for rep in range(2):
    for name, (pol, cfg) in (V.items() if rep == 0 else reversed(V.items())):
        with configs_tried(cfg):
            for wide, w, ctx in cases:
                ms, masks = with_engine(m, wide, pol, lambda e: time_decode(run, e, 1, ctx, run.steps), w)
                print(f"rep{rep} {name:12s} {'WIDE ' if wide else 'dense'} {w} ctx {ctx}: {ms:.4f} ms", flush=True)
