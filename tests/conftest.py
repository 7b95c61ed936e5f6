"""Suite-wide settings: keep thread pools small (CI has 2 cores) and runs under tmp dirs."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
