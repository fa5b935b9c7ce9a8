"""The MXFP8 quantization kernel compiles for sm_90 without a GPU, in the modes the backends launch: every input
dtype (each with its own ``D_MAX``), the activations whose max/min must keep NaN (``propagate_nan``), all three
output modes, row weights and row masks."""

from __future__ import annotations

from sm90_compile import run_compile_script

_SCRIPT = r'''
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lutb_kernels._mxfp8_details import kernels as K

DTYPES = {"*bf16": torch.bfloat16, "*fp16": torch.float16, "*fp32": torch.float32}
# (x dtype, activation, out mode, decoder order, row weight, row mask)
VARIANTS = [
    ("*bf16", None, K.OUT_MXFP8, True, False, False),
    ("*fp16", None, K.OUT_MXFP8, True, True, False),
    ("*fp32", None, K.OUT_QDQ, False, False, False),
    ("*bf16", "silu", K.OUT_MXFP8, True, False, True),
    ("*fp16", "swigluoai", K.OUT_QDQ, False, False, True),
    ("*bf16", "relu2_no_mul", K.OUT_MXFP8, True, False, True),
    ("*bf16", "relu2_no_mul", K.OUT_PLAIN, False, False, False),
]
for x_t, act, out_mode, decoder, row_weight, row_mask in VARIANTS:
    q_t = "*u8" if out_mode == K.OUT_MXFP8 else x_t
    sig = {"x_ptr": x_t, "q_ptr": q_t, "s_ptr": "*u8", "row_w_ptr": "*fp32", "row_mask_ptr": "*i8", "flag_ptr": "*i32",
           "M": "i32", "K": "i32", "stride_xm": "i32", "stride_qm": "i32", "stride_sm": "i32"}
    consts = dict(ACT=K.ACT_IDS[act], GATE_UP_INTERLEAVED=act == "swigluoai", SCALE_MODE=0,
                  UNDERFLOW_SCALE=K.RCEIL_UNDERFLOW_SCALE, OUT_MODE=out_mode, PERMUTE_K=decoder,
                  HAS_ROW_WEIGHT=row_weight, HAS_ROW_MASK=row_mask, D_MAX=torch.finfo(DTYPES[x_t]).max,
                  BLOCK_R=16, BLOCK_K=256, PDL=False)
    sig.update({k: "constexpr" for k in consts})
    src = ASTSource(fn=K.mxfp8_quantize_kernel, signature=sig,
                    constexprs={(list(sig).index(k),): v for k, v in consts.items()}, attrs={})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"], (x_t, act, out_mode)
    if act in ("relu2_no_mul", "swigluoai"):  # PTX's plain min/max return the other operand of a NaN
        ptx = compiled.asm["ptx"]
        assert "max.NaN.f32" in ptx or "max.NaN.ftz.f32" in ptx, (act, "no NaN-propagating max")
print("compiled", len(VARIANTS))
'''


def test_kernel_compiles_for_sm90() -> None:
    assert "compiled 7" in run_compile_script(_SCRIPT)
