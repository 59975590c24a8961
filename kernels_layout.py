"""
The layout (mask reordering): built once per router decision, reused by the ops that share it.

For each group, a stable prefix-sum partition puts the tokens that run it first, in ascending order,
then the ones that skip it; so whole token tiles of a group are either live or dead, and the work list
puts the live (group, tile) items first. gemm_mn's prefill tiles and prefill attention read it.
Twin first (a stable torch.sort), then the kernels.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels_base import CONFIGS, check_device, empty


class Layout(NamedTuple):
    mask: torch.Tensor          # [M, G] bool, tokens flattened batch-major (M = B*T)
    counts: torch.Tensor        # [G] int32, live tokens per group
    perm: torch.Tensor          # [G, M] int32, per group: live tokens ascending, then the others ascending
    work: torch.Tensor          # [G * cdiv(M, block_m)] int32, item g*n_tiles+tile; live tiles first
    batch_counts: torch.Tensor  # [B, G] int32, live tokens per (sequence, group), for attention
    block_m: int
    batch: int


def layout_ref(mask, block_m):
    """Torch twin of `layout`: the same partition through a stable sort."""
    mask3 = mask if mask.dim() == 3 else mask[None]
    B, T, G = mask3.shape
    flat = mask3.reshape(B * T, G)
    counts = flat.sum(0, dtype=torch.int32)
    perm = torch.sort((~flat).to(torch.uint8).t(), dim=1, stable=True).indices.to(torch.int32)
    n_tiles = triton.cdiv(B * T, block_m)
    live = torch.arange(n_tiles, device=mask.device)[None, :] * block_m < counts[:, None]
    work = torch.sort((~live).flatten().to(torch.uint8), stable=True).indices.to(torch.int32)
    return Layout(flat.contiguous(), counts, perm.contiguous(), work,
                  mask3.sum(1, dtype=torch.int32), block_m, B)


@triton.jit(do_not_specialize=["T", "M"])  # token counts: see Policy.warm_chunks
def _layout_kernel(mask, counts, bcounts, perm, T, G, M, BLOCK: tl.constexpr):
    """Stable partition of one group's tokens (the routing layout), by prefix sums.

    Grid (G,). Pass 1 counts the live tokens per sequence; pass 2 sends live token t to
    (#live before t) and skipped t to count + (#skipped before t), so both halves keep
    ascending token order. That order is what keeps causal attention tiles tight.
    Twin: layout_ref (a stable torch.sort).
    """
    g = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    B = M // T
    n = tl.zeros([], tl.int32)
    for b in range(0, B):
        nb = tl.zeros([], tl.int32)
        for t0 in range(0, T, BLOCK):
            t = t0 + offs
            bits = tl.load(mask + (b * T + t) * G + g, mask=t < T, other=0).to(tl.int32)
            nb += tl.sum(bits, 0)
        tl.store(bcounts + b * G + g, nb)
        n += nb
    tl.store(counts + g, n)
    seen = tl.zeros([], tl.int32)
    for m0 in range(0, M, BLOCK):
        m = m0 + offs
        bits = tl.load(mask + m * G + g, mask=m < M, other=0).to(tl.int32)
        incl = seen + tl.cumsum(bits, 0)
        dst = tl.where(bits > 0, incl - 1, n + m - incl)
        tl.store(perm + g * M + dst, m, mask=m < M)
        seen += tl.sum(bits, 0)


@triton.jit(do_not_specialize=["NT"])
def _worklist_kernel(counts, work, G, NT, BM: tl.constexpr, GP: tl.constexpr):
    """The compact work list: live (group, token-tile) items first, group-major, then the dead ones.

    Grid (1,). NT token tiles per group; a tile is live when tile*BM < count[g]. Kernels launch one
    program per item and dead items (which only write zeros, or nothing) come last, so the first waves
    are all real work. Twin: layout_ref.
    """
    gg = tl.arange(0, GP)
    gok = gg < G
    tiles = (tl.load(counts + gg, mask=gok, other=0) + BM - 1) // BM
    live_before = tl.cumsum(tiles, 0) - tiles
    n_live = tl.sum(tiles, 0)
    dead = tl.where(gok, NT - tiles, 0)
    dead_before = tl.cumsum(dead, 0) - dead
    for i in range(0, NT):
        dst = tl.where(i < tiles, live_before + i, n_live + dead_before + i - tiles)
        tl.store(work + dst, gg * NT + i, mask=gok)


def layout(mask, block_m=None):
    """Build the routing layout of a bool mask [M, G] or [B, T, G] (True = group executes)."""
    check_device(mask)
    block_m = block_m or CONFIGS["block_m"]
    mask3 = mask if mask.dim() == 3 else mask[None]
    B, T, G = mask3.shape
    M, dev = B * T, mask.device
    flat = mask3.reshape(M, G).contiguous()
    counts, perm = empty((G,), torch.int32, dev), empty((G, M), torch.int32, dev)
    bcounts = empty((B, G), torch.int32, dev)
    n_tiles = triton.cdiv(M, block_m)
    work = empty((G * n_tiles,), torch.int32, dev)
    # The line that builds the layout: one stable prefix-sum partition per group, then the work list.
    _layout_kernel[(G,)](flat.view(torch.uint8), counts, bcounts, perm, T, G, M,
                         BLOCK=min(4096, triton.next_power_of_2(M)), num_warps=8)
    _worklist_kernel[(1,)](counts, work, G, n_tiles, BM=block_m, GP=max(2, triton.next_power_of_2(G)))
    return Layout(flat, counts, perm, work, bcounts, block_m, B)


def as_layout(mask_or_layout):
    if isinstance(mask_or_layout, Layout):
        return mask_or_layout
    return layout(mask_or_layout)


def flat_mask(mask_or_layout):
    if isinstance(mask_or_layout, Layout):
        return mask_or_layout.mask
    m = mask_or_layout
    return (m.reshape(-1, m.shape[-1]) if m.dim() == 3 else m).contiguous()
