"""``lutb load``: collect measured expert load from running servers into a load file.

Each server must run with ``--expert-metrics`` (``LUTB_EXPERT_METRICS=true``); its
``lutb_expert_tokens_total{layer,expert}`` counters are scraped from its Prometheus
endpoint, summed over the servers (each ``(token, route)`` is computed by exactly one
shard, so the sum is the deployment's load) and written with
:func:`lutb_kernels.sharding.write_load_file` for ``lutb shard --placement balanced --load FILE``.

The metrics endpoint is not part of ``ModelInfo``: give it per target with
``--metrics-url`` (in target order), or let it default to ``http://HOST:9400/metrics``
with HOST taken from the target (the server's default metrics port).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from lutb_server.cli._args import positive_float

DEFAULT_METRICS_PORT = 9400
FAMILY = "lutb_expert_tokens"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "load",
        help="collect tokens per expert from running servers into a load file (for lutb shard --placement balanced)",
        description=(
            "Ask each TARGET for its ModelInfo, scrape lutb_expert_tokens_total from its metrics endpoint "
            "(servers must run with --expert-metrics), sum the counts over the targets and write the "
            "lutb-load-v1 file FILE, the --load input of `lutb shard --placement balanced`."
        ),
    )
    p.add_argument("targets", nargs="+", metavar="TARGET", help="host:port of an expert server (every shard and replica)")
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="load file to write (JSON, format lutb-load-v1)")
    p.add_argument(
        "--metrics-url", action="append", default=None, metavar="URL",
        help="metrics endpoint of each target, in target order (http://H:P/metrics, H:P or H:P/path); "
        f"default http://HOST:{DEFAULT_METRICS_PORT}/metrics with the target's host",
    )
    p.add_argument("--timeout", type=positive_float, default=10.0, metavar="S",
                   help="seconds per ModelInfo call and per scrape, > 0 (default: 10)")
    p.set_defaults(run=run)


def metrics_url(spec: str | None, target: str) -> str:
    """The metrics URL of ``target``: ``spec`` completed with scheme and ``/metrics``, or the default."""
    if spec is None:
        host = target.rsplit(":", 1)[0] if ":" in target else target
        return f"http://{host}:{DEFAULT_METRICS_PORT}/metrics"
    url = spec if "://" in spec else f"http://{spec}"
    scheme, rest = url.split("://", 1)
    if "/" not in rest:
        url = f"{scheme}://{rest}/metrics"
    return url


def scrape_expert_tokens(url: str, timeout: float) -> dict[int, dict[int, float]]:
    """``{layer: {expert: tokens}}`` from one Prometheus endpoint.

    Raises:
        OSError: the endpoint cannot be read.
        LookupError: it exports no ``lutb_expert_tokens_total`` (expert metrics off).
    """
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - an operator-given URL
        text = response.read().decode("utf-8")
    out: dict[int, dict[int, float]] = {}
    found = False
    for family in text_string_to_metric_families(text):
        if family.name != FAMILY:
            continue
        found = True
        for sample in family.samples:
            if sample.name != f"{FAMILY}_total":
                continue
            layer, expert = int(sample.labels["layer"]), int(sample.labels["expert"])
            out.setdefault(layer, {})[expert] = out.get(layer, {}).get(expert, 0.0) + float(sample.value)
    if not found:
        raise LookupError(f"{url} exports no {FAMILY}_total: start the server with --expert-metrics (LUTB_EXPERT_METRICS=true)")
    return out


def collect_load(targets: list[str], urls: list[str], timeout: float) -> tuple[int, dict[int, list[float]]]:
    """``(num_experts, {layer: tokens per global expert})`` summed over ``targets``.

    Raises:
        ValueError: the targets serve different models, a metrics endpoint names an expert outside the model, or two
            targets are one server (the same ``ModelInfo.instance_id``: its load would be counted twice).
    """
    from lutb_client import ExpertClient

    num_experts: int | None = None
    layers: dict[int, list[float]] = {}
    instances: dict[str, str] = {}  # instance id -> the first target answering it
    for target, url in zip(targets, urls):
        with ExpertClient(target, timeout=timeout) as client:
            info: Any = client.model_info()
        if info.instance_id in instances:
            raise ValueError(f"{target} and {instances[info.instance_id]} are one server (instance {info.instance_id}): "
                             f"its load would be counted twice; name each server once")
        if info.instance_id:  # empty: a server older than the field, not comparable
            instances[info.instance_id] = target
        if num_experts is None:
            num_experts = int(info.num_experts)
        elif int(info.num_experts) != num_experts:
            raise ValueError(f"{target} has num_experts = {info.num_experts}, the others {num_experts}: not one model")
        for layer in info.layers:
            layers.setdefault(layer.layer, [0.0] * num_experts)
        for layer, experts in scrape_expert_tokens(url, timeout).items():
            row = layers.setdefault(layer, [0.0] * num_experts)
            for expert, tokens in experts.items():
                if not 0 <= expert < num_experts:
                    raise ValueError(f"{url}: expert {expert} outside [0, {num_experts})")
                row[expert] += tokens
    assert num_experts is not None
    return num_experts, layers


def run(args: argparse.Namespace) -> int:
    from lutb_client import ExpertServiceError
    from lutb_kernels.sharding import write_load_file

    specs = args.metrics_url
    if specs is not None and len(specs) != len(args.targets):
        print(f"lutb load: error: {len(specs)} --metrics-url for {len(args.targets)} targets; give one per target, in order",
              file=sys.stderr)
        return 2
    urls = [metrics_url(spec, t) for spec, t in zip(specs or [None] * len(args.targets), args.targets)]
    try:
        num_experts, layers = collect_load(list(args.targets), urls, args.timeout)
        write_load_file(args.out, num_experts, layers)
    except (ExpertServiceError, OSError, LookupError, ValueError) as exc:
        print(f"lutb load: error: {exc}", file=sys.stderr)
        return 1
    for layer, counts in sorted(layers.items()):
        total = sum(counts)
        hottest = sorted(range(num_experts), key=lambda e: -counts[e])[:3]
        shown = ", ".join(f"{e}: {counts[e]:.0f}" for e in hottest)
        print(f"layer {layer}: {total:.0f} tokens; hottest {shown}")
    print(f"wrote {args.out} ({len(layers)} layers, {num_experts} experts, {len(args.targets)} servers)")
    return 0
