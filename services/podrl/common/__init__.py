"""Plumbing every service shares: logs, gRPC server/client setup, metrics, process lifecycle."""
