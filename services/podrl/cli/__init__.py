"""The ``podrl`` command: local launcher, status and run tools."""
