#!/usr/bin/env python3
"""Compile ``lut_b_moe_gemm_kernel`` for sm_90 WITHOUT a GPU and count SASS in the main K loop.

Uses triton's own compiler with a fixed ``GPUTarget("cuda", 90, 32)`` (bundled ptxas) and its
bundled ``cuobjdump``. The main loop is taken as the largest backward-branch body that holds
tensor-core instructions (HMMA/HGMMA); "instr/weight" divides its length by the weights one
thread decodes per iteration (BLOCK_N * 32 * groups_per_iteration / threads).

    PYTHONPATH=kernels python3 bench/sass_offline.py            # the table of the default variants
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lutb_kernels._lut_b_gemm_details.kernels import lut_b_moe_gemm_kernel

TOOL = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def compile_variant(block_m: int, block_n: int, warps: int, g: int, *, decoder: int = 1, a_deq: bool = True,
                    tile_loop: bool = True, prefetch: bool = True, split_k: int = 2, stages: int = 3,
                    swap: bool = True, maxnreg: int | None = None, unroll: int = 1,
                    stream_k: bool = False, rotated: bool = False) -> tuple[str, int, int]:
    """SASS of one variant, its registers per thread and its local-memory bytes (spills) per thread.

    (``CompiledKernel.n_regs``/``n_spills`` are only filled when a GPU loads the cubin; the
    cubin's resource usage from ``cuobjdump`` holds the same numbers.)
    """
    sig = {
        "a_ptr": "*bf16" if a_deq else "*u8", "as_ptr": "*u8" if not a_deq else "*bf16", "w_bytes_ptr": "*u8",
        "w_words_ptr": "*i32", "out_ptr": "*bf16", "ws_ptr": "*fp32", "counters_ptr": "*i32", "topk_w_ptr": "*fp32", "sorted_ptr": "*i32",
        "eid_ptr": "*i32", "ntpp_ptr": "*i32", "N": "i32", "K": "i32", "num_valid": "i32", "tiles_per_split": "i32",
        "num_programs": "i32", "num_route_blocks": "i32", "stride_am": "i32", "stride_asm": "i32", "stride_om": "i32",
    }
    consts = dict(TOP_K=1, ROUTE_BLOCK=max(16, block_m), BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split_k,
                  MUL_WEIGHT=False, DECODER=decoder, A_PERMUTED=True, A_DEQUANTIZED=a_deq, SWAP_AB=swap,
                  DOT_BF16=True, G=g, TILE_LOOP=tile_loop, PREFETCH=prefetch, UNROLL=unroll,
                  STREAM_K=stream_k, KERNEL_LAYOUT=rotated)
    for k, v in consts.items():
        sig[k] = "constexpr"
    # pointers 16-byte aligned, N/K/strides multiples of 16 (what triton specializes on at launch)
    aligned = [[i] for i, name in enumerate(sig) if name in ("a_ptr", "as_ptr", "w_bytes_ptr", "w_words_ptr", "out_ptr", "ws_ptr",
                                                          "topk_w_ptr", "sorted_ptr", "eid_ptr", "ntpp_ptr", "N", "K", "stride_am", "stride_om")]
    src = ASTSource(fn=lut_b_moe_gemm_kernel, signature=sig, constexprs={(list(sig).index(k),): v for k, v in consts.items()},
                    attrs={tuple(a): [["tt.divisibility", 16]] for a in aligned})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages,
                                                                         **({"maxnreg": maxnreg} if maxnreg else {})})
    cubin = Path("/tmp/sass_offline.cubin")
    cubin.write_bytes(ck.asm["cubin"])
    sass = subprocess.run([str(TOOL), "--dump-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([str(TOOL), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    local = re.search(r"LOCAL:(\d+)", res)
    return sass, int(regs.group(1)) if regs else -1, int(local.group(1)) if local else -1


def main_loop(sass: str) -> tuple[list[str], dict]:
    """Instructions of the largest loop (a branch backwards) that contains HMMA/HGMMA."""
    ins = []
    for line in sass.splitlines():
        m = LINE.match(line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), m.group(4)))
    addr = {a: i for i, (a, _, _) in enumerate(ins)}
    best: list = []
    for i, (a, op, rest) in enumerate(ins):
        if op.startswith("BRA"):
            t = re.search(r"0x([0-9a-f]+)", rest)
            if t and int(t.group(1), 16) <= a and int(t.group(1), 16) in addr:
                body = ins[addr[int(t.group(1), 16)]: i + 1]
                if any(o.startswith(("HMMA", "HGMMA")) for _, o, _ in body) and len(body) > len(best):
                    best = body
    counts = collections.Counter(o.split(".")[0] for _, o, _ in best)
    return [f"{o}{r}" for _, o, r in best], counts


VARIANTS = {
    # name: (block_m, block_n, warps, G, kwargs)
    "old: 16,128,w4,G1 per-group loop": (16, 128, 4, 1, dict(tile_loop=False, prefetch=False)),
    "old: 64,128,w4,G1 per-group loop": (64, 128, 4, 1, dict(tile_loop=False, prefetch=False)),
    "old: 128,128,w8,G1 per-group loop": (128, 128, 8, 1, dict(tile_loop=False, prefetch=False, split_k=1)),
    "16,128,w4 tile loop": (16, 128, 4, 1, dict(tile_loop=True, prefetch=False)),
    "16,128,w4 tile loop s4": (16, 128, 4, 1, dict(tile_loop=True, prefetch=False, stages=4)),
    "16,128,w4 tile loop+reg prefetch": (16, 128, 4, 1, dict(tile_loop=True, prefetch=True)),
    "16,64,w4 tile loop": (16, 64, 4, 1, dict(tile_loop=True, prefetch=False)),
    "16,64,w2 tile loop": (16, 64, 2, 1, dict(tile_loop=True, prefetch=False)),
    "32,128,w4 tile loop": (32, 128, 4, 1, dict(tile_loop=True, prefetch=False)),
    "64,128,w4 tile loop": (64, 128, 4, 1, dict(tile_loop=True, prefetch=False)),
    "128,128,w8 tile loop": (128, 128, 8, 1, dict(tile_loop=True, prefetch=False, split_k=1)),
    "16,128,w4 tile loop e4m3 A": (16, 128, 4, 1, dict(tile_loop=True, prefetch=False, a_deq=False)),
}
# the same tile-loop variants with the "prmt2" decoder (DECODER=2)
VARIANTS.update({f"{name} prmt2": (bm, bn, w, g, dict(kw, decoder=2))
                 for name, (bm, bn, w, g, kw) in list(VARIANTS.items()) if kw.get("tile_loop")})
# the decode default with its K loop unrolled (LutBGemmConfig.unroll): "loop" then holds that many tiles
VARIANTS.update({f"16,128,w4 tile loop prmt2 unroll={u}": (16, 128, 4, 1, dict(tile_loop=True, prefetch=False, decoder=2, unroll=u))
                 for u in (2, 4)})
# register caps on the decode default (ncu: 127 registers hold an SM to 4 blocks of 4 warps)
VARIANTS.update({f"16,128,w4 tile loop prmt2 maxnreg={r}": (16, 128, 4, 1, dict(tile_loop=True, prefetch=False, decoder=2, maxnreg=r))
                 for r in (96, 80, 64)})
# the decode default on a stream-K grid (LutBGemmConfig.stream_k): the same K loop inside a loop over units
VARIANTS["16,128,w4 tile loop prmt2 stream-K"] = (16, 128, 4, 1, dict(tile_loop=True, prefetch=False, decoder=2, stream_k=True))
# tiles in the kernel layout (how the packed experts keep them; lutb_kernels.tiles.to_kernel_layout)
VARIANTS.update({f"{name} rotated": (bm, bn, w, g, dict(kw, rotated=True)) for name, (bm, bn, w, g, kw) in list(VARIANTS.items())
                 if name in ("16,128,w4 tile loop prmt2", "16,128,w4 tile loop", "128,128,w8 tile loop",
                             "128,128,w8 tile loop prmt2", "16,128,w4 tile loop prmt2 stream-K")})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="substring of a variant name")
    ap.add_argument("--dump", type=Path, default=None, help="write each variant's loop SASS here")
    args = ap.parse_args()
    keys = ("PRMT", "LOP3", "SHF", "IMAD", "IADD3", "HMMA", "HGMMA", "LDG", "LDS", "STS", "BAR", "F2FP", "HFMA2", "MOV", "SEL")
    print(f"{'variant':38s} {'loop':>5s} {'w/thr':>6s} {'i/w':>5s} {'regs':>4s} " + " ".join(f"{k:>5s}" for k in keys)
          + "  LDG widths")
    for name, (bm, bn, warps, g, kw) in VARIANTS.items():
        if args.only and args.only not in name:
            continue
        try:
            sass, regs, spills = compile_variant(bm, bn, warps, g, **kw)
        except Exception as exc:  # noqa: BLE001
            print(f"{name:38s} compile failed: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        body, counts = main_loop(sass)
        per_iter = 4 * kw.get("unroll", 1) if kw.get("tile_loop") else g  # 32-column groups per loop iteration
        w_thr = bn * 32 * per_iter / (32 * warps)
        widths = collections.Counter(re.match(r"(LDG\S*)", ln).group(1) for ln in body if ln.startswith("LDG"))
        spill = f" SPILLS(local {spills} B)" if spills or "STL" in sass else ""
        print(f"{name:38s} {len(body):5d} {w_thr:6.0f} {len(body) / w_thr:5.2f} {regs:4d} "
              + " ".join(f"{counts.get(k, 0):5d}" for k in keys) + "  " + ",".join(f"{k}x{v}" for k, v in sorted(widths.items())) + spill)
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / (re.sub(r"\W+", "_", name) + ".sass")).write_text("\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
