#!/usr/bin/env python3
"""SASS instruction counts of the compiled ``lut_b_moe_gemm_kernel`` variants in Triton's cache.

Looks for ``lut_b_moe_gemm_kernel.cubin`` under ``$TRITON_CACHE_DIR`` (default ``~/.triton/cache``),
disassembles each with ``cuobjdump --dump-sass`` (the system's or the one bundled with triton),
writes the SASS next to ``--out`` and prints opcode counts: the decode (PRMT, LOP3, SHF, IMAD,
IADD3), the tensor cores (HMMA/HGMMA), memory (LDG, LDS, STS) and conversions (F2FP, F2F, I2F).

    python3 bench/sass_summary.py --out $OUT/sass
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

KEY_OPS = ("PRMT", "LOP3", "SHF", "IMAD", "IADD3", "HMMA", "HGMMA", "LDG", "LDS", "STS", "F2FP", "F2F", "I2F", "HFMA2", "HMUL2", "FMUL", "FFMA", "BAR", "BRA")


def cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton

        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(cand) if cand.exists() else None
    except ImportError:
        return None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kernel", default="lut_b_moe_gemm_kernel")
    args = parser.parse_args()
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    tool = cuobjdump()
    cubins = sorted(cache.rglob(f"{args.kernel}.cubin"))
    if not cubins or tool is None:
        print(f"no {args.kernel}.cubin under {cache} or no cuobjdump ({tool})")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{'variant':40s} {'total':>6s} " + " ".join(f"{op:>6s}" for op in KEY_OPS))
    for i, cubin in enumerate(cubins):
        meta = {}
        js = cubin.with_suffix(".json")
        if js.exists():
            meta = json.loads(js.read_text())
        res = subprocess.run([tool, "--dump-sass", str(cubin)], capture_output=True, text=True)
        sass = res.stdout
        (args.out / f"{args.kernel}_{i}.sass").write_text(sass)
        ptx = cubin.with_suffix(".ptx")
        if ptx.exists():
            shutil.copy(ptx, args.out / f"{args.kernel}_{i}.ptx")
        ops = collections.Counter()
        for line in sass.splitlines():
            m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
            if m:
                ops[m.group(1)] += 1
        total = sum(ops.values())
        label = f"#{i} w{meta.get('num_warps', '?')} s{meta.get('num_stages', '?')} {meta.get('hash', '')[:8]}"
        print(f"{label:40s} {total:6d} " + " ".join(f"{ops.get(op, 0):6d}" for op in KEY_OPS))
        (args.out / f"{args.kernel}_{i}.counts.json").write_text(json.dumps({"meta": {k: v for k, v in meta.items() if isinstance(v, (int, str, float))}, "ops": ops}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
