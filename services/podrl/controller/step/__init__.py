"""One training step: the loop and its drivers, the batch, and the calls to the pods'
services."""
