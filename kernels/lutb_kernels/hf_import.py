"""Convert a dense Hugging Face style MoE checkpoint (safetensors) to LUT-B.

The source is a directory with ``config.json`` and one or more ``*.safetensors``
files (sharded ones listed in ``model.safetensors.index.json``). Routed experts
are recognised by name:

- Mixtral: ``model.layers.L.block_sparse_moe.experts.e.{w1,w3,w2}.weight``
  (``w1`` = gate, ``w3`` = up, ``w2`` = down);
- Qwen-MoE, DeepSeek: ``model.layers.L.mlp.experts.e.{gate_proj,up_proj,down_proj}.weight``.

Any prefix before ``layers.`` is accepted. Layers without routed experts are
skipped; shared experts (``mlp.shared_expert.*``, ``mlp.shared_experts.*``) are
left out, and so are the routed experts of layers numbered at or beyond
config.json's ``num_hidden_layers`` (the multi-token-prediction layer that
DeepSeek-V3 and GLM-4.5 store as ``model.layers.{num_hidden_layers}``) and those
under a second prefix (``mtp.layers.L...``); the report's notes mention each.
The LUT-B layer index is the HF layer index. Conversion streams one expert at a
time through memory-mapped ``safe_open`` handles, so host memory stays near one
layer's packed tiles plus one dense expert. Each expert's gate and up projections
are checked (:func:`~lutb_kernels.quantizer.check_weights`) before they are
stacked into ``W13``, so a weight LUT-B cannot encode is reported against the
tensor that holds it.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lutb_kernels.checkpoint import DTYPES, CheckpointConfig, CheckpointWriter, LayerWeights, SafetensorsFile, open_safetensors
from lutb_kernels.devices import resolve_compute_device
from lutb_kernels.errors import LutBFormatError
from lutb_kernels.quantizer import (
    DEFAULT_ITERATIONS,
    DEFAULT_REFINEMENTS,
    check_weights,
    layer_tiles,
    quantize_matrix,
    sqnr_db,
    stack_w13,
)
from lutb_kernels.tiles import TILE, TILE_BYTES

HF_ACTIVATIONS: dict[str, str] = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
}
"""``hidden_act`` values of config.json -> LUT-B activation (gated: act(gate) * up)."""

_EXPERT = re.compile(
    r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\."
    r"(?:block_sparse_moe\.experts\.(?P<e1>\d+)\.(?P<p1>w1|w2|w3)"
    r"|mlp\.experts\.(?P<e2>\d+)\.(?P<p2>gate_proj|up_proj|down_proj))\.weight$"
)
_SHARED = re.compile(r"^(?:.*?)layers\.(?P<layer>\d+)\.mlp\.shared_experts?\.")
_PART = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class HFMoEConfig:
    """What the importer takes from ``config.json``."""

    hidden_size: int
    intermediate_size: int
    num_experts: int
    activation: str
    dtype: str
    hidden_act: str


def _get(cfg: dict[str, Any], key: str) -> Any:
    if key in cfg:
        return cfg[key]
    return (cfg.get("text_config") or {}).get(key)


def read_hf_config(src: str | Path) -> HFMoEConfig:
    """Read the MoE sizes, activation and dtype from ``src/config.json``.

    Raises:
        LutBFormatError: missing file or field, or an activation/dtype LUT-B cannot express.
    """
    path = Path(src) / "config.json"
    if not path.is_file():
        raise LutBFormatError(f"{Path(src)}: no config.json")
    cfg = _read_json(path)
    hidden = _get(cfg, "hidden_size")
    inter = _get(cfg, "moe_intermediate_size") or _get(cfg, "intermediate_size")
    experts = next((_get(cfg, k) for k in _EXPERT_COUNT_KEYS if _get(cfg, k)), None)
    for what, value in (("hidden_size", hidden), ("intermediate_size or moe_intermediate_size", inter), (" or ".join(_EXPERT_COUNT_KEYS), experts)):
        if not isinstance(value, int) or value <= 0:
            raise LutBFormatError(f"{path}: {what} missing or not a positive integer ({value!r})")
    hidden_act = _get(cfg, "hidden_act") or _get(cfg, "hidden_activation") or "silu"
    if hidden_act not in HF_ACTIVATIONS:
        raise LutBFormatError(f"{path}: hidden_act {hidden_act!r} has no LUT-B activation; known: {', '.join(HF_ACTIVATIONS)}")
    dtype = _get(cfg, "torch_dtype") or _get(cfg, "dtype") or "bfloat16"
    if dtype not in DTYPES:
        raise LutBFormatError(f"{path}: torch_dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return HFMoEConfig(hidden, inter, experts, HF_ACTIVATIONS[hidden_act], dtype, hidden_act)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LutBFormatError(f"{path}: unreadable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise LutBFormatError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _tensor_files(src: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it (from the index, else by reading every header)."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        return {name: src / file for name, file in weight_map.items()}
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise LutBFormatError(f"{src}: holds no .safetensors files")
    where: dict[str, Path] = {}
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                where[name] = file
    return where


@dataclass
class LayerReport:
    """Quantization quality of one converted layer."""

    layer: int
    experts: int
    w13_sqnr_db: float
    w2_sqnr_db: float
    worst_expert_sqnr_db: float
    seconds: float


@dataclass
class ImportReport:
    """What :func:`import_hf_checkpoint` wrote, and how close it came."""

    out_dir: Path
    config: CheckpointConfig
    layers: list[LayerReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def table(self) -> str:
        """A plain-text per-layer table (SQNR in dB)."""
        rows = ["layer  experts  w13 SQNR  w2 SQNR  worst expert  seconds"]
        for r in self.layers:
            rows.append(
                f"{r.layer:5d}  {r.experts:7d}  {r.w13_sqnr_db:8.2f}  {r.w2_sqnr_db:7.2f}  {r.worst_expert_sqnr_db:12.2f}  {r.seconds:7.1f}"
            )
        return "\n".join(rows)


def _load(handles: dict[Path, SafetensorsFile], stack: ExitStack, file: Path, name: str) -> torch.Tensor:
    if file not in handles:
        handles[file] = stack.enter_context(open_safetensors(file))
    t = handles[file].get_tensor(name)
    if not t.is_floating_point() or t.element_size() < 2:
        raise LutBFormatError(f"{file.name}: {name} is {t.dtype}; the importer needs dense bf16/fp16/fp32 weights")
    return t


def _check_layer_experts(layer: int, experts: dict[int, dict[str, str]], num_experts: int) -> None:
    """Refuse a source layer that is not exactly the routed experts ``0 .. num_experts-1``, each with
    gate, up and down projections.

    A dense model's MoE layer holds every expert; converting one with experts missing (a lost index
    entry or shard file, a partial download) would write it as an expert-parallel shard, whose
    routes to the missing experts add exactly zero (spec section 4): wrong outputs, silently.

    Raises:
        LutBFormatError: naming the layer and the ids beyond ``num_experts``, the expert lacking a
            projection, or the missing ids (compact form) with config.json's expert count.
    """
    bad = [e for e in experts if e >= num_experts]
    if bad:
        raise LutBFormatError(f"layer {layer}: expert ids {bad} exceed num_experts {num_experts}")
    for e, parts in experts.items():
        missing = {"gate", "up", "down"} - set(parts)
        if missing:
            raise LutBFormatError(f"layer {layer} expert {e}: lacks the {', '.join(sorted(missing))} projection")
    absent = sorted(set(range(num_experts)) - set(experts))
    if absent:
        raise LutBFormatError(f"layer {layer}: routed experts {compact_ids(absent)} missing from the source "
                              f"(config.json: num_experts = {num_experts}, found {len(experts)}); "
                              f"an incomplete model cannot be converted")


def import_hf_checkpoint(
    src: str | Path,
    out_dir: str | Path,
    *,
    scale_mode: str = "rceil",
    device: torch.device | str | None = None,
    seed: int = 0,
    iterations: int = DEFAULT_ITERATIONS,
    refinements: int = DEFAULT_REFINEMENTS,
    progress: bool = True,
    overwrite: bool = False,
) -> ImportReport:
    """Quantize every routed expert of a Hugging Face MoE checkpoint into a LUT-B checkpoint.

    Args:
        src: directory with ``config.json`` and ``*.safetensors``.
        out_dir: the LUT-B checkpoint to write (one file per layer).
        scale_mode: the MXFP8 scale mode the checkpoint records.
        device: where to quantize, ``cpu``, ``cuda`` or ``cuda:N`` (default: CUDA when available, else
            CPU); see :func:`~lutb_kernels.devices.resolve_compute_device`.
        seed, iterations, refinements: passed to :func:`~lutb_kernels.quantizer.quantize_matrix`.
        progress: show a tqdm bar (tiles) on stderr.
        overwrite: replace safetensors files already in ``out_dir``.

    Returns:
        :class:`ImportReport` with one row per converted layer.

    Raises:
        LutBFormatError: unreadable config or source file, no routed experts (below ``num_hidden_layers``),
            a layer lacking some of config.json's experts, missing or misshapen expert tensors.
        NonFiniteInputError, ValueError: weights the quantizer cannot encode (NaN or infinity, magnitude
            above bfloat16's largest finite value), naming the source tensor (gate, up or down
            projection) and the first offending row of it; a device this host lacks
            (:func:`~lutb_kernels.devices.resolve_compute_device`), before anything is written.
        FileExistsError: ``out_dir`` cannot be replaced (see :class:`~lutb_kernels.checkpoint.StagedDirectory`).
        OSError: writing ``out_dir`` failed (a full disk, no permission); the message names the output.
    """
    from tqdm import tqdm

    src = Path(src)
    hf = read_hf_config(src)
    dev = resolve_compute_device(device, who="the quantizer")
    config = CheckpointConfig(
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_experts=hf.num_experts,
        activation=hf.activation,
        dtype=hf.dtype,
        mxfp8_scale_mode=scale_mode,
    )
    where = _tensor_files(src)
    # prefix ("model.", "mtp.", ...) -> layer -> expert -> part -> tensor name
    found: dict[str, dict[int, dict[int, dict[str, str]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    shared: dict[int, int] = defaultdict(int)
    for name in where:
        m = _EXPERT.match(name)
        if m:
            expert = int(m.group("e1") or m.group("e2"))
            found[m.group("prefix")][int(m.group("layer"))][expert][_PART[m.group("p1") or m.group("p2")]] = name
        elif sm := _SHARED.match(name):
            shared[int(sm.group("layer"))] += 1
    if not found:
        raise LutBFormatError(f"{src}: no routed expert tensors (expected ...layers.L.block_sparse_moe.experts.e.w1.weight or ...layers.L.mlp.experts.e.gate_proj.weight)")
    # Layers are numbered per prefix: a model's extra modules (e.g. multi-token prediction under
    # "mtp.layers.0...") reuse indices of the main stack. The prefix with the most layers is the model.
    ranked = sorted(found, key=lambda p: (-len(found[p]), p))
    if len(ranked) > 1 and len(found[ranked[0]]) == len(found[ranked[1]]):
        raise LutBFormatError(f"{src}: routed experts under several prefixes with as many layers each "
                              f"({', '.join(repr(p) for p in ranked)}); cannot tell which is the model")
    layers = dict(found[ranked[0]])
    report = ImportReport(Path(out_dir), config)
    for other in ranked[1:]:
        report.notes.append(f"routed experts under prefix {other!r} left out (layers {compact_ids(sorted(found[other]))}); "
                            f"imported those under {ranked[0]!r}")
    if shared:
        report.notes.append(
            f"shared experts left out in {len(shared)} layer(s) ({sum(shared.values())} tensors): "
            f"layers {compact_ids(sorted(shared))}; run them with the dense part of the model"
        )
    total_layers = _get(_read_json(src / "config.json"), "num_hidden_layers")
    if isinstance(total_layers, int) and not isinstance(total_layers, bool) and total_layers > 0:
        # DeepSeek-V3 and GLM-4.5 store their multi-token-prediction layer(s) under the main prefix, as
        # model.layers.{num_hidden_layers}...: not a layer of the model's stack, left out like "mtp." ones.
        beyond = sorted(layer for layer in layers if layer >= total_layers)
        if beyond:
            layers = {layer: ex for layer, ex in layers.items() if layer < total_layers}
            if not layers:
                raise LutBFormatError(f"{src}: routed experts only in layers {compact_ids(beyond)}, none below "
                                      f"config.json's num_hidden_layers = {total_layers}")
            report.notes.append(f"routed experts of layer(s) {compact_ids(beyond)} left out: at or beyond num_hidden_layers = "
                                f"{total_layers} (multi-token-prediction layers, not part of the model's stack)")
        dense = sorted(set(range(total_layers)) - set(layers))
        if dense:
            report.notes.append(f"{len(dense)} layer(s) without routed experts skipped: {compact_ids(dense)}")

    h, i = hf.hidden_size, hf.intermediate_size
    for layer, experts in sorted(layers.items()):
        _check_layer_experts(layer, experts, hf.num_experts)
    tiles_total = sum(layer_tiles(hf.activation, len(ex), h, i) for ex in layers.values())
    bar = tqdm(total=tiles_total, unit="tile", desc="quantize", disable=not progress, dynamic_ncols=True)
    writer = CheckpointWriter(out_dir, config, overwrite=overwrite, sources=set(where.values()))
    with writer, ExitStack() as stack, bar:
        handles: dict[Path, SafetensorsFile] = {}
        for layer, experts in sorted(layers.items()):
            start = time.perf_counter()
            ids = sorted(experts)
            bar.set_postfix_str(f"layer {layer}")
            w13 = torch.empty((len(ids), 2 * i // TILE, h // TILE, TILE_BYTES), dtype=torch.uint8)
            w2 = torch.empty((len(ids), h // TILE, i // TILE, TILE_BYTES), dtype=torch.uint8)
            energy = torch.zeros(4, dtype=torch.float64)  # signal13, noise13, signal2, noise2
            worst = math.inf
            for slot, e in enumerate(ids):
                parts = {p: _load(handles, stack, where[n], n) for p, n in experts[e].items()}
                for p, want in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
                    if tuple(parts[p].shape) != want:
                        raise LutBFormatError(f"{experts[e][p]}: shape {tuple(parts[p].shape)}, expected {want} from config.json")
                # Checked one by one before stacking, so an error names the tensor (gate or up) and its row.
                gate, up = parts["gate"].to(dev), parts["up"].to(dev)
                check_weights(gate, experts[e]["gate"])
                check_weights(up, experts[e]["up"])
                q13 = quantize_matrix(stack_w13(gate, up), seed=seed, device=dev, iterations=iterations, refinements=refinements,
                                      progress=bar.update, name=f"{experts[e]['gate']} stacked over {experts[e]['up']}")
                q2 = quantize_matrix(parts["down"], seed=seed, device=dev, iterations=iterations,
                                     refinements=refinements, progress=bar.update, name=experts[e]["down"])
                w13[slot] = q13.tiles.cpu()
                w2[slot] = q2.tiles.cpu()
                energy += torch.stack([q13.signal_energy, q13.noise_energy, q2.signal_energy, q2.noise_energy])
                worst = min(worst, float(sqnr_db(q13.signal_energy + q2.signal_energy, q13.noise_energy + q2.noise_energy)))
                del parts, gate, up, q13, q2
            writer.write_layer(layer, LayerWeights(w13, w2, torch.tensor(ids, dtype=torch.int32)))
            report.layers.append(
                LayerReport(
                    layer=layer,
                    experts=len(ids),
                    w13_sqnr_db=float(sqnr_db(energy[0], energy[1])),
                    w2_sqnr_db=float(sqnr_db(energy[2], energy[3])),
                    worst_expert_sqnr_db=worst,
                    seconds=time.perf_counter() - start,
                )
            )
    return report


def compact_ids(ids: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    out: list[str] = []
    start = prev = None
    for v in ids:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = v
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


__all__ = ["HF_ACTIVATIONS", "HFMoEConfig", "ImportReport", "LayerReport", "compact_ids", "import_hf_checkpoint", "read_hf_config"]
