"""
A lab for decode attention and O as one launch at batch 1: does O starting on a head group as soon as its attention
output is merged beat two launches? O is pruned by exactly the attention's head groups, so a live group's output
(its heads' 512 values) times O's column block for that group is one term of a split-K over the live groups. Today
the step runs attention (items = a live group's chunk of cached keys; the group's last item merges the chunks),
then O (gemm_k over the live groups' columns, + the residual): between them attention's last programs drain, O
ramps up, and O's weights start streaming only after attention's round trips are all done.

Here one grid holds both: its first PA programs take attention's items (j-th live group, c-th chunk of CH keys) and
merge as the shipped kernel does (the last of a group's items, by ticket, merges its partials in chunk order); the
merged group is then flagged in done[j]. The next PB programs each own BNB rows of O's output and walk the live
groups in the same order, each group's [BNB, 512] weight tile loaded before waiting for that group's flag, so O's
weights stream while attention is still running. O's programs come after attention's in the grid: GPUs dispatch a
grid's programs in order (in practice; CUDA does not promise it), so none waits on a program that cannot start,
and attention's programs never wait (the Triton interpreter runs programs one after another, in that order). O's
last program clears the flags, so the launch can be replayed in a CUDA graph. Timed against the same code as two
launches (ROLE 1 then ROLE 2) and the shipped pair (kernels_attention.attention_decode, kernels.gemm_k with the live
list), on CUDA-graph replay over rotating weights and caches.

    python -m research.attn_o_lab                   # -> results/attn_o_lab_<gpu>.{json,md}
    TRITON_INTERPRET=1 python -m research.attn_o_lab   # the lab kernel against its twin on the CPU, small sizes

Config tuples: (CH keys per item, at least: longer where a group would have more items than the shipped kernel's
max_chunks, BN keys per step, BNB rows of O per program, num_warps).
"""
import math
import os

import torch
import triton
import triton.language as tl

import cli
import kernels
import kernels_base
from kernels_attention import attn_block, attention_decode, merge_chunks
from kernels_step import live_ref
from research.lab import graph_rows, graph_table, lab_main

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP else "cuda"


@triton.jit
def lab_attn_o(q, k, v, wo, res, o, out, live, po, plse, tickets, done, finished, kv_len, NC, CH, PA, PB, skh, skt,
               swo, DM, qk_scale, HPK: tl.constexpr, BH: tl.constexpr, HD: tl.constexpr, BN: tl.constexpr,
               BNB: tl.constexpr, ROLE: tl.constexpr, IEEE: tl.constexpr):
    """ROLE 0: both halves in one grid of PA + PB programs, O waiting on done[]; ROLE 1: attention alone (PA
    programs); ROLE 2: O alone (PB programs), o complete before the launch. One row (batch 1); a head group is a KV
    head's HPK query heads. o [H * HD] holds the live groups' attention outputs only; out [DM] = res + O's live
    columns @ o."""
    pid = tl.program_id(0)
    count = tl.load(live)
    GS: tl.constexpr = HPK * HD
    if ROLE != 2 and pid < PA:  # attention: item pid = (j-th live group, its c-th chunk of keys)
        if pid < count * NC:
            j, c = pid // NC, pid % NC
            g = tl.load(live + 1 + j)
            r, dd = tl.arange(0, BH), tl.arange(0, HD)
            head = g * HPK + r
            act = r < HPK
            qt = tl.load(q + head[:, None] * HD + dd[None, :], mask=act[:, None], other=0.0)
            start = c * CH
            end = tl.minimum(start + CH, kv_len)
            acc = tl.zeros([BH, HD], tl.float32)
            m_i = tl.full([BH], float("-inf"), tl.float32)
            l_i = tl.zeros([BH], tl.float32)
            pos = r * 0 + end
            full = start + (end - start) // BN * BN
            for t0 in range(start, full, BN):
                acc, m_i, l_i = attn_block(acc, m_i, l_i, qt, k + g * skh, v + g * skh, skt, skt, t0, pos, end,
                                           qk_scale, BN, HD, False, IEEE)
            for t0 in range(full, end, BN):
                acc, m_i, l_i = attn_block(acc, m_i, l_i, qt, k + g * skh, v + g * skh, skt, skt, t0, pos, end,
                                           qk_scale, BN, HD, True, IEEE)
            optr = o + head[:, None] * HD + dd[None, :]
            if NC == 1:
                tl.store(optr, (acc / l_i[:, None]).to(o.dtype.element_ty), mask=act[:, None])
                if ROLE == 0:
                    tl.debug_barrier()  # every thread's part of o is stored before the flag (release)
                    tl.atomic_xchg(done + j, 1)
            else:
                row = pid * HPK + r
                tl.store(po + row[:, None] * HD + dd[None, :], acc / l_i[:, None], mask=act[:, None])
                tl.store(plse + row, m_i + tl.log2(l_i), mask=act)
                tl.debug_barrier()  # the partial is stored before the ticket is taken (release)
                if tl.atomic_add(tickets + j, 1) == NC - 1:  # the group's last item: merge in chunk order
                    tl.atomic_xchg(tickets + j, 0)
                    merged = merge_chunks(po, plse, j * NC, NC, r, HPK, BH, HD)
                    tl.store(optr, merged.to(o.dtype.element_ty), mask=act[:, None])
                    if ROLE == 0:
                        tl.debug_barrier()
                        tl.atomic_xchg(done + j, 1)
    else:
        b = pid - PA if ROLE == 0 else pid
        rows = b * BNB + tl.arange(0, BNB)
        rok = rows < DM
        acc = tl.zeros([BNB, GS], tl.float32)
        for j in range(0, count):  # O: this program's rows over the live groups, in attention's order
            cols = tl.load(live + 1 + j) * GS + tl.arange(0, GS)
            w = tl.load(wo + rows[:, None].to(tl.int64) * swo + cols[None, :], mask=rok[:, None], other=0.0)
            if ROLE == 0:
                while tl.atomic_add(done + j, 0) < 1:  # (acquire) the group's merged output is stored
                    pass
            ov = tl.load(o + cols, cache_modifier=".cg").to(tl.float32)
            acc += w.to(tl.float32) * ov[None, :]
        y = tl.sum(acc, 1) + tl.load(res + rows, mask=rok, other=0.0).to(tl.float32)
        tl.store(out + rows, y.to(out.dtype.element_ty), mask=rok)
        if ROLE == 0:
            tl.debug_barrier()
            if tl.atomic_add(finished, 1) == PB - 1:  # O's last program: every flag was read, clear them
                for j in range(0, count):
                    tl.atomic_xchg(done + j, 0)
                tl.atomic_xchg(finished, 0)


class AttnO:
    """The lab's buffers for one layer at batch 1: attention's output, partials, tickets, flags (zeros the kernel
    leaves zero)."""

    def __init__(self, H, Hkv, hd, DM, L, dtype, device, max_items=1024):
        self.o = torch.empty(H * hd, dtype=dtype, device=device)
        self.po = torch.empty(max_items * (H // Hkv), hd, dtype=torch.float32, device=device)
        self.plse = torch.empty(max_items * (H // Hkv), dtype=torch.float32, device=device)
        self.tickets = torch.zeros(Hkv, dtype=torch.int32, device=device)
        self.done = torch.zeros(Hkv, dtype=torch.int32, device=device)
        self.finished = torch.zeros(1, dtype=torch.int32, device=device)
        self.H, self.Hkv, self.hd, self.DM, self.max_items = H, Hkv, hd, DM, max_items

    def __call__(self, q, k, v, wo, res, live, kv_len, cfg, one_launch=True, o_too=True):
        """out = res + O @ attention; o_too=False (two launches only): the attention launch alone, out unwritten."""
        CH, BN, BNB, nw = cfg
        hpk = self.H // self.Hkv
        # at most the shipped kernel's max_chunks items per group: the merge reads them one by one
        CH = max(CH, triton.cdiv(triton.cdiv(kv_len, kernels_base.CONFIGS["attn_decode"]["max_chunks"]), BN) * BN)
        NC = self.chunks = triton.cdiv(kv_len, CH)
        PA, PB = self.Hkv * NC, triton.cdiv(self.DM, BNB)  # attention: room for every group's items
        assert PA <= self.max_items and CH % BN == 0 and k.stride() == v.stride()
        out = torch.empty_like(res)
        args = (q, k, v, wo, res, self.o, out, live, self.po, self.plse, self.tickets, self.done, self.finished,
                kv_len, NC, CH, PA, PB, k.stride(0), k.stride(1), wo.stride(0), self.DM, self.hd ** -0.5 * math.log2(math.e))
        sizes = dict(HPK=hpk, BH=max(16, triton.next_power_of_2(hpk)), HD=self.hd, BN=BN, BNB=BNB,
                     IEEE=q.dtype == torch.float32, num_warps=nw)
        if one_launch:
            lab_attn_o[(PA + PB,)](*args, ROLE=0, **sizes)
        else:
            lab_attn_o[(PA,)](*args, ROLE=1, **sizes)
            if o_too:
                lab_attn_o[(PB,)](*args, ROLE=2, **sizes)
        return out


def problem(H, Hkv, hd, DM, L, kv_len, skipped, dtype, seed=0, poison=False):
    """q [H, hd], caches [Hkv, L, hd], O [DM, H * hd], residual [DM], the head-group mask [Hkv] (a group: one KV
    head's query heads); poison: the skipped groups' O columns and K/V, and every position past kv_len, are NaN (a
    kernel that reads one makes NaN)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, device=DEV, generator=g) * scale).to(dtype)
    q, k, v, res = r(H, hd), r(Hkv, L, hd), r(Hkv, L, hd), r(DM)
    wo = r(DM, H * hd, scale=(H * hd) ** -0.5)
    keep = torch.randperm(Hkv, device=DEV, generator=g) < round((1 - skipped) * Hkv)
    if poison:
        wo.view(DM, Hkv, -1)[:, ~keep] = float("nan")
        k[~keep], v[~keep] = float("nan"), float("nan")
        k[:, kv_len:], v[:, kv_len:] = float("nan"), float("nan")
    return q, k, v, wo, res, keep


def reference(q, k, v, wo, res, keep, kv_len):
    """fp64 twin: res + O's live columns @ (softmax(q K^T / sqrt(hd)) V of the live groups' heads)."""
    H, hd = q.shape
    Hkv = k.shape[0]
    hpk = H // Hkv
    kk = k[:, :kv_len].double().repeat_interleave(hpk, 0)
    vv = v[:, :kv_len].double().repeat_interleave(hpk, 0)
    att = torch.softmax(torch.einsum("hd,htd->ht", q.double(), kk) * hd ** -0.5, -1)
    o = torch.einsum("ht,htd->hd", att, vv).reshape(-1)
    on = keep.repeat_interleave(hpk * hd)
    return res.double() + wo[:, on].double() @ o[on]


def check(shape, kv_len, skipped, cfg, seed=1):
    """The lab kernel, one launch and two, against its twin on poisoned inputs; twice in a row (tickets and flags
    must be zero again for the second launch). Returns the largest relative error."""
    H, Hkv, hd, DM, L = shape
    dtype = torch.float32 if INTERP else torch.bfloat16
    q, k, v, wo, res, keep = problem(H, Hkv, hd, DM, L, kv_len, skipped, dtype, seed, poison=True)
    ref = reference(q, k, v, wo, res, keep, kv_len)
    lab, live = AttnO(H, Hkv, hd, DM, L, dtype, q.device), live_ref(keep)
    errs = []
    for one_launch in (True, True, False):
        lab.o.fill_(float("nan"))  # a dead group's output is never written: reading it would make NaN
        out = lab(q, k, v, wo, res, live, kv_len, cfg, one_launch).double()
        errs.append(((out - ref).norm() / ref.norm()).item())
        assert torch.isfinite(out).all(), "a skipped group's weights, keys or outputs were read"
        assert lab.tickets.eq(0).all() and lab.done.eq(0).all() and lab.finished.item() == 0, \
            "tickets and flags are left zero for the next launch"
    assert max(errs) < (1e-5 if INTERP else 1e-2), (cfg, errs)
    return max(errs)


CONFIGS = [(128, 64, 4, 4), (128, 64, 8, 4), (256, 64, 8, 4), (128, 128, 16, 8), (256, 128, 8, 8)]
LLAMA = (32, 8, 128, 4096)  # query heads, KV heads, head dim, model dim


def sweep(copies=8, shape=LLAMA, kv_lens=(1024, 8192)):
    H, Hkv, hd, DM = shape
    dtype = torch.float32 if INTERP else torch.bfloat16
    rows = []
    for kv_len in kv_lens:
        for skipped in (0.5, 0.0):
            probs = [problem(H, Hkv, hd, DM, kv_len, kv_len, skipped, dtype, seed=s) for s in range(copies)]
            keep = probs[0][-1]
            live, mask = live_ref(keep), keep[None]
            tickets = torch.zeros(4096, dtype=torch.int32, device=DEV)
            kvl = torch.tensor([kv_len], dtype=torch.int32, device=DEV)
            kv_bytes = 2 * kv_len * Hkv * hd * 2 * (1 - skipped)  # the live groups' K and V
            live_bytes = kv_bytes + DM * H * hd * 2 * (1 - skipped)  # and O's live columns
            shipped_attn = lambda p: attention_decode(p[0].view(1, H, 1, hd), p[1][None], p[2][None], mask, kvl,
                                                      tickets=tickets)
            # (name, its check against the twin (one launch and two) or None, the call, its live bytes)
            timed = [("shipped attention alone", None, shipped_attn, kv_bytes),
                     ("shipped: attention_decode + gemm_k", None, lambda p: kernels.gemm_k(
                         shipped_attn(p).view(1, H * hd), p[3], mask, H // Hkv * hd, residual=p[4][None],
                         tickets=tickets, live=live), live_bytes)]
            for cfg in CONFIGS:
                lab = AttnO(H, Hkv, hd, DM, kv_len, dtype, DEV)
                timed += [(f"lab attention alone {cfg}", None,
                           lambda p, f=lab, c=cfg: f(*p[:5], live, kv_len, c, False, False), kv_bytes),
                          (f"lab, two launches {cfg}", None,
                           lambda p, f=lab, c=cfg: f(*p[:5], live, kv_len, c, False), live_bytes),
                          (f"lab, one launch {cfg}", lambda c=cfg, n=kv_len, sk=skipped: check(
                              (H, Hkv, hd, DM, n), n, sk, c), lambda p, f=lab, c=cfg: f(*p[:5], live, kv_len, c, True),
                           live_bytes)]
            rows += graph_rows(dict(kv_len=kv_len, skipped=skipped), timed, probs)
    return rows


def markdown(m, rows):
    return graph_table(
        m, "Decode attention and O in one launch", "Llama-3.1-8B's attention at batch 1 (32 query heads in 8 groups of "
        "one KV head's 4, head dim 128, O 4096 x 4096), bf16, one token, a random group mask; CUDA-graph replay over 8 "
        "copies of O's weight and the cache (L2 defeated), us per layer. TB/s: the live bytes (the live groups' K and "
        "V, and O's live columns unless the row is attention alone) per second. Lab config: (keys per attention item, "
        "keys per step, O's rows per program, num_warps).",
        [("keys", lambda r: str(r["kv_len"])), ("skipped", lambda r: f"{r['skipped']:.0%}")], "live bytes", rows)


def on_cpu():
    for kv_len, skipped, cfg in ((40, 0.0, (16, 16, 8, 4)), (17, 0.5, (16, 16, 8, 4)), (40, 0.5, (64, 16, 4, 4)),
                                 (40, 1.0, (16, 16, 8, 4))):
        print(kv_len, skipped, cfg, check((8, 2, 16, 36, 48), kv_len, skipped, cfg))


def main(argv=None):
    lab_main(argv, __doc__, "attn_o_lab", on_cpu, sweep, markdown)


if __name__ == "__main__":
    cli.run(main)
