"""ExpertEngine.prepare on both input forms: torch tensors and the servicer's WireTensors (bytes, checked by numpy).

Each case is data: the same request given as torch tensors and as WireTensors must be accepted with the same
values, or refused with the same message; NaN/Inf counts are checked against torch's own ``isfinite``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lutb_client.codec import WireTensor, as_tensor, encode_tensor
from lutb_kernels.checkpoint import Checkpoint
from lutb_server.backends import choose_backend
from lutb_server.engine import ExpertEngine
from lutb_server.errors import InvalidArgument
from lutb_server.testing import make_tiny_checkpoint

HIDDEN, EXPERTS = 128, 8


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> ExpertEngine:
    ckpt = Checkpoint(tiny_checkpoint)
    return ExpertEngine(ckpt, choose_backend("reference", ckpt.config, torch.device("cpu")), validate_tiles=False)


def _wire(t: torch.Tensor) -> WireTensor:
    return WireTensor.from_message(encode_tensor(t))


def _inputs(tokens: int, k: int = 2, *, x_dtype: torch.dtype = torch.bfloat16, ids_dtype: torch.dtype = torch.int32,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(x_dtype)
    ids = torch.randint(0, EXPERTS, (tokens, k), generator=g).to(ids_dtype)
    w = torch.rand(tokens, k, generator=g)
    return x, ids, w


def _poke(t: torch.Tensor, value: float, *where: tuple[int, int]) -> torch.Tensor:
    t = t.clone()
    for i, j in where:
        t[i, j] = value
    return t


def _both(engine: ExpertEngine, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
    """prepare() on torch tensors and on WireTensors: (result or error message) for each."""
    out = []
    for form in (lambda t: t, _wire):
        try:
            out.append(engine.prepare(0, form(x), form(ids), form(w)))
        except InvalidArgument as exc:
            out.append(str(exc))
    return out


@pytest.mark.parametrize("tokens", [0, 1, 5, 16])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_accepted_requests_are_the_same_in_both_forms(engine: ExpertEngine, tokens: int, x_dtype: torch.dtype,
                                                      ids_dtype: torch.dtype) -> None:
    x, ids, w = _inputs(tokens, x_dtype=x_dtype, ids_dtype=ids_dtype, seed=tokens)
    from_torch, from_wire = _both(engine, x, ids, w)
    for r in (from_torch, from_wire):
        assert as_tensor(r.x).dtype == torch.bfloat16 and torch.equal(as_tensor(r.x), x.to(torch.bfloat16))
        assert as_tensor(r.topk_ids).dtype == torch.int32 and torch.equal(as_tensor(r.topk_ids), ids.to(torch.int32))
        assert torch.equal(as_tensor(r.topk_weights), w)
        assert r.tokens == tokens and r.output_shape == [tokens, HIDDEN] and r.pool_key == from_torch.pool_key
    # what needs no conversion stays the message's bytes
    assert isinstance(from_wire.x, WireTensor) == (x_dtype == torch.bfloat16)
    assert isinstance(from_wire.topk_ids, WireTensor) == (ids_dtype == torch.int32)
    assert isinstance(from_wire.topk_weights, WireTensor)
    if tokens:  # and the engine runs either form (forward_prepared once called .to() on the WireTensors)
        assert torch.equal(engine.forward_prepared(from_wire), engine.forward_prepared(from_torch))


NONFINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("value", NONFINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", [[(0, 0)], [(3, 127), (1, 5), (2, 64)]], ids=["one", "three"])
def test_nonfinite_hidden_states_are_refused_with_their_count(engine: ExpertEngine, x_dtype: torch.dtype, value: float,
                                                               where: list[tuple[int, int]]) -> None:
    x, ids, w = _inputs(4, x_dtype=x_dtype, seed=7)
    bad = _poke(x, value, *where)
    count = int((~torch.isfinite(bad.to(torch.bfloat16))).sum())  # independent count, after rounding
    for message in _both(engine, bad, ids, w):
        assert isinstance(message, str) and "hidden_states" in message and f"holds {count} NaN or Inf" in message


def test_values_that_overflow_when_rounded_are_refused(engine: ExpertEngine) -> None:
    x, ids, w = _inputs(2, x_dtype=torch.float32, seed=3)
    assert torch.isinf(torch.tensor(3.4e38).to(torch.bfloat16))  # above bfloat16's largest once rounded
    for message in _both(engine, _poke(x, 3.4e38, (1, 1)), ids, w):
        assert message == "hidden_states: holds 1 NaN or Inf value(s) after rounding torch.float32 to torch.bfloat16"
    assert not any(isinstance(r, str) for r in _both(engine, _poke(x, 3.0e38, (1, 1)), ids, w))  # still finite


@pytest.mark.parametrize("value", NONFINITE, ids=["nan", "inf", "-inf"])
def test_nonfinite_weights_are_refused(engine: ExpertEngine, value: float) -> None:
    x, ids, w = _inputs(3, seed=5)
    for message in _both(engine, x, ids, _poke(w, value, (2, 1))):
        assert message == "topk_weights: holds NaN or Inf"


@pytest.mark.parametrize(("value", "word"), [(-1, "-1"), (EXPERTS, str(EXPERTS)), (2**31 - 1, str(2**31 - 1))])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_expert_ids_out_of_range_are_refused(engine: ExpertEngine, value: int, word: str, ids_dtype: torch.dtype) -> None:
    x, ids, w = _inputs(3, ids_dtype=ids_dtype, seed=9)
    ids = ids.clone()
    ids[1, 0] = value
    for message in _both(engine, x, ids, w):
        assert isinstance(message, str) and message.startswith(f"topk_ids: expert id {word} outside")


def test_int64_ids_beyond_int32_are_refused_not_wrapped(engine: ExpertEngine) -> None:
    x, ids, w = _inputs(2, ids_dtype=torch.int64, seed=1)
    ids = ids.clone()
    ids[0, 1] = 2**32 + 1  # would wrap to 1 in int32
    for message in _both(engine, x, ids, w):
        assert isinstance(message, str) and "expert id 4294967297" in message


def test_non_contiguous_torch_inputs_are_checked(engine: ExpertEngine) -> None:
    x, ids, w = _inputs(4, seed=2)
    x_t = torch.randn(HIDDEN, 4).to(torch.bfloat16).t()  # a transposed view
    x_t[1, 2] = float("nan")
    with pytest.raises(InvalidArgument, match="holds 1 NaN or Inf"):
        engine.prepare(0, x_t, ids, w)
    ok = engine.prepare(0, x_t.nan_to_num(), ids.t().contiguous().t(), w)
    assert torch.equal(as_tensor(ok.x), x_t.nan_to_num())


@pytest.mark.parametrize(("max_top_k", "k", "refused"), [(3, 3, None), (3, 4, "exceed max_top_k = 3"),
                                                         (32, 9, "exceed the model's 8 experts"), (1, 1, None)])
def test_routes_per_token_are_bounded(tiny_checkpoint: Path, max_top_k: int, k: int, refused: str | None) -> None:
    """topk_ids' k is refused above the model's experts and above the server's max_top_k (a call's GPU memory and time
    grow with tokens x k), in both forms, with the field and the bound named."""
    ckpt = Checkpoint(tiny_checkpoint)
    bounded = ExpertEngine(ckpt, choose_backend("reference", ckpt.config, torch.device("cpu")), validate_tiles=False,
                           max_top_k=max_top_k)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(3, HIDDEN, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:min(k, EXPERTS)] for _ in range(3)]).to(torch.int32)
    if k > EXPERTS:
        ids = torch.cat([ids, ids[:, : k - EXPERTS]], dim=1)
    w = torch.rand(3, k, generator=g)
    for result in _both(bounded, x, ids, w):
        if refused is None:
            assert not isinstance(result, str) and result.topk_ids.shape == (3, k)
        else:
            assert isinstance(result, str) and result.startswith(f"topk_ids: k = {k} routes per token") and refused in result


def test_the_first_process_to_open_a_checkpoint_checks_its_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A damaged copy (bytes changed after the writer's SHA256SUMS) is refused when the server starts, where the
    format's checks alone would pass it (zero bytes are valid tiles); skipped with validation off, and in a process
    handed the content hash (front end 0 checked the same files)."""
    from lutb_kernels.checkpoint import CHECKSUMS
    from lutb_kernels.errors import LutBFormatError

    path = make_tiny_checkpoint(tmp_path / "ckpt")
    file = sorted(path.glob("*.safetensors"))[-1]
    data = bytearray(file.read_bytes())
    data[len(data) // 2:] = bytes(len(data) - len(data) // 2)
    file.write_bytes(bytes(data))

    def engine(**kwargs):  # noqa: ANN202
        ckpt = Checkpoint(path)
        return ExpertEngine(ckpt, choose_backend("reference", ckpt.config, torch.device("cpu")), **kwargs)

    with pytest.raises(LutBFormatError, match=rf"{file.name} differs from the sha256 in {CHECKSUMS}"):
        engine()
    engine(validate_tiles=False)
    engine(content_hash="sha256:" + "0" * 64)
    (path / CHECKSUMS).unlink()
    with caplog.at_level("WARNING", logger="lutb_server.engine"):
        engine()
    assert f"has no {CHECKSUMS}" in caplog.text
