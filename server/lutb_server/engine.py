"""The expert engine: a checkpoint's layers on one backend, and the checks every request passes.

It knows nothing of gRPC: the servicer decodes messages into tensors, the engine
validates them (:meth:`ExpertEngine.prepare`, raising errors that name the field)
and runs experts calls (:meth:`ExpertEngine.forward`). Pooling is the scheduler's job.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
import torch

from lutb_client.codec import WireTensor, as_tensor, host_array
from lutb_kernels.checkpoint import CHECKSUMS, Checkpoint, CheckpointConfig
from lutb_kernels.experts.base import LayerExperts
from lutb_kernels.reference import OutputMode
from lutb_server.backends import BackendChoice
from lutb_server.errors import InvalidArgument, LayerNotFound

log = logging.getLogger(__name__)

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ID_DTYPES = (torch.int32, torch.int64)
OUTPUT_MODES: tuple[OutputMode, ...] = ("combined", "route_major")


_FLOAT_BITS: dict[torch.dtype, tuple[np.dtype, int]] = {
    torch.bfloat16: (np.dtype("<u2"), 0x7F80),
    torch.float16: (np.dtype("<u2"), 0x7C00),
    torch.float32: (np.dtype("<u4"), 0x7F800000),
}
"""Per float dtype: its bit patterns' numpy dtype, and its exponent mask."""

HostTensor = Union[torch.Tensor, WireTensor]
"""A request tensor on the host: a torch CPU tensor, or still the bytes it came in (the servicer's)."""


def _nonfinite(t: HostTensor) -> int:
    """How many values of ``t`` (bfloat16, float16 or float32) are NaN or Inf: those whose exponent bits are all ones.

    Numpy on the bit patterns, no torch call for a :class:`WireTensor`: every request's hidden states and weights
    pass here on the event loop, where each torch call costs several microseconds (more with cold caches). The
    common case is one masking pass and one reduction.
    """
    bits_dtype, mask = _FLOAT_BITS[t.dtype]
    bits = host_array(t).view(bits_dtype)
    if not bits.size:
        return 0
    exponents = np.bitwise_and(bits, mask)
    if int(exponents.max()) != mask:
        return 0
    return int(np.count_nonzero(exponents == mask))


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready to pool: host tensors in the dtypes the backends take.

    ``x``: ``[T, H]`` model dtype; ``topk_ids``: int32 ``[T, k]``; ``topk_weights``: float32 ``[T, k]``. Each is a CPU
    torch tensor, or, as the servicer decoded it, a :class:`~lutb_client.codec.WireTensor` (bytes): a compute process
    takes those bytes into its shared memory as they are; code that computes on them makes a tensor
    (:func:`~lutb_client.codec.as_tensor`).

    MXFP8 input carried to the device as sent (:meth:`ExpertEngine.prepare` on a CUDA engine): ``x`` is
    float8_e4m3fn ``[T, H]`` without NaN codes, ``x_scales`` its uint8 E8M0 scales ``[T, H/32]``, each at most
    ``lutb_kernels.mxfp8.mxfp8_max_finite_scale(x_dtype)``, and ``x_dtype`` the model dtype; the compute worker
    dequantizes them on the device, bit for bit the model-dtype ``x`` the engine would have made on the CPU
    (:meth:`dense_x` does it where the request is).
    """

    layer: int
    x: HostTensor
    topk_ids: HostTensor
    topk_weights: HostTensor
    apply_router_weight_on_input: bool
    output_mode: OutputMode
    x_scales: HostTensor | None = None
    x_dtype: torch.dtype | None = None

    @property
    def tokens(self) -> int:
        return int(self.x.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        """The model dtype: ``x``'s once dequantized, and the output's."""
        return self.x.dtype if self.x_dtype is None else self.x_dtype

    @property
    def output_shape(self) -> list[int]:
        """The output's shape: ``[T, H]`` (combined) or ``[T, k, H]`` (route-major)."""
        tokens, hidden = (int(n) for n in self.x.shape)
        return [tokens, int(self.topk_ids.shape[1]), hidden] if self.output_mode == "route_major" else [tokens, hidden]

    @property
    def output_bytes(self) -> int:
        """Bytes of the output (:attr:`output_shape` in the model dtype)."""
        return math.prod(self.output_shape) * self.dtype.itemsize

    @property
    def pool_key(self) -> tuple[int, int, bool, str, torch.dtype]:
        """Requests with equal keys can share one experts call: same layer, top-k, weighting, output mode, and the
        same form of ``x`` (model dtype, or MXFP8 carried to the device)."""
        return (self.layer, int(self.topk_ids.shape[1]), self.apply_router_weight_on_input, self.output_mode, self.x.dtype)

    def dense_x(self) -> torch.Tensor:
        """``x`` as a torch tensor in the model dtype (MXFP8 input dequantized here, on ``x``'s device)."""
        if self.x_scales is None:
            return as_tensor(self.x)
        from lutb_kernels.mxfp8 import mxfp8_dequantize_fast

        return mxfp8_dequantize_fast(as_tensor(self.x), as_tensor(self.x_scales), self.dtype)


class ExpertEngine:
    """A checkpoint's MoE layers loaded on one backend and device.

    Args:
        checkpoint: the opened checkpoint.
        backend: the chosen backend class and device (see :func:`lutb_server.backends.choose_backend`).
        max_tokens_per_request: requests with more tokens are refused.
        max_top_k: requests with more routes per token (``topk_ids``' k) are refused.
        validate_tiles: check every tile of every layer before loading it, and (where ``content_hash`` is None: the
            first process to open the checkpoint) every file's bytes against the checkpoint's ``SHA256SUMS``.
        progress: optional wrapper around the layer iteration (e.g. tqdm).
        load_experts: False reads only which experts each layer holds (no weights): enough to
            validate requests and describe the model, for a process whose compute runs in another
            (:class:`~lutb_server.worker_process.ProcessComputeWorker`); :meth:`forward`,
            :meth:`layer_experts` and :attr:`weight_bytes` need the experts.
        content_hash: ``checkpoint.content_hash()`` as another process of the same server computed it from the
            same checkpoint path (front end 0 hands it to the processes it spawns): it reads every byte, seconds
            to minutes for a large checkpoint. None: computed here (and logged with its time).
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        backend: BackendChoice,
        *,
        max_tokens_per_request: int = 4096,
        max_top_k: int = 32,
        validate_tiles: bool = True,
        progress: Callable[[list[int]], object] | None = None,
        load_experts: bool = True,
        content_hash: str | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.config: CheckpointConfig = checkpoint.config
        self.backend = backend
        self.device = backend.device
        self.max_tokens_per_request = max_tokens_per_request
        self.max_top_k = max_top_k
        if content_hash is None:
            if validate_tiles:  # the first process to open the checkpoint; the others compare its identity to this one's
                verifying = time.perf_counter()
                if checkpoint.verify_files():
                    log.info("checked %d file(s) of %s against %s in %.2fs", len(checkpoint.checksums or ()), checkpoint.path,
                             CHECKSUMS, time.perf_counter() - verifying)
                else:
                    log.warning("%s has no %s: its files' integrity is not checked (checkpoints written by lutb have "
                                "one)", checkpoint.path, CHECKSUMS)
            hashing = time.perf_counter()
            content_hash = checkpoint.content_hash()
            log.info("hashed %s in %.2fs: %s", checkpoint.path, time.perf_counter() - hashing, content_hash[:19])
        self.content_hash = content_hash
        self.model_dtype = self.config.torch_dtype
        start = time.perf_counter()
        self._layers: dict[int, LayerExperts] = {}
        self._expert_ids: dict[int, list[int]] = {}
        layers = checkpoint.layers
        for layer in progress(layers) if progress else layers:  # type: ignore[union-attr]
            if not load_experts:
                self._expert_ids[layer] = checkpoint.expert_ids(layer).tolist()
                continue
            weights = checkpoint.layer(layer, tiles=validate_tiles)
            self._layers[layer] = backend.cls(self.config, weights, self.device)
            self._expert_ids[layer] = self._layers[layer].expert_ids.tolist()
        if load_experts:
            log.info(
                "loaded %d layer(s) of %s on %s with backend %s in %.2fs",
                len(self._layers), checkpoint.path, self.device, backend.name, time.perf_counter() - start,
            )

    @classmethod
    def open(cls, path: str | Path, backend: BackendChoice, **kwargs: object) -> ExpertEngine:
        """Open the checkpoint at ``path`` and load it (keyword arguments as for the constructor)."""
        return cls(Checkpoint(path), backend, **kwargs)  # type: ignore[arg-type]

    @property
    def layer_ids(self) -> list[int]:
        return sorted(self._expert_ids)

    def expert_ids(self, layer: int) -> list[int]:
        """Global ids of the experts held in ``layer``, ascending."""
        return self._expert_ids[layer]

    def layer_experts(self, layer: int) -> LayerExperts:
        """The backend object running ``layer`` (the compute worker calls it directly).

        Raises:
            RuntimeError: the engine was made with ``load_experts=False``.
        """
        if layer in self._expert_ids and not self._layers:
            raise RuntimeError("this engine holds no experts (load_experts=False): its compute runs in another process")
        return self._layers[layer]

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights the backend holds on its device, all layers."""
        return sum(experts.weight_bytes for experts in self._layers.values())

    def _mxfp8_input(self, q: HostTensor, scales: HostTensor) -> tuple[HostTensor, HostTensor | None]:
        """Validate MXFP8 input on the wire (spec section 3), and return ``(x, x_scales)`` for a
        :class:`PreparedRequest`: on a CUDA engine the bytes as sent with their scales (the compute worker
        dequantizes them on the device); elsewhere, or when a scale is too large for that, ``float32(e) *
        2**(s - 127)`` rounded to the model dtype here, and None.

        Raises:
            InvalidArgument: the message names the field.
        """
        from lutb_kernels.mxfp8 import BLOCK, e4m3_nan_count, mxfp8_dequantize_fast, mxfp8_dequantize_into, mxfp8_max_finite_scale

        hidden = self.config.hidden_size
        if q.dtype != torch.float8_e4m3fn:
            raise InvalidArgument(f"hidden_states: dtype {q.dtype} not allowed with hidden_scales; MXFP8 input is float8_e4m3fn [T, {hidden}]")
        if len(q.shape) != 2 or q.shape[1] != hidden:
            raise InvalidArgument(f"hidden_states: shape {list(q.shape)} does not match [T, {hidden}] (hidden size {hidden})")
        tokens = int(q.shape[0])
        if tokens > self.max_tokens_per_request:
            raise InvalidArgument(f"hidden_states: {tokens} tokens exceed max_tokens_per_request = {self.max_tokens_per_request}")
        if scales.dtype != torch.uint8:
            raise InvalidArgument(f"hidden_scales: dtype {scales.dtype} not allowed; expected uint8 (E8M0)")
        if len(scales.shape) != 2 or scales.shape[0] != tokens or scales.shape[1] != hidden // BLOCK:
            raise InvalidArgument(
                f"hidden_scales: shape {list(scales.shape)} does not match [T, H/{BLOCK}] = [{tokens}, {hidden // BLOCK}] (hidden_states {list(q.shape)})"
            )
        scale_bytes = host_array(scales)
        largest = int(scale_bytes.max()) if scale_bytes.size else 0
        if largest == 255:  # E8M0's NaN; locate the culprit
            bad = np.argwhere(scale_bytes == 255)
            row, block = (int(v) for v in bad[0])
            raise InvalidArgument(f"hidden_scales: {len(bad)} scale byte(s) are 255 (E8M0 NaN), first at row {row}, block {block}")
        nan = e4m3_nan_count(host_array(q))
        if nan:
            raise InvalidArgument(f"hidden_states: {nan} MXFP8 value(s) are NaN (e4m3 codes 0x7F/0xFF)")
        if largest <= mxfp8_max_finite_scale(self.model_dtype):  # every value finite: no pass over x to check it
            if self.device.type == "cuda":
                return q, scales
            # (the largest scale is known: straight to the bit operations, without mxfp8_dequantize_fast's own read of it)
            return mxfp8_dequantize_into(as_tensor(q), as_tensor(scales), torch.empty(q.shape, dtype=self.model_dtype)), None
        x = mxfp8_dequantize_fast(as_tensor(q), as_tensor(scales), self.model_dtype)
        count = _nonfinite(x)
        if count:
            raise InvalidArgument(
                f"hidden_states: {count} MXFP8 value(s) are NaN or overflow {self.model_dtype} when dequantized (hidden_scales too large?)"
            )
        return x, None

    def prepare(
        self,
        layer: int,
        hidden_states: HostTensor,
        topk_ids: HostTensor,
        topk_weights: HostTensor,
        *,
        hidden_scales: HostTensor | None = None,
        apply_router_weight_on_input: bool = False,
        output_mode: str = "combined",
    ) -> PreparedRequest:
        """Validate one request and convert it for the backends.

        Each tensor is a CPU torch tensor or a :class:`~lutb_client.codec.WireTensor` (the checks read both through
        numpy, without torch calls; a WireTensor that needs no conversion stays one in the result).
        ``hidden_states`` of another float dtype is rounded to the model dtype (round to
        nearest even), then checked for NaN/Inf. ``topk_ids`` become int32.

        With ``hidden_scales`` (uint8 ``[T, H/32]``), ``hidden_states`` is MXFP8 (float8_e4m3fn ``[T, H]``): the
        request computes on ``float32(e) * 2**(s - 127)`` rounded to the model dtype. On a CUDA engine it is carried
        to the device as sent and dequantized there (see :class:`PreparedRequest`); elsewhere dequantized here.

        Raises:
            LayerNotFound: ``layer`` is not held here.
            InvalidArgument: anything else wrong; the message names the field.
        """
        if layer not in self._expert_ids:
            raise LayerNotFound(f"layer {layer} is not held by this server; it holds layers {self.layer_ids}")
        x, ids, w = hidden_states, topk_ids, topk_weights
        x_scales: HostTensor | None = None
        hidden = self.config.hidden_size
        if hidden_scales is not None:
            x, x_scales = self._mxfp8_input(x, hidden_scales)
        elif x.dtype not in FLOAT_DTYPES:
            raise InvalidArgument(f"hidden_states: dtype {x.dtype} not allowed; send {self.model_dtype} (or bfloat16/float16/float32, rounded to it)")
        elif len(x.shape) != 2 or x.shape[1] != hidden:
            raise InvalidArgument(f"hidden_states: shape {list(x.shape)} does not match [T, {hidden}] (hidden size {hidden})")
        tokens = int(x.shape[0])
        if tokens > self.max_tokens_per_request:
            raise InvalidArgument(f"hidden_states: {tokens} tokens exceed max_tokens_per_request = {self.max_tokens_per_request}")
        if ids.dtype not in ID_DTYPES:
            raise InvalidArgument(f"topk_ids: dtype {ids.dtype} not allowed; expected int32 or int64")
        if len(ids.shape) != 2 or ids.shape[0] != tokens or ids.shape[1] < 1:
            raise InvalidArgument(f"topk_ids: shape {list(ids.shape)} does not match [T, k] with T = {tokens} (hidden_states) and k >= 1")
        if ids.shape[1] > self.config.num_experts:  # a router picks k of the E experts; more only costs memory
            raise InvalidArgument(f"topk_ids: k = {ids.shape[1]} routes per token exceed the model's {self.config.num_experts} experts")
        if ids.shape[1] > self.max_top_k:
            raise InvalidArgument(f"topk_ids: k = {ids.shape[1]} routes per token exceed max_top_k = {self.max_top_k}")
        if w.dtype != torch.float32:
            raise InvalidArgument(f"topk_weights: dtype {w.dtype} not allowed; expected float32")
        if tuple(w.shape) != tuple(ids.shape):
            raise InvalidArgument(f"topk_weights: shape {list(w.shape)} does not match topk_ids shape {list(ids.shape)}")
        if output_mode not in OUTPUT_MODES:
            raise InvalidArgument(f"output_mode: {output_mode!r} is not one of {', '.join(OUTPUT_MODES)}")
        if output_mode == "route_major" and apply_router_weight_on_input:
            raise InvalidArgument("output_mode: route_major cannot be combined with apply_router_weight_on_input")
        if apply_router_weight_on_input and ids.shape[1] != 1:
            raise InvalidArgument(f"apply_router_weight_on_input: needs top-k == 1, got k = {ids.shape[1]} (topk_ids)")
        num_experts = self.config.num_experts
        id_values = host_array(ids)
        if id_values.size:
            low, high = int(id_values.min()), int(id_values.max())
            if low < 0 or high >= num_experts:
                bad = low if low < 0 else high
                raise InvalidArgument(f"topk_ids: expert id {bad} outside the global range [0, {num_experts})")
        if _nonfinite(w):
            raise InvalidArgument("topk_weights: holds NaN or Inf")
        if ids.dtype != torch.int32:  # in range, so exact in int32
            ids = torch.from_numpy(id_values.astype(np.int32))
        if x_scales is not None:  # MXFP8 carried to the device, checked by _mxfp8_input
            return PreparedRequest(layer, x, ids, w, bool(apply_router_weight_on_input), output_mode,  # type: ignore[arg-type]
                                   x_scales, self.model_dtype)
        converted = x if x.dtype == self.model_dtype else as_tensor(x).to(self.model_dtype)
        count = 0 if hidden_scales is not None else _nonfinite(converted)  # MXFP8 dequantized here: checked by _mxfp8_input
        if count:
            after = f" after rounding {x.dtype} to {self.model_dtype}" if x.dtype != self.model_dtype else ""
            raise InvalidArgument(f"hidden_states: holds {count} NaN or Inf value(s){after}")
        return PreparedRequest(layer, converted, ids, w, bool(apply_router_weight_on_input), output_mode)  # type: ignore[arg-type]

    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: OutputMode = "combined",
    ) -> torch.Tensor:
        """Run ``layer``'s experts on a (pooled) batch already validated by :meth:`prepare`.

        Blocks until the result is on the CPU: ``[T, H]`` (combined) or ``[T, k, H]``
        (route-major) in the model dtype. Call it from a worker thread, not an event loop.
        """
        experts = self.layer_experts(layer)
        out = experts.forward(
            x.to(self.device, non_blocking=True),
            topk_ids.to(self.device, non_blocking=True),
            topk_weights.to(self.device, non_blocking=True),
            apply_router_weight_on_input=apply_router_weight_on_input,
            output_mode=output_mode,
        )
        return out.to("cpu")

    def forward_prepared(self, request: PreparedRequest) -> torch.Tensor:
        """:meth:`forward` on one prepared request."""
        return self.forward(
            request.layer, request.dense_x(), as_tensor(request.topk_ids), as_tensor(request.topk_weights),
            apply_router_weight_on_input=request.apply_router_weight_on_input, output_mode=request.output_mode,
        )


__all__ = ["ExpertEngine", "PreparedRequest"]
