"""The environment service (``python -m podrl.environments``)."""

from podrl.environments.main import main

# The guard keeps worker processes (spawn/forkserver) from starting a second server.
if __name__ == "__main__":
    raise SystemExit(main())
