"""Suite-wide settings: keep thread pools small (CI has 2 cores) and runs under tmp dirs; one
run secret for every service a test starts (services refuse to start without one, and clients
made by tests/foundation/run_secret.py sign their calls with it)."""

import os
import secrets

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "PODRL_RUN_SECRET_FILE" not in os.environ:
    os.environ.setdefault("PODRL_RUN_SECRET", secrets.token_hex(32))
