"""Async mode's rollouts: the producer threads, the buffer of scored steps, the generator
gate."""
