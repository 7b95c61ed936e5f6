"""The grader service (``python -m podrl.grader``)."""

from podrl.grader.main import main

# The guard keeps worker processes (spawn/forkserver) from starting a second server.
if __name__ == "__main__":
    raise SystemExit(main())
