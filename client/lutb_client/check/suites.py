"""Input suites of an accuracy check: named, deterministic generators of routed batches.

A suite is data (:class:`Part` rows in :data:`SUITES`): what the hidden states look
like, how tokens are routed, which output mode is asked for and how many tokens a
batch has. :func:`make_batches` turns the parts into :class:`Batch` objects for one
node's shape. Every (seed, part, layer) triple seeds its own generator, so choosing
a subset of suites or layers does not change the batches of the others.

Suites (``--suite`` names; the default is all of them):

- ``normal``: standard-normal ``x``, softmax top-k routing, combined output (spec section 6's setting).
- ``heavy_tailed``: Student-t (3 degrees of freedom) values with a few outlier
  channels scaled 20-100x, as LLM activations have, scaled down to the headroom
  (below) where they would exceed it (float16); combined output.
- ``magnitudes``: two parts. ``magnitudes/tiny``: rows whose 32-element blocks
  are either normal or tiny (down into the dtype's subnormal range; MXFP8 scale
  byte 0), two rows tiny throughout. ``magnitudes/huge``: blocks whose amax sits
  on, just under and just over ``448 * 2^j`` (the rceil/floor scale boundaries)
  and up to the headroom: the largest power of two at which the judge's output
  is still finite, found by probing (:func:`headroom_probe`), divided by 4.
  Route-major output.
- ``coverage``: standard-normal ``x`` routed round-robin so that every expert the
  node holds gets 64 routes in every layer; route-major output.
- ``single_token``: 64 requests of ``T = 1`` (the decode path), standard-normal, combined. Its row
  holds 64 tokens, so it is judged at the strict tolerance on its own.
- ``small_batches``: one request of each ``T`` in :data:`SMALL_SIZES` (2 to 63, around the powers of
  two that token buckets and CUDA graphs pad to) that fits the cap, repeated until they hold at least
  64 tokens together; combined. Its row, too, is judged strictly on its own.
- ``max_tokens``: ``T = min(--tokens, max_tokens_per_request of both sides, what fits a message)``, combined.
- ``weights_on_input``: ``k = 1`` with ``apply_router_weight_on_input``, combined.
- ``route_major``: standard-normal ``x``, softmax top-k over all experts (routes to
  experts the node does not hold must come back zero), route-major output.
- ``duplicates``: standard-normal ``x``, softmax top-k (k at least 2, even with ``--topk 1``), then each
  token's second route names its first route's expert again (spec section 4 computes both routes and sums
  them); combined. Nothing for a model of one expert or a node whose ``max_top_k`` is 1.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from lutb_client.routing import softmax_topk

STANDARD_TOKENS = 64
"""Tokens of a standard batch: the spec's minimum for its tolerance (section 6)."""
SMALL_SIZES = (2, 3, 4, 8, 9, 16, 17, 32, 33, 63)
"""Request sizes of the ``small_batches`` suite: small ``T`` on, and one past, the powers of two."""
MESSAGE_MARGIN = 16 * 1024
"""Bytes of a gRPC message left for what is not tensor data (the server reserves 1 KiB for its response envelope)."""
E4M3_MAX = 448.0
BLOCK = 32
HEADROOM_INPUTS = ("huge", "heavy_tailed")
"""Input kinds bounded by the probed headroom (their largest magnitudes could overflow the forward pass)."""


@dataclass(frozen=True)
class Part:
    """One kind of batch a suite sends.

    Attributes:
        name: ``suite`` or ``suite/part``; rows of the report are keyed by it.
        inputs: ``normal``, ``heavy_tailed``, ``tiny`` or ``huge``.
        routing: ``random`` (softmax top-k over all experts), ``cover`` (round-robin over the experts held) or
            ``repeated`` (``random``, then route 1 of each token names route 0's expert again).
        output_mode: ``combined`` or ``route_major``.
        tokens: ``standard`` (64, sent as requests of at most the cap), ``single`` (64 requests of 1 token),
            ``small`` (:func:`small_sizes`, one request each) or ``max`` (the cap).
        weights_on_input: ``apply_router_weight_on_input`` with ``k = 1``.
    """

    name: str
    inputs: str
    routing: str
    output_mode: str
    tokens: str
    weights_on_input: bool = False

    @property
    def standard(self) -> bool:
        """Standard-normal input without weights on input: the setting spec section 6 states its tolerance for."""
        return self.inputs == "normal" and not self.weights_on_input


SUITES: dict[str, tuple[Part, ...]] = {
    "normal": (Part("normal", "normal", "random", "combined", "standard"),),
    "heavy_tailed": (Part("heavy_tailed", "heavy_tailed", "random", "combined", "standard"),),
    "magnitudes": (
        Part("magnitudes/tiny", "tiny", "random", "route_major", "standard"),
        Part("magnitudes/huge", "huge", "random", "route_major", "standard"),
    ),
    "coverage": (Part("coverage", "normal", "cover", "route_major", "standard"),),
    "single_token": (Part("single_token", "normal", "random", "combined", "single"),),
    "small_batches": (Part("small_batches", "normal", "random", "combined", "small"),),
    "max_tokens": (Part("max_tokens", "normal", "random", "combined", "max"),),
    "weights_on_input": (Part("weights_on_input", "normal", "random", "combined", "standard", weights_on_input=True),),
    "route_major": (Part("route_major", "normal", "random", "route_major", "standard"),),
    "duplicates": (Part("duplicates", "normal", "repeated", "combined", "standard"),),
}
ROW_JUDGED_PARTS = frozenset(part.name for parts in SUITES.values() for part in parts if part.inputs != "normal")
"""Parts whose rows differ in magnitude by orders (heavy tails, tiny and huge blocks): the pooled error is their
largest rows' alone, so each row is judged as well (``lutb_client.check.report``)."""
"""Every suite by name, in report order."""


@dataclass
class NodeShape:
    """What the batches must fit: sizes, dtype, experts held per layer, largest request.

    ``max_tokens`` bounds a request's tokens; ``max_message_bytes`` (0: no bound) its request and response
    messages (:func:`message_tokens`); ``max_top_k`` (0: no bound) its routes per token, as ``topk`` and the expert
    count do.
    """

    hidden_size: int
    num_experts: int
    dtype: torch.dtype
    experts: dict[int, list[int]]
    max_tokens: int
    topk: int = 8
    max_message_bytes: int = 0
    max_top_k: int = 0


def token_bytes(hidden: int, itemsize: int, k: int, output_mode: str) -> int:
    """Bytes one token adds to the larger of a request (``[T, H]`` input, ``[T, k]`` ids and weights) and its response
    (``[T, H]`` combined, ``[T, k, H]`` route-major), in a dtype of ``itemsize`` bytes."""
    response = hidden * itemsize * (k if output_mode == "route_major" else 1)
    request = hidden * itemsize + k * 8
    return max(response, request)


def message_tokens(max_bytes: int, per_token: int) -> int:
    """Most tokens of a request whose messages grow by ``per_token`` bytes a token and must fit ``max_bytes`` less
    :data:`MESSAGE_MARGIN`: at least 1; unbounded (a huge number) when ``max_bytes`` is 0."""
    if max_bytes <= 0:
        return 2**62
    return max(1, (max_bytes - MESSAGE_MARGIN) // max(1, per_token))


@dataclass
class Batch:
    """One request of a check: the inputs, how to ask, and where it belongs in the report."""

    index: int
    suite: str
    part: str
    layer: int
    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    apply_router_weight_on_input: bool = False
    output_mode: str = "combined"
    standard: bool = False
    meta: dict[str, float] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return int(self.hidden_states.shape[0])

    @property
    def token_bytes(self) -> int:
        """:func:`token_bytes` of this batch (its output is in the dtype of its hidden states, the model dtype)."""
        return token_bytes(int(self.hidden_states.shape[1]), self.hidden_states.element_size(),
                           int(self.topk_ids.shape[1]), self.output_mode)

    def split(self, max_tokens: int) -> list[Batch]:
        """This batch as requests of at most ``max_tokens`` tokens each, in token order (itself when it fits)."""
        if self.tokens <= max_tokens:
            return [self]
        return [replace(self, hidden_states=self.hidden_states[i:i + max_tokens], topk_ids=self.topk_ids[i:i + max_tokens],
                        topk_weights=self.topk_weights[i:i + max_tokens])
                for i in range(0, self.tokens, max_tokens)]


def resolve_suites(names: Iterable[str] | None) -> list[str]:
    """Suite names in :data:`SUITES` order; ``None``, empty or ``all`` means every suite.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    wanted: list[str] = []
    for name in names or ["all"]:
        for item in str(name).split(","):
            item = item.strip()
            if item:
                wanted.append(item)
    if not wanted or "all" in wanted:
        return list(SUITES)
    unknown = [n for n in wanted if n not in SUITES]
    if unknown:
        raise ValueError(f"unknown suite(s) {', '.join(unknown)}; known: all, {', '.join(SUITES)}")
    return [n for n in SUITES if n in wanted]


def part_generator(seed: int, part: str, layer: int) -> torch.Generator:
    """The generator of one (seed, part, layer): independent of which other suites or layers run."""
    return torch.Generator().manual_seed(zlib.crc32(f"lutb-check/{seed}/{part}/{layer}".encode()))


def _normal(tokens: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=gen)


def _heavy_tailed(tokens: int, hidden: int, headroom: float, gen: torch.Generator) -> torch.Tensor:
    """Student-t with 3 degrees of freedom, and 1-8 outlier channels scaled 20x-100x; scaled down to ``headroom``."""
    z = torch.randn(tokens, hidden, generator=gen)
    chi2 = torch.randn(tokens, hidden, 3, generator=gen).pow(2).sum(-1)
    x = z / torch.sqrt(chi2 / 3).clamp_min(1e-3)
    outliers = max(1, min(8, hidden // 64))
    channels = torch.randperm(hidden, generator=gen)[:outliers]
    factors = 20 + 80 * torch.rand(outliers, generator=gen)
    x[:, channels] *= factors
    amax = float(x.abs().max()) if x.numel() else 0.0
    return x * (headroom / amax) if amax > headroom else x


def tiny_exponents(dtype: torch.dtype) -> tuple[int, int]:
    """Range of ``e`` for tiny blocks of amax ``2^-e``: from well below the smallest normal into the subnormals."""
    info = torch.finfo(dtype)
    min_normal_exp = -int(round(math.log2(info.tiny)))  # 126 (bf16, fp32), 14 (fp16)
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    return min_normal_exp - 6, min_normal_exp + min(mantissa_bits, 7) - 1


def _blocks_scaled_to(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Rescale each 32-element block of ``x [T, H]`` so that its largest magnitude is ``amax [T, H/32]``."""
    tokens, hidden = x.shape
    blocks = x.reshape(tokens, hidden // BLOCK, BLOCK)
    current = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    return (blocks.double() / current.double() * amax.double().unsqueeze(-1)).reshape(tokens, hidden)


def _tiny(tokens: int, hidden: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(tokens, hidden, generator=gen)
    lo, hi = tiny_exponents(dtype)
    exps = torch.randint(lo, hi + 1, (tokens, hidden // BLOCK), generator=gen).double()
    tiny = torch.rand(tokens, hidden // BLOCK, generator=gen) < 0.5
    tiny[: min(2, tokens)] = True
    amax = torch.where(tiny, torch.exp2(-exps), x.reshape(tokens, hidden // BLOCK, BLOCK).abs().amax(-1).double())
    return _blocks_scaled_to(x, amax)


def _huge(tokens: int, hidden: int, headroom: float, gen: torch.Generator) -> torch.Tensor:
    """Block amaxes on, under and over ``448 * 2^j`` for the top binades below ``headroom``, and ``headroom`` itself."""
    x = torch.randn(tokens, hidden, generator=gen)
    top = math.floor(math.log2(max(headroom, E4M3_MAX) / E4M3_MAX))
    js = [j for j in (top, top - 1, top - 3, top - 8) if 448.0 * 2.0**j <= headroom] or [0]
    targets = [E4M3_MAX * 2.0**j * f for j in js for f in (1.0, 0.99, 1.01)] + [headroom, headroom * 0.75]
    targets = [t for t in targets if t <= headroom] or [headroom]
    choice = torch.randint(0, len(targets), (tokens, hidden // BLOCK), generator=gen)
    amax = torch.tensor(targets, dtype=torch.float64)[choice]
    return _blocks_scaled_to(x, amax)


def _inputs(kind: str, tokens: int, shape: NodeShape, gen: torch.Generator, headroom: float) -> torch.Tensor:
    hidden = shape.hidden_size
    if kind == "normal":
        x = _normal(tokens, hidden, gen)
    elif kind == "heavy_tailed":
        x = _heavy_tailed(tokens, hidden, headroom, gen)
    elif kind == "tiny":
        x = _tiny(tokens, hidden, shape.dtype, gen)
    elif kind == "huge":
        x = _huge(tokens, hidden, headroom, gen)
    else:  # pragma: no cover - SUITES is fixed
        raise ValueError(f"unknown input kind {kind!r}")
    return x.to(shape.dtype)


def _random_routes(tokens: int, k: int, num_experts: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, num_experts, generator=gen)
    weights, ids = softmax_topk(logits, k)
    return ids.to(torch.int32), weights.float()


def _cover_routes(held: Sequence[int], per_expert: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Route ``(t, j)`` to ``held[(t*k + j) % n]``: distinct experts per token, every expert ``>= per_expert`` routes."""
    n = len(held)
    tokens = math.ceil(per_expert * n / k)
    slots = torch.arange(tokens * k).reshape(tokens, k) % n
    ids = torch.tensor(held, dtype=torch.int32)[slots]
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1).float()
    return ids, weights


def make_part_batches(
    part: Part, suite: str, layer: int, shape: NodeShape, *, cap: int, seed: int, headroom: float = E4M3_MAX,
) -> list[Batch]:
    """The batches of one part in one layer (``index`` is left 0; :func:`make_batches` numbers them).

    Args:
        cap: largest request, in tokens (``>= 1``); lowered further to what fits ``shape.max_message_bytes``.
        headroom: largest block amax of ``huge`` inputs.
    """
    gen = part_generator(seed, part.name, layer)
    held = shape.experts[layer]
    standard = STANDARD_TOKENS  # always judged strictly (spec section 6's 64 tokens); .split(cap) sends it in parts
    routes = min(shape.num_experts, shape.max_top_k or shape.num_experts)  # most routes a token may have
    if part.weights_on_input:
        k = 1
    elif part.routing == "cover":
        k = max(1, min(shape.topk, len(held), routes))
    elif part.routing == "repeated":  # two routes at least, whatever --topk
        k = min(max(2, shape.topk), routes)
        if k < 2:
            return []  # one expert, or a node taking one route per token: no token can name an expert twice
    else:
        k = max(1, min(shape.topk, routes))
    itemsize = torch.empty((), dtype=shape.dtype).element_size()
    cap = max(1, min(cap, message_tokens(shape.max_message_bytes,
                                         token_bytes(shape.hidden_size, itemsize, k, part.output_mode))))
    if part.tokens == "small":
        sizes = small_sizes(cap)
    elif part.routing == "cover":
        sizes = [math.ceil(standard * len(held) / k)]
    else:
        sizes = [{"standard": standard, "single": standard, "max": cap}[part.tokens]]
    out: list[Batch] = []
    for tokens in sizes:
        if part.routing == "cover":
            ids, weights = _cover_routes(held, standard, k, gen)
            tokens = int(ids.shape[0])
        else:
            ids, weights = _random_routes(tokens, k, shape.num_experts, gen)
            if part.routing == "repeated" and k > 1:
                ids[:, 1] = ids[:, 0]
            if part.weights_on_input:
                weights = 0.25 + 0.75 * torch.rand(tokens, 1, generator=gen)
        x = _inputs(part.inputs, tokens, shape, gen, headroom)
        if not tokens:
            continue
        out.extend(Batch(
            index=0, suite=suite, part=part.name, layer=layer, hidden_states=x.contiguous(),
            topk_ids=ids.contiguous(), topk_weights=weights.contiguous(),
            apply_router_weight_on_input=part.weights_on_input, output_mode=part.output_mode, standard=part.standard,
            meta={"headroom": headroom} if part.inputs in HEADROOM_INPUTS else {},
        ).split(1 if part.tokens == "single" else cap))
    return out


def small_sizes(cap: int) -> list[int]:
    """Request sizes of ``small_batches`` under ``cap``: :data:`SMALL_SIZES` that fit (or ``cap`` itself), repeated
    until they hold at least :data:`STANDARD_TOKENS` tokens, so that their row is judged strictly."""
    fitting = [t for t in SMALL_SIZES if t <= cap] or [cap]
    sizes: list[int] = []
    while sum(sizes) < STANDARD_TOKENS:
        sizes.extend(fitting)
    return sizes


def make_batches(
    suites: Sequence[str],
    shape: NodeShape,
    layers: Sequence[int],
    *,
    cap: int,
    seed: int,
    headroom: Callable[[int], float] | None = None,
) -> list[Batch]:
    """All batches of ``suites`` for ``layers``, ordered by layer, then suite; numbered from 0.

    Args:
        headroom: ``layer -> amax`` bound of ``huge`` and ``heavy_tailed`` inputs (called only when those run).
    """
    out: list[Batch] = []
    for layer in layers:
        for suite in suites:
            for part in SUITES[suite]:
                room = headroom(layer) if (headroom is not None and part.inputs in HEADROOM_INPUTS) else E4M3_MAX
                out.extend(make_part_batches(part, suite, layer, shape, cap=cap, seed=seed, headroom=room))
    for i, batch in enumerate(out):
        batch.index = i
    return out


def headroom_probe(
    forward: Callable[[Batch], torch.Tensor], layer: int, shape: NodeShape, *, seed: int = 0,
    too_big: Callable[[Exception], bool],
) -> float:
    """Largest power of two ``2^e`` such that every 32-block of the input at amax ``2^e`` keeps the output finite, / 4.

    ``forward`` runs a probe batch (one token per expert held, ``k = 1``, weight 1,
    combined) on the judge, in requests of at most ``shape.max_tokens`` tokens; a non-finite
    output, or an exception ``too_big`` accepts (a refusal of the input), counts as "too big"; any
    other exception propagates (the judge's own failure is not a headroom).
    Binary search over ``e`` in ``[0, log2(dtype max)]``, about 7 probes for bfloat16.
    """
    held = shape.experts[layer]
    gen = part_generator(seed, "headroom", layer)
    base = torch.randn(len(held), shape.hidden_size, generator=gen)
    ids = torch.tensor(held, dtype=torch.int32).reshape(-1, 1)
    weights = torch.ones(len(held), 1, dtype=torch.float32)

    def finite_at(e: int) -> bool:
        amax = torch.full((len(held), shape.hidden_size // BLOCK), 2.0**e, dtype=torch.float64)
        x = _blocks_scaled_to(base, amax).to(shape.dtype)
        if not bool(torch.isfinite(x.float()).all()):
            return False
        probe = Batch(index=-1, suite="magnitudes", part="headroom", layer=layer, hidden_states=x, topk_ids=ids, topk_weights=weights)
        for batch in probe.split(max(1, shape.max_tokens)):  # more experts than a request may hold tokens: in parts
            try:
                out = forward(batch)
            except Exception as exc:  # noqa: BLE001 - a refusal of the input means "too big"
                if too_big(exc):
                    return False
                raise
            if not bool(torch.isfinite(out.float()).all()):
                return False
        return True

    lo, hi = 0, int(math.floor(math.log2(torch.finfo(shape.dtype).max)))
    if not finite_at(lo):
        return 1.0
    if finite_at(hi):
        return 2.0 ** (hi - 2)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if finite_at(mid):
            lo = mid
        else:
            hi = mid
    return 2.0 ** max(0, lo - 2)


__all__ = [
    "MESSAGE_MARGIN",
    "SMALL_SIZES",
    "STANDARD_TOKENS",
    "SUITES",
    "Batch",
    "NodeShape",
    "Part",
    "headroom_probe",
    "make_batches",
    "make_part_batches",
    "message_tokens",
    "part_generator",
    "resolve_suites",
    "small_sizes",
    "tiny_exponents",
    "token_bytes",
]
