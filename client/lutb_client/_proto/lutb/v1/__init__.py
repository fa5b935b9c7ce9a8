"""Generated code: package ``lutb.v1`` (``expert_service_pb2``, ``expert_service_pb2_grpc``)."""
