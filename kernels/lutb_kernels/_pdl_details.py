"""Programmatic dependent launch (PDL), the kernel side: every kernel of ours starts with :func:`pdl_prologue`.

A kernel launched with ``launch_pdl=True`` (see :func:`lutb_kernels._grouped_gemm_details.launch.use_pdl`)
may start while the kernel before it on the stream is still running; ``griddepcontrol.wait``
then blocks until that kernel has finished and its writes are visible. Waiting first thing,
before any load or store, keeps every kernel exactly as ordered as without PDL (a kernel that
waited has also seen everything its predecessor waited for); what overlaps is only the launch
and the programs' start-up. ``griddepcontrol.launch_dependents`` right after lets the next
kernel launch as soon as every program of this one has started (its programs then sit in their
own wait), instead of after this kernel's last program exits.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Wait for the previous kernel on the stream, then let the next one launch (PDL only; no-op otherwise)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
