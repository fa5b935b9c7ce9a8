"""Settings precedence (CLI > env > YAML > defaults), `lutb serve --help`, and the backend registry."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from lutb_kernels.checkpoint import Checkpoint, CheckpointConfig
from lutb_kernels.experts.base import LayerExperts, Support
from lutb_server import backends
from lutb_server.backends import AUTO_ORDER, BACKENDS, BackendEntry, choose_backend, load_class, resolve_device
from lutb_server.cli import serve_cmd
from lutb_server.app import arena_bytes
from lutb_server.errors import BackendUnavailableError
from lutb_server.settings import ServerSettings, env_name, flag_name, load_settings
from lutb_server.shared_arena import SharedArena, arena_supported

FIXED_NAMES = {
    "checkpoint": "LUTB_CHECKPOINT", "host": "LUTB_HOST", "port": "LUTB_PORT", "metrics_port": "LUTB_METRICS_PORT",
    "backend": "LUTB_BACKEND", "device": "LUTB_DEVICE", "max_batch_tokens": "LUTB_MAX_BATCH_TOKENS",
    "max_wait_us": "LUTB_MAX_WAIT_US", "max_queue_requests": "LUTB_MAX_QUEUE_REQUESTS",
    "max_tokens_per_request": "LUTB_MAX_TOKENS_PER_REQUEST", "shutdown_grace_s": "LUTB_SHUTDOWN_GRACE_S",
    "config": "LUTB_CONFIG", "demo_dir": "LUTB_DEMO_DIR",
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FIXED_NAMES.values():
        monkeypatch.delenv(name, raising=False)


def _parse(argv: list[str]) -> ServerSettings:
    parser = argparse.ArgumentParser()
    serve_cmd.register(parser.add_subparsers())
    return serve_cmd.settings_from_args(parser.parse_args(["serve", *argv]))


def test_fixed_names_and_defaults() -> None:
    for field, env in FIXED_NAMES.items():
        assert field in ServerSettings.model_fields and env_name(field) == env
    s = load_settings({})
    assert (s.checkpoint, s.host, s.port, s.metrics_port, s.backend, s.device, s.shutdown_grace_s) == (
        None, "0.0.0.0", 50051, 9400, "auto", "auto", 20.0)
    assert s.demo_dir == Path("~/.cache/lutb-moe/demo").expanduser()


def test_precedence_cli_env_file_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "lutb.yaml"
    config.write_text("port: 1111\nmax_wait_us: 7\nmetrics-port: 5\nmax_queue_requests: 3\n")
    monkeypatch.setenv("LUTB_CONFIG", str(config))
    monkeypatch.setenv("LUTB_PORT", "2222")
    monkeypatch.setenv("LUTB_MAX_WAIT_US", "8")
    s = _parse(["--max-wait-us", "9"])
    assert s.max_wait_us == 9  # CLI over env and file
    assert s.port == 2222  # env over file
    assert s.metrics_port == 5 and s.max_queue_requests == 3  # file over defaults
    assert s.max_batch_tokens == ServerSettings.model_fields["max_batch_tokens"].default


def test_an_empty_variable_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """LUTB_CHECKPOINT= (how a manifest unsets it) once meant Path("") = the working directory, not the demo."""
    monkeypatch.setenv("LUTB_CHECKPOINT", "")
    monkeypatch.setenv("LUTB_PORT", "")
    s = load_settings({})
    assert s.checkpoint is None and s.port == 50051


def test_the_config_file_is_the_one_the_settings_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Environment variables are read case-insensitively (pydantic-settings): ``lutb_config`` set settings.config,
    which the log shows, while the file loader looked up LUTB_CONFIG only and applied none of the file's values."""
    config = tmp_path / "lower.yaml"
    config.write_text("port: 1111\n")
    for name in ("LUTB_CONFIG", "lutb_config"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("lutb_config", str(config))
    s = load_settings({})
    assert s.config == config and s.port == 1111
    other = tmp_path / "flag.yaml"
    other.write_text("port: 2222\n")
    s = _parse(["--config", str(other)])  # the flag over the variable, for the file as for its values
    assert s.config == other and s.port == 2222
    monkeypatch.setenv("lutb_config", "")  # empty: unset, as for every variable
    assert load_settings({}).config is None and load_settings({}).port == 50051


def test_an_empty_flag_or_file_value_is_unset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--checkpoint ""`` and ``checkpoint: ''`` once meant Path("") = the working directory, as LUTB_CHECKPOINT= did
    before it counted as unset; now all three mean no checkpoint (the demo), and the layers below fill in."""
    for name in ("LUTB_CHECKPOINT", "LUTB_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    assert _parse(["--checkpoint", ""]).checkpoint is None
    config = tmp_path / "empty.yaml"
    config.write_text("checkpoint: ''\nhost: ''\n")
    s = _parse(["--config", str(config)])
    assert s.checkpoint is None and s.host == "0.0.0.0"
    config.write_text(f"checkpoint: {tmp_path / 'ckpt'}\n")
    assert _parse(["--config", str(config), "--checkpoint", ""]).checkpoint == tmp_path / "ckpt"  # the file's
    monkeypatch.setenv("LUTB_CHECKPOINT", str(tmp_path / "env"))
    assert _parse(["--checkpoint", ""]).checkpoint == tmp_path / "env"  # the variable's


def test_graphs_are_not_captured_for_a_top_k_no_request_may_carry() -> None:
    with pytest.raises(ValidationError, match="cuda_graph_top_k = 16 exceeds max_top_k = 8"):
        load_settings({"cuda_graph_top_k": 16, "max_top_k": 8})
    assert load_settings({"cuda_graph_top_k": 8, "max_top_k": 8}).max_top_k == 8
    assert load_settings({"max_top_k": 2}).cuda_graph_top_k == 2  # the default follows a lower bound
    assert load_settings({}).cuda_graph_top_k == 8


def test_front_ends_need_metrics_ports_within_range() -> None:
    kwargs = {"compute_worker": "process", "front_ends": 2}
    with pytest.raises(ValidationError, match="no port for front ends 1..1"):
        load_settings({**kwargs, "metrics_port": 65535})
    assert load_settings({**kwargs, "metrics_port": 65534}).metrics_port == 65534
    assert load_settings({**kwargs, "metrics_port": 0}).metrics_port == 0  # metrics off


def test_batches_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings({}).batches_in_flight == 1
    assert _parse(["--batches-in-flight", "3"]).batches_in_flight == 3
    monkeypatch.setenv("LUTB_BATCHES_IN_FLIGHT", "2")
    assert load_settings({}).batches_in_flight == 2
    with pytest.raises(ValidationError, match="batches_in_flight"):
        load_settings({"batches_in_flight": 0})


def test_max_message_bytes_is_at_most_what_grpc_takes(tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """gRPC's channel arguments are C ints: max_message_bytes >= 2**31 made grpc.aio.server() raise OverflowError
    after start-up had begun (a traceback, exit 1). The settings refuse it, so `lutb serve` reports an invalid
    setting with exit status 2 like any other."""
    from lutb_server.cli import main

    assert load_settings({"max_message_bytes": 2**31 - 1}).max_message_bytes == 2**31 - 1
    with pytest.raises(ValidationError, match="max_message_bytes"):
        load_settings({"max_message_bytes": 2**31})
    argv = ["serve", "--checkpoint", str(tiny_checkpoint), "--port", "0", "--metrics-port", "0", "--device", "cpu",
            "--backend", "reference", "--no-validate-checkpoint", "--max-message-bytes", str(2**31)]
    assert main(argv) == serve_cmd.EXIT_STARTUP_ERROR
    err = capsys.readouterr().err
    assert "lutb serve: invalid settings" in err and "max_message_bytes" in err


def test_config_flag_and_bad_values(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("backend: reference\nvalidate_checkpoint: false\n")
    s = _parse(["--config", str(config), "--no-validate-checkpoint"])
    assert s.backend == "reference" and s.validate_checkpoint is False
    config.write_text("bogus: 1\n")
    with pytest.raises(ValidationError, match="bogus"):
        _parse(["--config", str(config)])
    with pytest.raises(ValidationError, match="device"):
        load_settings({"device": "gpu"})
    with pytest.raises(ValidationError, match="port"):
        load_settings({"port": 70000})


def test_help_documents_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="lutb")
    serve_cmd.register(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for field in ServerSettings.model_fields:
        assert flag_name(field) in text and env_name(field) in text


def test_device_resolution() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(BackendUnavailableError, match="no CUDA device"):
            resolve_device("cuda:0")


CONFIG = CheckpointConfig(128, 128, 8)


def test_registry_has_every_backend_and_auto_ends_with_reference() -> None:
    assert set(BACKENDS) == {"reference", "emulated", "packed", "native"}
    assert AUTO_ORDER[-1] == "reference"
    cls, why = load_class("reference")
    assert cls is not None and why == ""


def test_auto_on_cpu_explains_its_choice() -> None:
    choice = choose_backend("auto", CONFIG, torch.device("cpu"))
    if not torch.cuda.is_available():
        assert choice.name == "reference"
    assert choice.reason.startswith("auto")


class _NoGpu(LayerExperts):
    name = "nogpu"

    @classmethod
    def supports(cls, config, device):
        return Support(device.type == "cuda", "needs a CUDA device")

    def forward(self, *a, **k):  # pragma: no cover
        raise NotImplementedError

    @property
    def weight_bytes(self) -> int:  # pragma: no cover
        return 0


class _Broken(_NoGpu):
    @classmethod
    def supports(cls, config, device):
        raise RuntimeError("driver exploded")


class _HalfDone(LayerExperts):
    """A backend of one's own that forgot ``weight_bytes``: still abstract."""

    name = "half_done"

    @classmethod
    def supports(cls, config, device):
        return Support(True, "runs anywhere")

    def forward(self, *a, **k):  # pragma: no cover
        raise NotImplementedError


class _SaysTrue(_NoGpu):
    @classmethod
    def supports(cls, config, device):
        return True


@pytest.mark.parametrize("name, reason", [
    ("lutb_kernels.experts.base:LayerExperts", "is abstract"),
    ("lutb_kernels.experts._triton_common:RoutedTritonExperts", "is abstract"),
    ("fake_half_done:HalfDone", "is abstract (it does not implement weight_bytes)"),
    ("fake_half_done:SaysTrue", "supports() returned bool, not a Support"),
])
def test_a_backend_that_cannot_serve_is_refused_with_a_reason(name: str, reason: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An abstract class (the base itself, or one of one's own missing a member) and a class whose supports() does
    not return a Support are refused by choose_backend with the reason, not chosen to fail when the engine builds
    its layers (TypeError) or crash the choice (AttributeError)."""
    import re
    import sys
    import types

    module = types.ModuleType("fake_half_done")
    module.HalfDone, module.SaysTrue = _HalfDone, _SaysTrue
    monkeypatch.setitem(sys.modules, "fake_half_done", module)
    with pytest.raises(BackendUnavailableError, match=re.escape(reason)):
        choose_backend(name, CONFIG, torch.device("cpu"))


def test_unavailable_backends_give_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    module = types.ModuleType("fake_backends")
    module.NoGpu, module.Broken = _NoGpu, _Broken
    monkeypatch.setitem(__import__("sys").modules, "fake_backends", module)
    registry = dict(BACKENDS)
    registry["nogpu"] = BackendEntry("nogpu", "fake_backends", "NoGpu")
    registry["broken"] = BackendEntry("broken", "fake_backends", "Broken")
    registry["missing"] = BackendEntry("missing", "no_such_module_anywhere", "X")
    registry["wrongclass"] = BackendEntry("wrongclass", "fake_backends", "Nothing")
    monkeypatch.setattr(backends, "BACKENDS", registry)
    monkeypatch.setattr(backends, "AUTO_ORDER", ("missing", "broken", "nogpu", "wrongclass", "reference"))
    cpu = torch.device("cpu")
    for name, words in {"nogpu": "needs a CUDA device", "broken": "driver exploded", "missing": "cannot be imported",
                        "wrongclass": "no LayerExperts subclass", "bogus": "unknown backend"}.items():
        with pytest.raises(BackendUnavailableError) as info:
            choose_backend(name, CONFIG, cpu)
        assert words in str(info.value) and name in str(info.value)
    choice = choose_backend("auto", CONFIG, cpu)
    assert choice.name == "reference"
    for words in ("missing:", "broken:", "nogpu:", "wrongclass:"):
        assert words in choice.reason


def test_demo_checkpoint_is_made_once_and_served(tmp_path: Path) -> None:
    pytest.importorskip("lutb_kernels.synth")
    from lutb_client import ExpertClient
    from lutb_server.app import DEMO_NAME, ensure_demo_checkpoint
    from lutb_server.testing import ServerThread

    path = ensure_demo_checkpoint(tmp_path)
    assert path == tmp_path / DEMO_NAME
    assert Checkpoint(path).verify_files()  # the demo is written with SHA256SUMS, so its files are checked at start
    stamp = [f.stat().st_mtime_ns for f in sorted(path.glob("*.safetensors"))]
    assert ensure_demo_checkpoint(tmp_path) == path
    assert [f.stat().st_mtime_ns for f in sorted(path.glob("*.safetensors"))] == stamp  # cached, not remade
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    with ServerThread(demo_dir=tmp_path) as server, ExpertClient(server.address, connections=3) as client:
        info = client.model_info()
        assert client.spread_connections() == [0, 0, 0]  # one serving process: nothing to spread
    assert (info.hidden_size, info.num_experts, len(info.layers)) == (256, 8, 2)
    assert (info.front_end, info.front_ends) == (0, 1)


def test_intra_op_threads_default_to_one_on_cuda_only() -> None:
    from lutb_server.app import apply_intra_op_threads

    assert ServerSettings().intra_op_threads == 0
    before = torch.get_num_threads()
    try:
        assert apply_intra_op_threads(0, torch.device("cpu")) == before  # torch's default on a CPU device
        assert apply_intra_op_threads(0, torch.device("cuda:0")) == 1  # no device needed: only the type is read
        assert apply_intra_op_threads(2, torch.device("cuda:0")) == 2  # an explicit count wins
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_gil_switch_interval_defaults_to_200_us_on_cuda_only() -> None:
    import sys

    from lutb_server.app import apply_gil_switch_interval

    assert ServerSettings().gil_switch_interval_us == 0
    assert ServerSettings(gil_switch_interval_us=250).gil_switch_interval_us == 250
    before = sys.getswitchinterval()
    try:
        assert apply_gil_switch_interval(0, torch.device("cpu")) == before  # Python's default on a CPU device
        assert abs(apply_gil_switch_interval(0, torch.device("cuda:0")) - 200e-6) < 1e-9  # only the type is read
        assert abs(apply_gil_switch_interval(2000, torch.device("cpu")) - 2e-3) < 1e-9  # an explicit value wins
    finally:
        sys.setswitchinterval(before)


def test_settle_gc_freezes_what_start_up_left_and_collects_the_young_less_often() -> None:
    """settle_gc: garbage is collected first (not frozen), the objects alive are frozen, the young threshold rises;
    the middle and old thresholds stay."""
    import gc

    from lutb_server.app import GC_YOUNG_THRESHOLD, settle_gc

    before = gc.get_threshold()
    gc.unfreeze()

    class Node:
        pass

    def make_cycle() -> None:
        a, b = Node(), Node()
        a.other, b.other = b, a  # type: ignore[attr-defined]

    kept = [Node() for _ in range(100)]
    try:
        make_cycle()  # unreachable: only the collector frees it
        line = settle_gc()
        frozen = gc.get_freeze_count()
        assert frozen > len(kept) and line == f"gc: {frozen} start-up objects frozen, young-generation threshold {GC_YOUNG_THRESHOLD}"
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
        gc.unfreeze()  # the frozen objects go back to the oldest generation: the cycle is no longer there
        assert not any(type(o) is Node and o not in kept for o in gc.get_objects())
        assert sum(type(o) is Node for o in gc.get_objects()) == len(kept)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


@pytest.mark.parametrize(("batch", "per_request", "want"), [(8192, 4096, 8192), (512, 4096, 4096), (512, 512, 512)])
def test_warm_up_covers_the_largest_batch_the_worker_can_get(batch: int, per_request: int, want: int) -> None:
    """A request above max_batch_tokens runs alone: the warm-up must reach it too, or its first call compiles under
    load. The compute process merges front ends' batches up to max_batch_tokens, not up to the warm-up's limit."""
    from types import SimpleNamespace

    from lutb_server.app import warm_up_limit, worker_spec

    s = ServerSettings(max_batch_tokens=batch, max_tokens_per_request=per_request)
    assert warm_up_limit(s) == want
    plan = SimpleNamespace(checkpoint=SimpleNamespace(path=Path("/ckpt")),
                           backend=SimpleNamespace(name="packed", device=torch.device("cuda:0")))
    spec = worker_spec(plan, s)  # type: ignore[arg-type]
    assert (spec.warm_up_tokens, spec.max_batch_tokens) == (want, batch)
    assert spec.spin_s == 0.0  # compute_spin_us's default: no poll
    spun = ServerSettings(max_batch_tokens=batch, max_tokens_per_request=per_request, compute_worker="process",
                          compute_spin_us=1500)
    assert worker_spec(plan, spun).spin_s == pytest.approx(1.5e-3)  # type: ignore[arg-type]


def test_a_backend_of_ones_own_by_import_path() -> None:
    """``package.module:Class`` names a LayerExperts subclass outside the registry; bad paths are refused with why."""
    from lutb_server.testing import SleepExperts

    cpu = torch.device("cpu")
    choice = choose_backend("lutb_server.testing:SleepExperts", CONFIG, cpu)
    assert choice.cls is SleepExperts and choice.name == "lutb_server.testing:SleepExperts"
    for name, words in {"no_such_module_anywhere:X": "cannot be imported", "lutb_server.testing:Nope": "no LayerExperts subclass",
                        "lutb_server.testing:ServerThread": "no LayerExperts subclass"}.items():
        with pytest.raises(BackendUnavailableError, match=words):
            choose_backend(name, CONFIG, cpu)
    assert ServerSettings(backend="pkg.sub_mod:My_Experts").backend == "pkg.sub_mod:My_Experts"
    for bad in ("fastest", "pkg.mod:", ":Class", "pkg mod:Class"):
        with pytest.raises(ValueError, match="package.module:Class"):
            ServerSettings(backend=bad)


@pytest.mark.skipif(not arena_supported(), reason="needs os.memfd_create (Linux)")
@pytest.mark.parametrize("in_flight", [1, 2, 3])
def test_arena_holds_a_full_batch_beside_the_others_in_flight(in_flight: int) -> None:
    """With N batches in flight, a full batch finds an unbroken span whatever spans the other N - 1 hold: here a
    small batch went first and was answered while full ones stayed (the ring's worst hole). Sized for two batches
    whatever N, the third full batch found no room at N = 2 and went inline through the socket."""
    hidden, top_k, full_tokens = 256, 8, 64
    settings = load_settings({"max_batch_tokens": full_tokens, "batches_in_flight": in_flight, "cuda_graph_top_k": top_k})
    plan = SimpleNamespace(checkpoint=SimpleNamespace(config=SimpleNamespace(hidden_size=hidden, torch_dtype=torch.bfloat16)))

    def shapes(tokens: int) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        return [(torch.bfloat16, (tokens, hidden)), (torch.int32, (tokens, top_k)), (torch.float32, (tokens, top_k)),
                (torch.bfloat16, (tokens, hidden))]

    arena = SharedArena.create(arena_bytes(plan, settings))  # type: ignore[arg-type]
    try:
        small = arena.place(shapes(1))
        assert small is not None
        held = [arena.place(shapes(full_tokens)) for _ in range(in_flight - 1)]
        assert all(h is not None for h in held)
        arena.release(small[0].offset)  # the small batch answered first
        for _ in range(3):  # each full batch answered oldest first while the next ones go over
            nxt = arena.place(shapes(full_tokens))
            assert nxt is not None, f"a full batch found no room with {in_flight - 1} other(s) in flight"
            held.append(nxt)
            if len(held) >= in_flight:
                oldest = held.pop(0)
                assert oldest is not None
                arena.release(oldest[0].offset)
    finally:
        arena.close()


def test_a_misspelt_variable_is_named_with_the_setting_it_missed() -> None:
    """pydantic-settings ignores LUTB_* variables that match no setting; `lutb serve` warns about each."""
    from lutb_server.settings import unknown_env

    env = {"LUTB_FRONTENDS": "8", "LUTB_SHUTDOWN_GRACE": "120", "LUTB_PORT": "1", "LUTB_SLEEP_EXPERTS": "1,0", "HOME": "/"}
    assert unknown_env(env) == [
        "LUTB_FRONTENDS is not a setting; ignored (did you mean LUTB_FRONT_ENDS?)",
        "LUTB_SHUTDOWN_GRACE is not a setting; ignored (did you mean LUTB_SHUTDOWN_GRACE_S?)",
    ]
    assert unknown_env({env_name(name): "x" for name in ServerSettings.model_fields}) == []
