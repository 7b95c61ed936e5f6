"""What a run writes and reads back: step records, samples, tracking, checkpoints, resume and
evaluations."""
