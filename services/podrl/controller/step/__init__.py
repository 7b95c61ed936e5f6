"""One training step: the loop, its phases (generate, score, batch, train, weight sync), its
boundary."""
