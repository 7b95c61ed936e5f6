"""The controller service: run loop, membership, REST status and metrics."""
