"""Generated protobuf and gRPC stubs of ``proto/lutb/v1/expert_service.proto``.

Import them as ``from lutb_client._proto.lutb.v1 import expert_service_pb2, expert_service_pb2_grpc``.
Regenerate with ``python -m lutb_client._proto.generate`` (see that module).
"""
