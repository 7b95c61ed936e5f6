"""Rollouts beside the step driver: async mode's producer threads, the buffer of scored steps
and the generator gate; the multi-turn episode runner."""
