"""The routing kernel compiles for sm_90 without a GPU (triton's bundled ptxas), in every mode.

Runs in a subprocess without ``TRITON_INTERPRET`` (the interpreter tests set it for this
process), so a kernel the interpreter accepts but the compiler refuses fails here, on the CPU.
"""

from __future__ import annotations

from sm90_compile import run_compile_script

_SCRIPT = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lutb_kernels._routing_details.kernels import moe_align_block_size_kernel as kernel

# (ids, map, HAS_HELD, ONEHOT, E_PAD, RANK_C, HIST_C, FILL_C): decode and prefill shapes of both modes
VARIANTS = [
    ("*i32", "*i32", True, True, 16, 16, 16, 256),
    ("*i64", "*i64", False, True, 16, 512, 1024, 1024),
    ("*i32", "*i32", True, True, 64, 128, 1024, 1024),
    ("*i32", "*i32", True, False, 256, 16, 16, 1024),
    ("*i32", "*i32", False, False, 512, 128, 1024, 1024),
]
for ids_t, map_t, has_held, onehot, e_pad, rank_c, hist_c, fill_c in VARIANTS:
    sig = {"ids_ptr": ids_t, "map_ptr": map_t, "sorted_ptr": "*i32", "expert_ids_ptr": "*i32", "total_ptr": "*i32",
           "run_ptr": "*i32", "held_ptr": "*i8", "R": "i32", "E": "i32", "BM": "i32", "MAX_PADDED": "i32", "NUM_BLOCKS": "i32"}
    consts = dict(HAS_MAP=True, HAS_HELD=has_held, ONEHOT=onehot, E_PAD=e_pad, RANK_C=rank_c, HIST_C=hist_c, FILL_C=fill_c)
    if rank_c == 16 and onehot:  # integer arguments equal to 1 are specialised to constants at launch
        consts.update(R=1, E=1, BM=1)
    sig.update({k: "constexpr" for k in consts})
    src = ASTSource(fn=kernel, signature=sig, constexprs={(list(sig).index(k),): v for k, v in consts.items()}, attrs={})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"], (ids_t, map_t, onehot, e_pad)
print("compiled", len(VARIANTS))
'''


def test_kernel_compiles_for_sm90() -> None:
    assert "compiled 5" in run_compile_script(_SCRIPT)
