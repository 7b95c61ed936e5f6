"""Generated protobuf/gRPC stubs for proto/podrl/v1 (regenerate with `make proto`; do not edit)."""
