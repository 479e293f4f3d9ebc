"""Generated protobuf/gRPC code (tools/gen_proto.py)."""
