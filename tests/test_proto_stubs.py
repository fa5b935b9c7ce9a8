"""The committed gRPC stubs match proto/lutb/v1/expert_service.proto (regenerated with grpc_tools)."""

from __future__ import annotations

import ast
import re
from importlib.metadata import version
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

from google.protobuf import descriptor_pb2  # noqa: E402

from lutb_client._proto import generate as gen  # noqa: E402
from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb  # noqa: E402

COMMITTED = Path(gen.__file__).resolve().parent / "lutb" / "v1"
FILES = ("expert_service_pb2.py", "expert_service_pb2.pyi", "expert_service_pb2_grpc.py")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stubs")
    gen.generate(out)
    return out / "lutb" / "v1"


def _tools_version_of(text: str) -> str | None:
    match = re.search(r"grpcio-tools ([^)]+)\)", text)
    return match.group(1) if match else None


@pytest.mark.parametrize("name", FILES)
def test_committed_stub_is_current(fresh: Path, name: str) -> None:
    committed = (COMMITTED / name).read_text()
    regenerated = (fresh / name).read_text()
    if _tools_version_of(committed) != version("grpcio-tools"):
        pytest.skip(f"stubs were generated with grpcio-tools {_tools_version_of(committed)}; "
                    f"{version('grpcio-tools')} is installed (the descriptor test still checks them)")
    assert committed == regenerated, f"{name} is stale: run `python -m lutb_client._proto.generate`"


def test_committed_descriptor_matches_proto(fresh: Path) -> None:
    """Independent of the grpcio-tools version: the serialized file descriptor equals a fresh compile."""
    text = (fresh / "expert_service_pb2.py").read_text()
    match = re.search(r"AddSerializedFile\((b'.*?')\)\n", text, flags=re.S)
    assert match is not None
    fresh_proto = descriptor_pb2.FileDescriptorProto.FromString(ast.literal_eval(match.group(1)))
    committed_proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(committed_proto)
    assert committed_proto == fresh_proto, "committed stubs are stale: run `python -m lutb_client._proto.generate`"


def test_stubs_are_package_relative_and_unguarded() -> None:
    for name in FILES:
        text = (COMMITTED / name).read_text()
        assert "from lutb.v1 import" not in text
        assert "ValidateProtobufRuntimeVersion" not in text
    grpc_text = (COMMITTED / "expert_service_pb2_grpc.py").read_text()
    assert f"GRPC_GENERATED_VERSION = '{gen.MIN_GRPCIO}'" in grpc_text


def test_contract_names() -> None:
    service = pb.DESCRIPTOR.services_by_name["ExpertService"]
    assert service.full_name == "lutb.v1.ExpertService"
    assert {m.name for m in service.methods} == {"GetModelInfo", "Forward", "ForwardStream"}
    stream = service.methods_by_name["ForwardStream"]
    assert stream.client_streaming and stream.server_streaming
    assert pb.DataType.Name(0) == "DATA_TYPE_UNSPECIFIED"
    for name in ("BFLOAT16", "FLOAT16", "FLOAT32", "INT32", "INT64", "UINT8", "FLOAT8_E4M3FN"):
        assert pb.DataType.Value(name) > 0
    request_fields = set(pb.ForwardRequest.DESCRIPTOR.fields_by_name)
    assert request_fields == {"request_id", "layer", "hidden_states", "topk_ids", "topk_weights",
                              "apply_router_weight_on_input", "output_mode", "hidden_scales", "expected_content_hash"}
    assert set(pb.Timing.DESCRIPTOR.fields_by_name) == {"queue_us", "compute_us", "total_us", "batch_tokens", "handoff_us",
                                                      "prepare_us", "encode_us", "wait_us"}
    assert set(pb.ForwardResponse.DESCRIPTOR.fields_by_name) == {"request_id", "output", "timing", "status"}
