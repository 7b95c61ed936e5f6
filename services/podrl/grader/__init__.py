"""The grader service."""
