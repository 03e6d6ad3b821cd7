"""Generated protobuf modules."""
