"""The generator service."""
