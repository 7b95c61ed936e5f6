"""The generator service (``python -m podrl.generator``)."""

from podrl.generator.main import main

# vLLM starts its workers with `spawn`, which re-imports this module: run only as the entry.
if __name__ == "__main__":
    raise SystemExit(main())
