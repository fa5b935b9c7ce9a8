"""Recordings of a node's answers: the requests, the responses and the node's identity in one file.

Format ``lutb-record`` version 1: a single safetensors file.

- Tensors, per batch ``i`` (six digits): ``batch.{i:06d}.hidden_states`` (model dtype
  ``[T, H]``), ``batch.{i:06d}.topk_ids`` (int32 ``[T, k]``), ``batch.{i:06d}.topk_weights``
  (float32 ``[T, k]``) and, when the node answered, ``batch.{i:06d}.output`` (model dtype,
  ``[T, H]`` or ``[T, k, H]``).
- ``__metadata__``: ``format = "lutb-record"``, ``format_version = "1"`` and ``record``,
  a JSON object: ``address``, ``recorded_at`` (ISO 8601, UTC), ``model_info`` (the node's
  ``ModelInfo``, see :func:`lutb_client.check.runner.model_info_dict`), ``suites``,
  ``seed``, ``tokens``, ``topk``, ``layers``, ``headroom`` (layer -> amax of the huge
  inputs) and ``batches``: one object per batch with ``index``, ``suite``, ``part``,
  ``layer``, ``apply_router_weight_on_input``, ``output_mode``, ``standard``, ``meta`` and
  ``error`` (null, or ``{"code", "message"}`` when the node refused the request).
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lutb_client.check.suites import Batch

RECORD_FORMAT = "lutb-record"
RECORD_VERSION = 1
# What a replay reads of the recorded node's ModelInfo (identity, sizes, layers held).
_MODEL_INFO_KEYS = ("content_hash", "mxfp8_scale_mode", "hidden_size", "num_experts", "dtype", "layers")


class RecordError(ValueError):
    """A file that is not a readable lutb record (the message says why)."""


@dataclass
class Recording:
    """A recorded session: the batches sent, what came back, and who answered."""

    address: str
    model_info: dict[str, Any]
    batches: list[Batch]
    outputs: dict[int, torch.Tensor]
    errors: dict[int, dict[str, str]] = field(default_factory=dict)
    suites: list[str] = field(default_factory=list)
    seed: int = 0
    tokens: int = 0
    topk: int = 0
    layers: list[int] = field(default_factory=list)
    headroom: dict[int, float] = field(default_factory=dict)
    recorded_at: str = ""


def _key(i: int, name: str) -> str:
    return f"batch.{i:06d}.{name}"


def check_writable(path: str | Path, example: str = "node.lutbrec.safetensors") -> None:
    """Make sure a file can be written at ``path`` before a node is asked anything, without creating or touching it.

    The writers may write through ``path`` (a report) or write a temporary file beside it and rename it over ``path``
    (safetensors' ``save_file``, a record), so both must be possible: ``path``'s own folder is made if missing and must
    be writable, and what ``path`` names (a link's target) must be a regular file we may write, or not exist yet in a
    writable folder.

    Args:
        example: a file name the message for a folder suggests.

    Raises:
        OSError: ``path`` is a folder or not a regular file (a FIFO, a device), a link that loops, or in a folder
            that cannot be made; or it or a folder cannot be written.
    """
    out = Path(path)
    if out.is_dir():
        raise IsADirectoryError(f"{out} is a folder; give a file name (e.g. {out / example})")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(errno.ENOTDIR, f"{out.parent} is not a folder (a file, or a link to nowhere)") from None
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"{out.parent} is not writable")
    try:
        target = Path(os.path.realpath(out, strict=True))  # what a write through the path reaches
    except FileNotFoundError:
        target = Path(os.path.realpath(out))  # nothing there yet (or a link to nowhere): made by the write
        if not target.parent.is_dir():
            raise FileNotFoundError(errno.ENOENT, f"{target.parent} does not exist (where {out} leads)") from None
        if not os.access(target.parent, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, f"{target.parent} is not writable") from None
        return
    except OSError as exc:  # a link that loops
        raise OSError(exc.errno, f"{out} cannot be followed ({exc.strerror})") from None
    if not target.is_file():
        raise OSError(errno.EINVAL, f"{out} is not a regular file")
    if not os.access(target, os.W_OK):
        raise PermissionError(errno.EACCES, f"{out} is not writable")


def write_recording(path: str | Path, rec: Recording) -> Path:
    """Write ``rec`` to ``path`` (one safetensors file, format above); returns the path.

    Raises:
        OSError: the file cannot be written (safetensors' own errors come as OSError too).
    """
    tensors: dict[str, torch.Tensor] = {}
    entries = []
    for b in rec.batches:
        tensors[_key(b.index, "hidden_states")] = b.hidden_states.contiguous().cpu()
        tensors[_key(b.index, "topk_ids")] = b.topk_ids.to(torch.int32).contiguous().cpu()
        tensors[_key(b.index, "topk_weights")] = b.topk_weights.float().contiguous().cpu()
        if b.index in rec.outputs:
            tensors[_key(b.index, "output")] = rec.outputs[b.index].contiguous().cpu()
        entries.append({
            "index": b.index, "suite": b.suite, "part": b.part, "layer": b.layer,
            "apply_router_weight_on_input": b.apply_router_weight_on_input, "output_mode": b.output_mode,
            "standard": b.standard, "meta": b.meta, "error": rec.errors.get(b.index),
        })
    meta = {
        "address": rec.address,
        "recorded_at": rec.recorded_at or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model_info": rec.model_info,
        "suites": rec.suites, "seed": rec.seed, "tokens": rec.tokens, "topk": rec.topk, "layers": rec.layers,
        "headroom": {str(k): v for k, v in rec.headroom.items()},
        "batches": entries,
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        save_file(tensors, str(out), metadata={
            "format": RECORD_FORMAT, "format_version": str(RECORD_VERSION), "record": json.dumps(meta),
        })
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError
        raise OSError(f"cannot write {out}: {exc}") from None
    return out


def read_recording(path: str | Path) -> Recording:
    """Read a record written by :func:`write_recording`.

    Raises:
        RecordError: not a safetensors file, not a lutb record, an unknown version, or a batch's tensors missing.
    """
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            names = set(f.keys())
            if header.get("format") != RECORD_FORMAT:
                raise RecordError(f"{path}: not a lutb record (format {header.get('format')!r})")
            if header.get("format_version") != str(RECORD_VERSION):
                raise RecordError(f"{path}: unsupported record version {header.get('format_version')!r}, "
                                  f"this client reads {RECORD_VERSION}")
            meta = json.loads(header["record"])
            batches: list[Batch] = []
            outputs: dict[int, torch.Tensor] = {}
            errors: dict[int, dict[str, str]] = {}
            seen: set[int] = set()
            for e in meta["batches"]:
                i = int(e["index"])
                if i in seen:
                    raise RecordError(f"{path}: batch {i} is listed twice")
                seen.add(i)
                for part in ("hidden_states", "topk_ids", "topk_weights"):
                    if _key(i, part) not in names:
                        raise RecordError(f"{path}: batch {i} lacks tensor {_key(i, part)}")
                batches.append(Batch(
                    index=i, suite=e["suite"], part=e["part"], layer=int(e["layer"]),
                    hidden_states=f.get_tensor(_key(i, "hidden_states")), topk_ids=f.get_tensor(_key(i, "topk_ids")),
                    topk_weights=f.get_tensor(_key(i, "topk_weights")),
                    apply_router_weight_on_input=bool(e["apply_router_weight_on_input"]),
                    output_mode=e["output_mode"], standard=bool(e["standard"]), meta=dict(e.get("meta") or {}),
                ))
                if _key(i, "output") in names:
                    outputs[i] = f.get_tensor(_key(i, "output"))
                elif e.get("error"):
                    errors[i] = e["error"]
                else:
                    raise RecordError(f"{path}: batch {i} has neither an output nor an error")
            info = meta["model_info"]
            missing = [k for k in _MODEL_INFO_KEYS if not isinstance(info, dict) or k not in info]
            if missing:
                raise RecordError(f"{path}: the record's model_info lacks {', '.join(missing)}")
            layers = info["layers"]
            if not isinstance(layers, list) or not all(
                    isinstance(entry, dict) and isinstance(entry.get("layer"), int) and isinstance(entry.get("expert_ids"), list)
                    and all(isinstance(e, int) for e in entry["expert_ids"]) for entry in layers):
                raise RecordError(f"{path}: the record's model_info.layers is not a list of "
                                  "{layer: int, expert_ids: [int]}")
            listed = {_key(i, part) for i in seen for part in ("hidden_states", "topk_ids", "topk_weights", "output")}
            stray = sorted(names - listed)
            if stray:
                raise RecordError(f"{path}: tensors no batch lists: {', '.join(stray[:3])}{' ...' if len(stray) > 3 else ''}")
            recording = Recording(
                address=str(meta["address"]), model_info=info, batches=batches, outputs=outputs, errors=errors,
                suites=list(meta.get("suites", [])), seed=int(meta.get("seed", 0)), tokens=int(meta.get("tokens", 0)),
                topk=int(meta.get("topk", 0)), layers=[int(x) for x in meta.get("layers", [])],
                headroom={int(k): float(v) for k, v in meta.get("headroom", {}).items()},
                recorded_at=meta.get("recorded_at", ""),
            )
    except RecordError:
        raise
    except (OSError, KeyError, ValueError, TypeError, json.JSONDecodeError) as exc:
        raise RecordError(f"{path}: cannot read record: {exc}") from None
    except Exception as exc:  # safetensors raises its own SafetensorError for a file that is not one
        raise RecordError(f"{path}: cannot read record: {exc}") from None
    return recording


__all__ = ["RECORD_FORMAT", "RECORD_VERSION", "RecordError", "Recording", "read_recording", "write_recording"]
