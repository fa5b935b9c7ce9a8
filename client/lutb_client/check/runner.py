"""Run a check: send the same batches to two sides, compare, judge; or record one side's answers.

A *side* answers batches: :class:`NodeSide` (a live server), :class:`ReferenceSide`
(the local plain-PyTorch reference on a checkpoint) or :class:`RecordedSide` (the
answers kept in a record file). :func:`run_check` compares a target side with the
side it is checked against (the judge) and returns a :class:`~lutb_client.check.report.CheckReport`;
:func:`record_node` keeps a node's answers in a file (:mod:`lutb_client.check.record`).
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
import sys
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lutb_client.check.compare import ErrorStats, route_rows_by_expert
from lutb_client.check.record import Recording, check_writable, read_recording, write_recording
from lutb_client.check.report import POOLED, CheckReport, Row
from lutb_client.check.suites import (
    MESSAGE_MARGIN,
    STANDARD_TOKENS,
    Batch,
    NodeShape,
    headroom_probe,
    make_batches,
    message_tokens,
    resolve_suites,
)
from lutb_client.codec import dtype_name, to_torch_dtype

IDENTITY_FIELDS = ("content_hash", "mxfp8_scale_mode")
"""Fields two sides must share to be compared without ``force`` (spec section 3: the scale mode is identity)."""
SHAPE_FIELDS = ("hidden_size", "num_experts", "dtype")
"""Fields without which no comparison is possible, ``force`` or not."""
DEFAULT_TOKENS = 1024
DEFAULT_TOPK = 8


class CheckError(Exception):
    """The check cannot run (unreachable node, bad checkpoint or record, layers not held, sizes that differ)."""


class IdentityMismatch(CheckError):
    """The two sides serve different checkpoints or scale modes; ``differences`` says which fields."""

    def __init__(self, differences: list[dict[str, Any]], target: str, against: str) -> None:
        self.differences = differences
        parts = [f"{d['field']} differs: {target} has {d['target']}, {against} has {d['against']}" for d in differences]
        super().__init__("; ".join(parts))


def model_info_dict(info: Any) -> dict[str, Any]:
    """A ``lutb.v1.ModelInfo`` as plain JSON-ready data (integers as numbers, dtype by name)."""
    return {
        "format": info.format,
        "format_version": int(info.format_version),
        "hidden_size": int(info.hidden_size),
        "intermediate_size": int(info.intermediate_size),
        "num_experts": int(info.num_experts),
        "layers": [{"layer": int(layer.layer), "expert_ids": [int(e) for e in layer.expert_ids]} for layer in info.layers],
        "activation": info.activation,
        "dtype": dtype_name(info.dtype),
        "mxfp8_scale_mode": info.mxfp8_scale_mode,
        "backend": info.backend,
        "backend_reason": info.backend_reason,
        "device": info.device,
        "max_tokens_per_request": int(info.max_tokens_per_request),
        "max_batch_tokens": int(info.max_batch_tokens),
        "max_message_bytes": int(info.max_message_bytes),  # 0: not said (a server older than the field)
        "max_top_k": int(info.max_top_k),  # 0: not said
        "instance_id": info.instance_id,  # "": not said
        "content_hash": info.content_hash,
        "server_version": info.server_version,
    }


def model_dtype(info: dict[str, Any]) -> torch.dtype:
    """The torch model dtype of a :func:`model_info_dict`."""
    from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb

    return to_torch_dtype(pb.DataType.Value(info["dtype"]))


def _layers_of(info: dict[str, Any]) -> dict[int, list[int]]:
    return {int(entry["layer"]): [int(e) for e in entry["expert_ids"]] for entry in info["layers"]}


class Side:
    """Something that answers batches. ``address`` names it in reports; ``info`` is its ModelInfo as a dict.

    ``message_bytes`` is the largest request or response message the side takes (0: no bound): a node starts
    at its client's limit and lowers it when the node refuses a message as too large. ``splits`` says whether
    a batch may be sent to it in parts (a record answers whole batches only).
    """

    address: str
    kind: str
    info: dict[str, Any]
    message_bytes: int = 0
    splits: bool = True

    def forward(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"address": self.address, "kind": self.kind, "model_info": self.info}


class NodeSide(Side):
    """A live expert server."""

    kind = "node"

    def __init__(self, address: str, *, timeout: float = 120.0, max_message_bytes: int | None = None) -> None:
        from lutb_client.client import DEFAULT_MAX_MESSAGE_BYTES, ExpertClient
        from lutb_client.errors import ExpertServiceError

        self.address = address
        self.message_bytes = int(max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES)
        self.client = ExpertClient(address, timeout=timeout, retries=1, max_message_bytes=self.message_bytes)
        try:
            self.info = model_info_dict(self.client.model_info(timeout=min(timeout, 15.0)))
        except ExpertServiceError as exc:
            self.client.close()
            raise CheckError(f"{address}: {exc}") from None
        if self.info["max_message_bytes"]:  # the node's own bound, where it says it: requests fit the first time
            self.message_bytes = min(self.message_bytes, self.info["max_message_bytes"])

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.client.forward(
            batch.layer, batch.hidden_states, batch.topk_ids, batch.topk_weights,
            apply_router_weight_on_input=batch.apply_router_weight_on_input, output_mode=batch.output_mode,
        )

    def close(self) -> None:
        self.client.close()


class ReferenceSide(Side):
    """The local reference (``lutb_kernels`` ReferenceExperts) on a checkpoint directory; one layer loaded at a time."""

    kind = "reference"

    def __init__(self, checkpoint: str | Path, *, device: str = "auto") -> None:
        from lutb_kernels.checkpoint import Checkpoint
        from lutb_kernels.devices import resolve_compute_device
        from lutb_kernels.errors import LutBError

        try:
            self.checkpoint = Checkpoint(checkpoint)
        except LutBError as exc:
            raise CheckError(str(exc)) from None
        try:
            self.device = resolve_compute_device(device, who="the reference")
        except ValueError as exc:
            raise CheckError(str(exc)) from None
        self.address = "reference"
        config = self.checkpoint.config
        self.info = {
            "format": "lut-b",
            "format_version": 1,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_experts": config.num_experts,
            "layers": [{"layer": layer, "expert_ids": self.checkpoint.expert_ids(layer).tolist()}
                       for layer in self.checkpoint.layers],
            "activation": config.activation,
            "dtype": dtype_name(config.torch_dtype),
            "mxfp8_scale_mode": config.mxfp8_scale_mode,
            "backend": "reference",
            "backend_reason": f"local reference on {self.checkpoint.path}",
            "device": str(self.device),
            "max_tokens_per_request": 0,
            "max_batch_tokens": 0,
            "max_message_bytes": 0,
            "max_top_k": 0,
            "instance_id": "",
            "content_hash": self.checkpoint.content_hash(),
            "server_version": "",
            "checkpoint_path": str(self.checkpoint.path),
        }
        self._layer: int | None = None
        self._experts: Any = None

    def _experts_of(self, layer: int) -> Any:
        from lutb_kernels.errors import LutBError
        from lutb_kernels.experts.reference import ReferenceExperts

        if self._layer != layer:
            self._experts, self._layer = None, None  # release the previous layer before loading the next
            try:  # the judge checks its tiles (spec section 1) as a server does: a bad one is named, not met as NaN
                weights = self.checkpoint.layer(layer, tiles=True)
            except LutBError as exc:
                raise CheckError(str(exc)) from None
            self._experts = ReferenceExperts(self.checkpoint.config, weights, self.device)
            self._layer = layer
        return self._experts

    def forward(self, batch: Batch) -> torch.Tensor:
        experts = self._experts_of(batch.layer)
        out = experts.forward(
            batch.hidden_states.to(self.device, self.checkpoint.config.torch_dtype),
            batch.topk_ids.to(self.device), batch.topk_weights.to(self.device, torch.float32),
            apply_router_weight_on_input=batch.apply_router_weight_on_input, output_mode=batch.output_mode,
        )
        return out.cpu()


class RecordedSide(Side):
    """The answers kept in a record file (see :mod:`lutb_client.check.record`)."""

    kind = "record"
    splits = False

    def __init__(self, recording: Recording, file: str | Path) -> None:
        self.recording = recording
        self.file = str(file)
        self.address = recording.address
        self.info = recording.model_info

    def forward(self, batch: Batch) -> torch.Tensor:
        if batch.index in self.recording.outputs:
            return self.recording.outputs[batch.index]
        import grpc

        from lutb_client.errors import ExpertServiceError

        error = self.recording.errors.get(batch.index, {"code": "UNKNOWN", "message": "not recorded"})
        code = getattr(grpc.StatusCode, str(error.get("code")), grpc.StatusCode.UNKNOWN)
        raise ExpertServiceError(code, f"(recorded) {error.get('message', '')}")


def compare_identity(target: dict[str, Any], against: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(differences, incompatible)``: identity fields that differ, and shape fields that make comparison impossible."""
    differences = [{"field": f, "target": target.get(f), "against": against.get(f)}
                   for f in IDENTITY_FIELDS if target.get(f) != against.get(f)]
    incompatible = [{"field": f, "target": target.get(f), "against": against.get(f)}
                    for f in SHAPE_FIELDS if target.get(f) != against.get(f)]
    return differences, incompatible


def _progress(total: int, desc: str, enabled: bool) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency of the project
        return None
    return tqdm(total=total, desc=desc, unit="batch", file=sys.stderr, disable=not enabled, leave=False)


def _select_layers(info: dict[str, Any], layers: Sequence[int] | None, who: str) -> list[int]:
    held = _layers_of(info)
    chosen = list(dict.fromkeys(layers)) if layers else sorted(held)  # a layer named twice is checked once
    missing = [layer for layer in chosen if layer not in held]
    if missing:
        raise CheckError(f"{who} does not hold layer(s) {missing}; it holds {sorted(held)}")
    return chosen


def _cap(tokens: int, *infos: dict[str, Any]) -> int:
    cap = max(1, int(tokens))
    for info in infos:
        limit = int(info.get("max_tokens_per_request") or 0)
        if limit > 0:
            cap = min(cap, limit)
    return cap


def _max_top_k(info: dict[str, Any]) -> int:
    """The routes per token a side's ``ModelInfo`` says it takes at most (0: not said; a record or server older than
    the field)."""
    return int(info.get("max_top_k") or 0)


def _shape(info: dict[str, Any], topk: int, cap: int, *sides: Side) -> NodeShape:
    """The batches' shape; their messages bounded by the smallest ``message_bytes`` of ``sides`` (0: none), their
    routes per token by the smallest ``max_top_k`` the sides state (0: none)."""
    bounds = [side.message_bytes for side in sides if side.message_bytes > 0]
    top_ks = [_max_top_k(side.info) for side in sides]
    return NodeShape(
        hidden_size=int(info["hidden_size"]), num_experts=int(info["num_experts"]), dtype=model_dtype(info),
        experts=_layers_of(info), max_tokens=cap, topk=topk, max_message_bytes=min(bounds, default=0),
        max_top_k=min((k for k in top_ks if k > 0), default=0),
    )


def _refuse_nothing_to_send(batches: Sequence[Batch], suites: Sequence[str], shape: NodeShape) -> None:
    """Raise :class:`CheckError` when the suites hold no batch for this node (``duplicates`` needs two routes per
    token: two experts, and a ``max_top_k`` of 2 or more): a check of nothing must not pass. Say on stderr which
    suites send nothing when others do."""
    why = f"{shape.num_experts} expert(s), max_top_k {shape.max_top_k or 'not said'}"
    if not batches:
        raise CheckError(f"suite(s) {', '.join(suites)} hold no batches for this node ({why}): nothing to check")
    empty = [name for name in suites if not any(b.suite == name for b in batches)]
    if empty:
        print(f"lutb check: suite(s) {', '.join(empty)} send nothing to this node ({why}); the others run",
              file=sys.stderr)


SIZE_REFUSAL = re.compile(r"larger than max|max_message_bytes", re.IGNORECASE)
"""What a RESOURCE_EXHAUSTED about a message's size says (the server's refusal of a response too large for its
``max_message_bytes``, or gRPC's of a message beyond a channel's limit), unlike a full queue or a device out of
memory (whose hint also says "send fewer tokens": a finding, not a size to split)."""


def _too_large(exc: BaseException) -> bool:
    """``exc`` refuses a request because of its (or its response's) size: a smaller request may pass."""
    from lutb_client.errors import ExpertServiceError

    return (isinstance(exc, ExpertServiceError) and exc.code.name == "RESOURCE_EXHAUSTED"
            and bool(SIZE_REFUSAL.search(exc.message or "")))


def _refused_input(exc: BaseException) -> bool:
    """``exc`` is a judge's refusal of the batch's input (the reference's ValueError, e.g. NaN met in step 5, or a
    node's INVALID_ARGUMENT): a finding about the batch, not a failure of the judge itself."""
    from lutb_client.errors import ExpertServiceError

    if isinstance(exc, ExpertServiceError):
        return exc.code.name == "INVALID_ARGUMENT"
    return isinstance(exc, ValueError)


def _fit(side: Side, batch: Batch) -> torch.Tensor:
    """``side``'s output for ``batch``, sent in requests whose messages fit ``side.message_bytes``; a request the
    side refuses as too large is split in halves and sent again (and the side's bound lowered for the rest)."""
    per_token = batch.token_bytes
    fit = message_tokens(side.message_bytes, per_token)
    if batch.tokens > fit:
        return torch.cat([_fit(side, part) for part in batch.split(fit)])
    try:
        return side.forward(batch)
    except Exception as exc:
        if batch.tokens <= 1 or not _too_large(exc):
            raise
    half = (batch.tokens + 1) // 2
    bound = half * per_token + MESSAGE_MARGIN  # what a request of half the tokens needs
    side.message_bytes = bound if side.message_bytes <= 0 else min(side.message_bytes, bound)
    return torch.cat([_fit(side, part) for part in batch.split(half)])


def _send(side: Side, batch: Batch, *, cap: int | None = None) -> torch.Tensor:
    """``side``'s output for ``batch``: in requests of at most ``cap`` tokens, each fitting the side's message
    bound (:func:`_fit`); a record's whole."""
    if not side.splits:
        return side.forward(batch)
    parts = [batch] if cap is None else batch.split(max(1, cap))
    outs = [_fit(side, part) for part in parts]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _error_of(exc: BaseException) -> dict[str, str]:
    """A failed request as the report keeps it: the gRPC status code's name and message, or the exception's type
    and text."""
    from lutb_client.errors import ExpertServiceError

    if isinstance(exc, ExpertServiceError):
        return {"code": exc.code.name, "message": exc.message}
    return {"code": type(exc).__name__, "message": str(exc)}


def _call(side: Side, batch: Batch) -> tuple[torch.Tensor | None, dict[str, str] | None]:
    """The target's output for ``batch``, or the error it gave: any failure of the target is a finding about it."""
    try:
        return _send(side, batch), None
    except Exception as exc:  # noqa: BLE001 - whatever the target does wrong is reported against it
        return None, _error_of(exc)


def _judge_groups(batches: Sequence[Batch], limit: int) -> list[list[Batch]]:
    """``batches`` in runs the judge answers in one call: consecutive standard-normal requests of one part and
    layer, asked alike, of at most ``limit`` tokens together (the target still gets each request on its own).
    The 64 one-token requests of ``single_token`` cost the judge one call, not 64; inputs that may overflow
    (huge, heavy-tailed, tiny) go alone, so that a refusal of one is not laid on others."""
    groups: list[list[Batch]] = []
    for batch in batches:
        last = groups[-1] if groups else None
        if (last is not None and batch.standard and last[0].standard and batch.part == last[0].part
                and batch.layer == last[0].layer and batch.output_mode == last[0].output_mode
                and batch.apply_router_weight_on_input == last[0].apply_router_weight_on_input
                and batch.topk_ids.shape[1] == last[0].topk_ids.shape[1]
                and sum(b.tokens for b in last) + batch.tokens <= limit):
            last.append(batch)
        else:
            groups.append([batch])
    return groups


def _joined(group: Sequence[Batch]) -> Batch:
    """One batch of a group's requests, in order (the group's first batch when it is alone)."""
    if len(group) == 1:
        return group[0]
    return replace(group[0], hidden_states=torch.cat([b.hidden_states for b in group]),
                   topk_ids=torch.cat([b.topk_ids for b in group]), topk_weights=torch.cat([b.topk_weights for b in group]))


def _judge_failed(judge: Side, batch: Batch, exc: BaseException, role: str = "the judge") -> CheckError:
    error = _error_of(exc)
    where = "a headroom probe" if batch.index < 0 else f"batch {batch.index}"
    return CheckError(f"{role} ({judge.address}) failed on {where} ({batch.part}, layer {batch.layer}): "
                      f"{error['code']}: {error['message']}")


def _judge_send(judge: Side, batch: Batch, cap: int | None, role: str = "the judge") -> torch.Tensor:
    """The judge's output for ``batch`` (in requests of at most ``cap`` tokens; None: a record's whole). A refusal
    of the input propagates as it is; any other failure of the judge (a device it cannot use, a bad tile of its
    checkpoint, a node that is down) is a :class:`CheckError` naming ``role``: the check cannot run, and the target
    is not to blame."""
    try:
        return _send(judge, batch, cap=cap)
    except CheckError:
        raise
    except Exception as exc:  # noqa: BLE001 - sorted into refusals and the judge's own failures
        if _refused_input(exc):
            raise
        raise _judge_failed(judge, batch, exc, role) from exc


def _judge_call(judge: Side, batch: Batch, cap: int) -> tuple[torch.Tensor | None, dict[str, str] | None]:
    """:func:`_judge_send`, a refusal of the input returned as the judge's error (it fails the batch's rows)."""
    from lutb_client.errors import ExpertServiceError

    try:
        return _judge_send(judge, batch, cap), None
    except (ExpertServiceError, ValueError) as exc:  # refusals only: _judge_send raised the rest as CheckError
        return None, _error_of(exc)


def _output_error(out: torch.Tensor, batch: Batch, dtype: torch.dtype, hidden: int) -> dict[str, str] | None:
    """What is wrong with an output's shape or dtype (the proto: ``[T, H]`` or ``[T, k, H]``, in the model dtype)."""
    want = [batch.tokens, hidden] if batch.output_mode != "route_major" else [batch.tokens, int(batch.topk_ids.shape[1]), hidden]
    if list(out.shape) != want:
        return {"code": "SHAPE", "message": f"output shape {list(out.shape)} != {want} ({batch.output_mode}, T = {batch.tokens})"}
    if out.dtype != dtype:
        return {"code": "DTYPE", "message": f"output dtype {str(out.dtype).removeprefix('torch.')} != the model dtype "
                                            f"{str(dtype).removeprefix('torch.')}"}
    return None


def _host_endpoints(address: str) -> set[tuple[str, Any]] | None:
    """Where ``address`` (``host:port``, ``[v6]:port``, ``dns:``/``ipv4:``/``ipv6:`` prefixed, ``unix:path``) leads:
    ``(ip, port)`` pairs, every address of this host (loopback, unspecified, its own interfaces' as far as its name
    resolves) as ``"this host"``; None when it cannot be parsed or resolved."""
    text = address.strip()
    if text.startswith(("unix:", "unix-abstract:")):
        kind, _, path = text.partition(":")
        return {(kind, path.removeprefix("//"))}
    for prefix in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = text.rpartition(":")
    try:
        port = int(port_text)
        found = socket.getaddrinfo(host or "localhost", port, type=socket.SOCK_STREAM)
    except (ValueError, OSError, UnicodeError):
        return None
    own = _own_addresses()
    out: set[tuple[str, Any]] = set()
    for *_, sockaddr in found:
        try:
            ip = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        except ValueError:
            continue
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        local = ip.is_loopback or ip.is_unspecified or str(ip) in own
        out.add(("this host" if local else str(ip), port))
    return out or None


@functools.lru_cache(maxsize=1)
def _own_addresses() -> frozenset[str]:
    """This host's addresses, as far as its name resolves (empty when it does not)."""
    try:
        return frozenset(str(info[4][0]).split("%")[0] for info in socket.getaddrinfo(socket.gethostname(), None))
    except (OSError, UnicodeError):
        return frozenset()


def same_node(a: str, b: str) -> bool:
    """Whether addresses ``a`` and ``b`` lead to the same server: equal strings, or the same port on the same
    resolved IP (any address of this host counting as one). Two names for one node that resolve apart (a proxy,
    a port forward) are not seen here: :func:`run_check` compares the nodes' ``ModelInfo.instance_id`` too."""
    if a.strip() == b.strip():
        return True
    ea, eb = _host_endpoints(a), _host_endpoints(b)
    return bool(ea and eb and ea & eb)


def run_check(
    target: Side,
    against: Side,
    *,
    suites: Iterable[str] | None = None,
    layers: Sequence[int] | None = None,
    tokens: int = DEFAULT_TOKENS,
    seed: int = 0,
    topk: int = DEFAULT_TOPK,
    force: bool = False,
    progress: bool = True,
) -> CheckReport:
    """Send the same batches to ``target`` and ``against`` (the judge) and judge ``target``.

    With a :class:`RecordedSide` as ``target`` the recorded batches are replayed (``suites``,
    ``tokens``, ``seed`` and ``topk`` then come from the record; ``layers`` filters).

    Requests are bounded by tokens (``tokens``, both sides' ``max_tokens_per_request``) and by message bytes
    (each node side's ``message_bytes``); a request a node refuses as too large is split and sent again.

    Raises:
        IdentityMismatch: content hash or scale mode differ and ``force`` is False.
        CheckError: sizes or dtypes differ, a layer is not held by both sides, both sides are one node, or the
            judge failed on its own (not a refusal of a batch's input: see :func:`_judge_send`).
        ValueError: an unknown suite name.
    """
    if isinstance(target, NodeSide) and isinstance(against, NodeSide):
        ids = target.info["instance_id"], against.info["instance_id"]
        if same_node(target.address, against.address) or (ids[0] and ids[0] == ids[1]):
            raise CheckError(f"{target.address} and {against.address} are one node (instance {ids[0] or 'id not said'}): "
                             f"judged against itself it proves nothing")
    differences, incompatible = compare_identity(target.info, against.info)
    if incompatible:
        text = "; ".join(f"{d['field']}: {target.address} has {d['target']}, {against.address} has {d['against']}"
                         for d in incompatible)
        raise CheckError(f"cannot compare: {text}")
    if differences and not force:
        raise IdentityMismatch(differences, target.address, against.address)

    replay: dict[str, Any] | None = None
    headroom: dict[int, float] = {}
    judge_cap = _cap(2**62, against.info)
    if isinstance(target, RecordedSide):
        rec = target.recording
        chosen = list(dict.fromkeys(layers)) if layers else rec.layers or sorted({b.layer for b in rec.batches})
        missing = [layer for layer in chosen if layer not in {b.layer for b in rec.batches}]
        if missing:
            raise CheckError(f"the record holds no batches of layer(s) {missing}")
        _select_layers(against.info, chosen, against.address)
        batches = [b for b in rec.batches if b.layer in chosen]
        if not batches:
            raise CheckError(f"{target.file}: the record holds no batches to replay")
        judge_top_k = _max_top_k(against.info)
        widest = max(int(b.topk_ids.shape[1]) for b in batches)
        if judge_top_k and widest > judge_top_k:  # the judge would refuse them: no verdict about the record
            raise CheckError(f"{target.file} holds batches of {widest} routes per token; the judge {against.address} "
                             f"takes at most {judge_top_k} (its max_top_k): judge it with another node or the reference")
        suite_names, seed, tokens, topk = rec.suites, rec.seed, rec.tokens, rec.topk
        headroom = {k: v for k, v in rec.headroom.items() if k in chosen}
        replay = {"file": target.file, "recorded_at": rec.recorded_at, "address": rec.address}
    else:
        suite_names = resolve_suites(suites)
        chosen = _select_layers(target.info, layers, target.address)
        _select_layers(against.info, chosen, against.address)
        cap = _cap(tokens, target.info, against.info)
        shape = _shape(target.info, topk, cap, target, against)

        probing = None  # a bar over the layers whose headroom is probed (each ~7 judge calls, before the first batch)

        def room(layer: int) -> float:
            nonlocal probing
            if layer not in headroom:
                if probing is None:
                    probing = _progress(len(chosen), f"probe headroom on {against.address}", progress)
                headroom[layer] = headroom_probe(lambda b: _judge_send(against, b, judge_cap), layer, shape,
                                                 seed=seed, too_big=_refused_input)
                if probing is not None:
                    probing.update(1)
            return headroom[layer]

        try:
            batches = make_batches(suite_names, shape, chosen, cap=cap, seed=seed, headroom=room)
        finally:
            if probing is not None:
                probing.close()
        _refuse_nothing_to_send(batches, suite_names, shape)

    hidden = int(target.info["hidden_size"])
    dtype = model_dtype(target.info)
    target_held = _layers_of(target.info)
    layer_stats: dict[tuple[str, int], ErrorStats] = {}
    layer_tokens: dict[tuple[str, int], int] = {}
    layer_errors: dict[tuple[str, int], list[str]] = {}
    expert_stats: dict[tuple[str, int, int], ErrorStats] = {}
    expert_routes: dict[tuple[str, int, int], int] = {}
    errors: list[dict[str, Any]] = []

    def _compare(batch: Batch, ref: torch.Tensor | None, err_a: dict[str, str] | None) -> None:
        """Send ``batch`` to the target and pool its output against ``ref`` (the judge's) into the rows."""
        key = (batch.part, batch.layer)
        keys = [key, (POOLED, batch.layer)] if batch.standard else [key]
        for k in keys:
            layer_stats.setdefault(k, ErrorStats())
            layer_tokens[k] = layer_tokens.get(k, 0) + batch.tokens
        got, err_t = _call(target, batch)
        if got is not None:
            err_t = _output_error(got, batch, dtype, hidden)
        for side, err in (("target", err_t), ("against", err_a)):
            if err is not None:
                errors.append({"suite": batch.part, "layer": batch.layer, "batch": batch.index, "side": side, **err})
                for k in keys:
                    layer_errors.setdefault(k, []).append(f"{side} {err['code']}: {err['message']}")
        if err_t is not None or err_a is not None:
            return
        assert got is not None and ref is not None
        for k in keys:
            layer_stats[k].add(got.reshape(-1, hidden), ref.reshape(-1, hidden))
        if batch.output_mode == "route_major":
            for expert, (g, r) in route_rows_by_expert(got, ref, batch.topk_ids).items():
                ek = (batch.part, batch.layer, expert)
                expert_stats.setdefault(ek, ErrorStats()).add(g, r)
                expert_routes[ek] = expert_routes.get(ek, 0) + int(g.shape[0])

    bar = _progress(len(batches), f"check {target.address}", progress)
    try:
        for group in _judge_groups(batches, max(STANDARD_TOKENS, _cap(tokens or DEFAULT_TOKENS))):
            joined = _joined(group)
            # the judge answers a group at once (a recorded batch may exceed its limit: sent in parts)
            ref_all, err_a = _judge_call(against, joined, judge_cap)
            if ref_all is not None:
                wrong = _output_error(ref_all, joined, dtype, hidden)
                if wrong is not None:  # a judge that answers malformed outputs cannot judge
                    raise CheckError(f"the judge ({against.address}) answered batch {joined.index} ({joined.part}, "
                                     f"layer {joined.layer}) wrongly: {wrong['code']}: {wrong['message']}")
            refs = list(ref_all.split([b.tokens for b in group])) if ref_all is not None else [None] * len(group)
            for batch, ref in zip(group, refs):
                _compare(batch, ref, err_a)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()

    layer_rows = [Row(suite=part, layer=layer, stats=stats, tokens=layer_tokens[(part, layer)],
                      errors=layer_errors.get((part, layer), []))
                  for (part, layer), stats in layer_stats.items()]
    expert_rows = [Row(suite=part, layer=layer, expert=expert, stats=stats, tokens=expert_routes[(part, layer, expert)],
                       held=expert in target_held.get(layer, []))
                   for (part, layer, expert), stats in expert_stats.items()]
    return CheckReport(
        target=target.describe(), against=against.describe(), dtype=str(dtype).removeprefix("torch."),
        suites=list(suite_names), seed=seed, tokens=tokens, topk=topk, layers_checked=list(chosen),
        layer_rows=layer_rows, expert_rows=expert_rows, differences=differences if force else [], forced=bool(force and differences),
        replay=replay, headroom=headroom, errors=errors, batches=len(batches),
    )


def record_node(
    target: NodeSide,
    out: str | Path,
    *,
    suites: Iterable[str] | None = None,
    layers: Sequence[int] | None = None,
    tokens: int = DEFAULT_TOKENS,
    seed: int = 0,
    topk: int = DEFAULT_TOPK,
    progress: bool = True,
) -> Recording:
    """Send the check's batches to ``target`` and keep requests, responses and its ModelInfo in ``out``.

    The headroom of the ``huge`` and ``heavy_tailed`` inputs is probed on ``target`` itself (there is no judge).
    Requests the node refuses are recorded with their error.
    """
    suite_names = resolve_suites(suites)
    chosen = _select_layers(target.info, layers, target.address)
    check_writable(out)  # before the node is asked anything
    cap = _cap(tokens, target.info)
    shape = _shape(target.info, topk, cap, target)
    headroom: dict[int, float] = {}

    def room(layer: int) -> float:
        if layer not in headroom:
            # The node judges its own headroom: only its refusal of the input means "too big"; it being down, late
            # or failing is the recording's failure, not a headroom.
            headroom[layer] = headroom_probe(lambda b: _judge_send(target, b, None, role="the node"), layer, shape,
                                             seed=seed, too_big=_refused_input)
        return headroom[layer]

    batches = make_batches(suite_names, shape, chosen, cap=cap, seed=seed, headroom=room)
    _refuse_nothing_to_send(batches, suite_names, shape)
    outputs: dict[int, torch.Tensor] = {}
    errors: dict[int, dict[str, str]] = {}
    bar = _progress(len(batches), f"record {target.address}", progress)
    try:
        for batch in batches:
            got, err = _call(target, batch)
            if got is not None:
                outputs[batch.index] = got
            else:
                assert err is not None
                errors[batch.index] = err
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    rec = Recording(address=target.address, model_info=target.info, batches=batches, outputs=outputs, errors=errors,
                    suites=suite_names, seed=seed, tokens=tokens, topk=topk, layers=chosen, headroom=headroom)
    write_recording(out, rec)
    return rec


def open_recording(path: str | Path) -> RecordedSide:
    """A :class:`RecordedSide` of a record file (raises :class:`~lutb_client.check.record.RecordError`)."""
    return RecordedSide(read_recording(path), path)


__all__ = [
    "DEFAULT_TOKENS",
    "DEFAULT_TOPK",
    "IDENTITY_FIELDS",
    "CheckError",
    "IdentityMismatch",
    "NodeSide",
    "RecordedSide",
    "ReferenceSide",
    "Side",
    "compare_identity",
    "model_dtype",
    "model_info_dict",
    "open_recording",
    "record_node",
    "run_check",
    "same_node",
]
