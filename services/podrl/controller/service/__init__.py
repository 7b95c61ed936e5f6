"""The controller as a service: its entry point, the membership servicer, REST and status."""
