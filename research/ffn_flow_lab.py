"""
A lab for the one-token FFN as one launch: does down starting on a group as soon as gate+up has finished it beat
two launches? At batch 1 the FFN is two kernels, gate+up (silu(gate) * up for the live groups) and down (over the
live groups' columns, + the residual); between them the first one's last wave drains and the second one ramps up.
Here one grid holds both: its first PA programs take gate+up's items (a live group's block of BNA rows each, in
turn), and as each finishes a group's rows it counts them in done[group]; the next PB programs each own BNB rows of
down's output and walk the live groups in the same order, each group's weight tile loaded before waiting for that
group's count, so down's weights stream while gate+up is still running. Down's programs come after gate+up's in the
grid: GPUs dispatch a grid's programs in order (in practice; CUDA does not promise it), so none waits on a program
that cannot start, and gate+up's programs never wait (the Triton interpreter runs programs one after another, in
that order). Down's last program zeroes the counts, so the launch can be replayed in a CUDA graph. Timed against
the same code as two launches (ROLE 1 then ROLE 2) and the shipped pair (kernels.gemm_mn's decode GEMV with w_up,
kernels.gemm_k), on CUDA-graph replay over rotating weights.

    python -m research.ffn_flow_lab                   # -> results/ffn_flow_lab_<gpu>.{json,md}
    TRITON_INTERPRET=1 python -m research.ffn_flow_lab   # the lab kernel against its twin on the CPU, small sizes

Config tuples: (PA, BNA, BKA, BNB, num_warps), PA in programs per SM.
"""
import os

import torch
import triton
import triton.language as tl

import cli
import kernels
from kernels_step import live_ref
from research.lab import graph_rows, graph_table, lab_main

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP else "cuda"


@triton.jit
def lab_ffn_flow(x, wg, wu, wd, res, h, out, live, done, finished, D, I, PA, PB, GS: tl.constexpr,
                 BNA: tl.constexpr, BKA: tl.constexpr, BNB: tl.constexpr, ROLE: tl.constexpr):
    """ROLE 0: both halves in one grid of PA + PB programs, down waiting on done[]; ROLE 1: gate+up alone (PA
    programs); ROLE 2: down alone (PB programs), h complete before the launch. h [I] holds silu(gate) * up for the
    live groups only; out [D] = res + down's live columns @ h."""
    pid = tl.program_id(0)
    count = tl.load(live)
    RB: tl.constexpr = GS // BNA
    if ROLE != 2 and pid < PA:  # gate+up: items (j-th live group, block of BNA rows), taken in turn
        for it in range(pid, count * RB, PA):
            j = it // RB
            g = tl.load(live + 1 + j)
            rows = g * GS + (it % RB) * BNA + tl.arange(0, BNA)
            acc_g = tl.zeros([BNA, BKA], tl.float32)
            acc_u = tl.zeros([BNA, BKA], tl.float32)
            for k0 in range(0, D, BKA):
                kk = k0 + tl.arange(0, BKA)
                xv = tl.load(x + kk, mask=kk < D, other=0.0).to(tl.float32)[None, :]
                offs = rows[:, None].to(tl.int64) * D + kk[None, :]
                acc_g += tl.load(wg + offs, mask=(kk < D)[None, :], other=0.0).to(tl.float32) * xv
                acc_u += tl.load(wu + offs, mask=(kk < D)[None, :], other=0.0).to(tl.float32) * xv
            gate, up = tl.sum(acc_g, 1), tl.sum(acc_u, 1)
            tl.store(h + rows, (gate / (1.0 + tl.exp(-gate)) * up).to(h.dtype.element_ty))
            if ROLE == 0:
                tl.debug_barrier()  # every thread's rows of h are stored before the count (release)
                tl.atomic_add(done + j, 1)
        return
    b = pid - PA if ROLE == 0 else pid
    rows = b * BNB + tl.arange(0, BNB)
    acc = tl.zeros([BNB, GS], tl.float32)
    for j in range(0, count):  # down: this program's rows over the live groups, in gate+up's order
        cols = tl.load(live + 1 + j) * GS + tl.arange(0, GS)
        w = tl.load(wd + rows[:, None].to(tl.int64) * I + cols[None, :], mask=(rows < D)[:, None], other=0.0)
        if ROLE == 0:
            while tl.atomic_add(done + j, 0) < RB:  # (acquire) the group's rows of h are all stored
                pass
        hv = tl.load(h + cols, cache_modifier=".cg").to(tl.float32)
        acc += w.to(tl.float32) * hv[None, :]
    y = tl.sum(acc, 1) + tl.load(res + rows, mask=rows < D, other=0.0).to(tl.float32)
    tl.store(out + rows, y.to(out.dtype.element_ty), mask=rows < D)
    if ROLE == 0:
        tl.debug_barrier()
        if tl.atomic_add(finished, 1) == PB - 1:  # the last of down's programs: every count was read, zero them
            for j in range(0, count):
                tl.atomic_xchg(done + j, 0)
            tl.atomic_xchg(finished, 0)


class Flow:
    """The lab's buffers for one FFN: h, the counts and the ticket (zeros the kernel leaves zero)."""

    def __init__(self, D, I, gs, dtype, device):
        self.h = torch.empty(I, dtype=dtype, device=device)
        self.done = torch.zeros(I // gs, dtype=torch.int32, device=device)
        self.finished = torch.zeros(1, dtype=torch.int32, device=device)
        self.D, self.I, self.gs = D, I, gs

    def __call__(self, x, wg, wu, wd, res, live, cfg, one_launch=True):
        pa, BNA, BKA, BNB, nw = cfg
        PA = pa * (1 if INTERP else torch.cuda.get_device_properties(x.device).multi_processor_count)
        PB = triton.cdiv(self.D, BNB)
        out = torch.empty_like(res)
        args = (x, wg, wu, wd, res, self.h, out, live, self.done, self.finished, self.D, self.I, PA, PB)
        sizes = dict(GS=self.gs, BNA=BNA, BKA=BKA, BNB=BNB, num_warps=nw)
        if one_launch:
            lab_ffn_flow[(PA + PB,)](*args, ROLE=0, **sizes)
        else:
            lab_ffn_flow[(PA,)](*args, ROLE=1, **sizes)
            lab_ffn_flow[(PB,)](*args, ROLE=2, **sizes)
        return out


def problem(D, I, gs, skipped, dtype, seed=0, poison=False):
    """x, gate, up, down, residual, the group mask [G]; poison: the skipped groups' weights are NaN (a kernel that
    reads one makes NaN)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, device=DEV, generator=g) * scale).to(dtype)
    x, res = r(D), r(D)
    wg, wu, wd = r(I, D, scale=D ** -0.5), r(I, D, scale=D ** -0.5), r(D, I, scale=I ** -0.5)
    G = I // gs
    keep = torch.randperm(G, device=DEV, generator=g) < round((1 - skipped) * G)
    if poison:
        dead = (~keep).repeat_interleave(gs)
        wg[dead], wu[dead], wd[:, dead] = float("nan"), float("nan"), float("nan")
    return x, wg, wu, wd, res, keep


def reference(x, wg, wu, wd, res, keep, gs):
    """fp64 twin: res + down's live columns @ (silu(gate) * up) of the live rows."""
    on = keep.repeat_interleave(gs)
    x64 = x.double()
    gate, up = wg[on].double() @ x64, wu[on].double() @ x64
    return res.double() + wd[:, on].double() @ (gate * torch.sigmoid(gate) * up)


def check(D, I, gs, skipped, cfg, seed=1):
    """The lab kernel, one launch and two, against its twin on poisoned weights; twice in a row (the counts must be
    zero again for the second launch). Returns the largest relative error."""
    dtype = torch.float32 if INTERP else torch.bfloat16
    x, wg, wu, wd, res, keep = problem(D, I, gs, skipped, dtype, seed, poison=True)
    ref = reference(x, wg, wu, wd, res, keep, gs)
    flow, live = Flow(D, I, gs, dtype, x.device), live_ref(keep)
    errs = []
    for one_launch in (True, True, False):
        flow.h.fill_(float("nan"))  # a dead group's h is never written: reading it would make NaN
        out = flow(x, wg, wu, wd, res, live, cfg, one_launch).double()
        errs.append(((out - ref).norm() / ref.norm()).item())
        assert torch.isfinite(out).all(), "a skipped group's weights or h were read"
        assert flow.done.eq(0).all() and flow.finished.item() == 0, "the counts are left zero for the next launch"
    assert max(errs) < (1e-5 if INTERP else 1e-2), (cfg, errs)
    return max(errs)


CONFIGS = [(2, 16, 256, 16, 4), (2, 16, 256, 32, 4), (4, 8, 512, 16, 4), (1, 32, 256, 16, 8)]


def sweep(copies=8, shape=(4096, 14336, 128)):
    D, I, gs = shape  # Llama-3.1-8B's FFN, the engine's FFN groups
    dtype = torch.float32 if INTERP else torch.bfloat16
    rows = []
    for skipped in (0.5, 0.0):
        probs = [problem(D, I, gs, skipped, dtype, seed=s) for s in range(copies)]
        keep = probs[0][-1]
        live, mask = live_ref(keep), keep[None]
        tickets = torch.zeros(4096, dtype=torch.int32, device=DEV)
        live_bytes = 3 * D * I * 2 * (1 - skipped)
        # (name, its check against the twin (one launch and two) or None, the call, its live bytes)
        timed = [("shipped: gemm_mn GEMV (w_up) + gemm_k", None, lambda p: kernels.gemm_k(
            kernels.gemm_mn(p[0][None], p[1], mask, gs, w_up=p[2]), p[3], mask, gs, residual=p[4][None],
            tickets=tickets), live_bytes)]
        for cfg in CONFIGS:
            flow = Flow(D, I, gs, dtype, DEV)
            timed += [(f"lab, two launches {cfg}", None, lambda p, f=flow, c=cfg: f(*p[:5], live, c, False),
                       live_bytes),
                      (f"lab, one launch {cfg}", lambda c=cfg, sk=skipped: check(D, I, gs, sk, c),
                       lambda p, f=flow, c=cfg: f(*p[:5], live, c, True), live_bytes)]
        rows += graph_rows(dict(skipped=skipped), timed, probs)
    return rows


def markdown(m, rows):
    return graph_table(
        m, "One-token FFN in one launch", "Llama-3.1-8B's FFN (14336 channels in groups of 128, D 4096), bf16, one "
        "token, a random group mask; CUDA-graph replay over 8 weight copies (L2 defeated), us per FFN. TB/s: the live "
        "weight bytes (gate, up and down) per second. Lab config: (programs per SM for gate+up, its rows per item, its "
        "K step, down's rows per program, num_warps).", [("skipped", lambda r: f"{r['skipped']:.0%}")], "live weights",
        rows)


def on_cpu():
    for skipped in (0.0, 0.5, 1.0):
        print(skipped, check(48, 96, 16, skipped, (3, 8, 16, 16, 4)))


def main(argv=None):
    lab_main(argv, __doc__, "ffn_flow_lab", on_cpu, sweep, markdown)


if __name__ == "__main__":
    cli.run(main)
