"""Generated code: package ``lutb`` of the protobuf files."""
