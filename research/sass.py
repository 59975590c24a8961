"""
What the one-token decode kernels and the prefill gate+up tile compile to on a Hopper GPU, read on any machine
(no GPU needed): each kernel is built for sm_90a by Triton itself, with the sizes of kernels_base.CONFIGS and the
argument specializations a Llama-3.1-8B decode step (or 2048-token chunk) gives it (ints that are multiples of 16
marked so, as the launcher does), then Triton's own cuobjdump reads the binary: registers per thread (which cap the programs an SM can
hold), shared memory, and the instruction mix.

    python -m research.sass        # -> results/kernels_sass_sm90.{json,md}

The counts are static (each instruction of the binary once: the loop body, its prologue and its epilogue), and
come from this machine's Triton, which may differ from the Triton that runs the benchmarks.
"""
import collections
import datetime
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

import cli
import kernels
import kernels_attention
import kernels_base
import kernels_gemv
from bench.common import save
from research.gate_up_lab import lab_gate_up

D, I, H, HKV, HD, CTX = 4096, 14336, 32, 8, 128, 1024  # Llama-3.1-8B; a 1k-token cache
SHARED_PER_SM = 228 * 1024  # Hopper's shared memory per SM (config PIPE's tiles in flight live there)


def compile_sm90(fn, args, num_warps, num_stages):
    """fn built for sm_90a: args maps every argument name to its constexpr value, a pointer type ("*bf16"),
    a float, or an int (1 becomes a constant and a multiple of 16 is marked divisible, as at launch)."""
    sig, const, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        v = args[name]
        if param.is_constexpr:
            sig[name], const[name] = "constexpr", v
        elif isinstance(v, str):
            sig[name], attrs[(i,)] = v, [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif isinstance(v, int) and not isinstance(v, bool) and v != 1:
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name], const[name] = "constexpr", v
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                                num_stages=num_stages))


def read_binary(cubin):
    """(registers per thread, {SASS opcode: count}) of a cubin, by Triton's cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        raise cli.UserError(f"research.sass needs Triton's cuobjdump ({tool} is missing); install triton with its "
                            "NVIDIA backend")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M))
    return regs, ops


def gemv_args(cfg, fused, fp8, rope):
    """GEMV_KERNEL's arguments for one token: gate+up (fused), or Q with K, V as its tail and RoPE."""
    w = "*fp8e4nv" if fp8 else "*bf16"
    n = H * HD + 2 * HKV * HD if rope else I
    G, GE = (H // 4, 2 * HKV * HD // (4 * HD)) if rope else (I // 128, 0)  # Q: groups of 4 heads (one KV head's)
    gs = 4 * HD if rope else 128
    return dict(x="*bf16", w=w, w_up=w, ws="*fp32", wus="*fp32", out="*bf16", mask="*u8", live_list="*i32",
                M=1, N=n, K=D, G=G, GE=GE, sxm=D, swn=D, som=H * HD if rope else I, cos="*bf16", sin="*bf16",
                slot="*i32", k_dst="*bf16", v_dst="*bf16", NQ=H * HD if rope else 0, NK=HKV * HD if rope else 0, T=1,
                sdb=HKV * CTX * HD, sdh=CTX * HD if rope else 0, sdt=HD if rope else 0, GS=gs,
                GP=triton.next_power_of_2(G + GE), BT=1, BN=kernels_base.pow2_divisor(gs, cfg["BN"]), BK=cfg["BK"],
                FUSED=fused, FP8=fp8, IEEE=False, HALF=HD // 2 if rope else 0, EVICT=cfg.get("evict", ""),
                PIPE=cfg.get("PIPE", 0), z="*fp32", rw="*fp32", rb="*fp32", keepf="*fp32", live="*i32", R=32,
                DECIDE=True, RP=32, PDL=1)  # a one-token step: the GEMV applies the router's rule (its R = 32 ranks)


def attention_args(cfg):
    return dict(q="*bf16", k="*bf16", v="*bf16", head_mask="*u8", kv_len="*i32", po="*fp32", plse="*fp32",
                tickets="*i32", o="*bf16", B=1, G=HKV, NP=2 * HKV, TARGET=cfg["programs_per_sm"] * 132,
                sqb=H * HD, sqh=HD, skb=HKV * CTX * HD, skh=CTX * HD, skt=HD, svb=HKV * CTX * HD, svh=CTX * HD, svt=HD,
                sob=H * HD, soh=HD, qk_scale=0.1275, HKV=HKV, HPK=H // HKV, HPG=H // HKV, H2=H, BJ=HKV,
                BH=16, BN=cfg["BN"], MC=cfg["max_chunks"], D=HD, IEEE=False, PDL=1)


def gate_up_tile_args(cfg, paired, lab=False):
    """The prefill gate+up tile's arguments for a 2048-token chunk (kernels.GEMM_MN_KERNEL, or the lab's kernel
    with gate and up interleaved: research/gate_up_lab.py)."""
    common = dict(x="*bf16", w="*bf16", out="*bf16", counts="*i32", perm="*i32", work="*i32", M=2048, K=D, NT=16,
                  sxm=D, som=I, GS=128, BM=kernels_base.CONFIGS["block_m"], BN=cfg["BN"], BK=cfg["BK"], IEEE=False)
    if lab:
        return dict(common, GATHER=1)
    return dict(common, w_up="*bf16", N=I, swn=D, FUSED=True, ZERO=True, EVEN_K=True, PAIRED=paired)


def cases():
    """(name, CONFIGS key, config, kernel, arguments, weight codes one thread reads per loop step or None)"""
    out = []
    for key, fp8 in (("gemv_mn_1_fused", False), ("gemv_mn_1_fused_fp8", True)):
        cfg = kernels_base.CONFIGS[key]
        per_thread = 2 * cfg["BN"] * cfg["BK"] // (32 * cfg["num_warps"])
        out.append((f"gate+up, {'fp8' if fp8 else 'bf16'}", key, kernels_gemv.GEMV_KERNEL,
                    gemv_args(cfg, True, fp8, False), per_thread))
    for key, fp8 in (("gemv_mn_1", False), ("gemv_mn_1_fp8", True)):
        cfg = kernels_base.CONFIGS[key]
        out.append((f"Q, K, V + RoPE, {'fp8' if fp8 else 'bf16'}", key, kernels_gemv.GEMV_KERNEL,
                    gemv_args(cfg, False, fp8, True), cfg["BN"] * cfg["BK"] // (32 * cfg["num_warps"])))
    out.append(("decode attention", "attn_decode", kernels_attention.DECODE_KERNEL,
                attention_args(kernels_base.CONFIGS["attn_decode"]), None))
    out = [(name, key, kernels_base.CONFIGS[key], *rest) for name, key, *rest in out]
    # prefill: the gate+up tile as CONFIGS runs it, the same with config PAIRED, and the lab kernel it follows
    cfg = kernels_base.CONFIGS["gemm_mn_fused"]
    paired = dict(cfg, PAIRED=True)
    per_thread = 2 * cfg["BN"] * cfg["BK"] // (32 * cfg["num_warps"])
    out += [("gate+up prefill tile, 2048 tokens", "gemm_mn_fused", cfg, kernels.GEMM_MN_KERNEL,
             gate_up_tile_args(cfg, False), per_thread),
            ("the same, config PAIRED", "gemm_mn_fused", paired, kernels.GEMM_MN_KERNEL,
             gate_up_tile_args(cfg, True), per_thread),
            ("the same, research.gate_up_lab's kernel", "gemm_mn_fused", cfg, lab_gate_up,
             gate_up_tile_args(cfg, True, lab=True), per_thread)]
    return out


def main(argv=None):
    p = cli.parser(__doc__, "python -m research.sass")
    p.add_argument("--out", default="results/kernels_sass_sm90", help="output path prefix for .json/.md")
    args = p.parse_args(argv)
    cli.writable_dir(os.path.dirname(args.out) or ".", "--out")
    if kernels_base.INTERPRET:
        raise cli.UserError("research.sass builds the GPU kernels with their GPU sizes: run it without "
                            "TRITON_INTERPRET=1 (the interpreter's sizes replace them)")
    rows = []
    for name, key, cfg, fn, kargs, per_thread in cases():
        k = compile_sm90(fn, kargs, cfg["num_warps"], cfg["num_stages"])
        regs, ops = read_binary(k.asm["cubin"])
        threads = 32 * cfg["num_warps"]
        rows.append(dict(op=name, key=key, config=cfg, registers=regs, threads=threads,
                         programs_per_sm=min(65536 // (regs * threads), 2048 // threads,
                                             SHARED_PER_SM // max(k.metadata.shared, 1)), shared=k.metadata.shared,
                         instructions=sum(ops.values()), ops=dict(ops.most_common()), codes_per_step=per_thread))
        print(f"{name}: {regs} registers, {sum(ops.values())} instructions", flush=True)
    lines = ["# The one-token decode kernels and the prefill gate+up tile as compiled for sm_90a", "",
             f"triton {triton.__version__} (its ptxas and cuobjdump), {datetime.date.today()}, `python -m research.sass` "
             "(any machine: no GPU is used). Llama-3.1-8B shapes, "
             "bf16 activations, the sizes of kernels_base.CONFIGS. Counts are static: every instruction of the binary "
             "once (loop body, prologue, epilogue). 'programs per SM' is what the registers (65536 per SM) and "
             "shared memory (228 KB) allow; "
             "'weights per step' is the weight elements one thread reads in one step of the kernel's loop.", "",
             "| op | CONFIGS key | registers | threads | programs per SM | shared KB | instructions | weights per step "
             "| most frequent |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        top = ", ".join(f"{op} {n}" for op, n in list(r["ops"].items())[:8])
        lines.append(f"| {r['op']} | {r['key']} | {r['registers']} | {r['threads']} | {r['programs_per_sm']} | "
                     f"{r['shared'] / 1024:.0f} | {r['instructions']} | {r['codes_per_step'] or ''} | {top} |")
    meta = dict(device="none: built for sm_90a (NVIDIA Hopper: H100, H200) on this machine, no GPU used",
                target="sm_90a", triton=triton.__version__, date=str(datetime.date.today()),
                command="python -m research.sass")
    save(args.out, dict(meta=meta, rows=rows), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    cli.run(main)
