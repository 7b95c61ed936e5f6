"""A LocalCluster whose pods run small stand-in processes that take signals as the services do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from podrl.cli.local_cluster import Child, LocalCluster, pod_name

#: Stands for a service: runs until SIGTERM, then drains for a moment and exits 0. It touches
#: the file named by its argument once its handler is in place (a SIGTERM before that kills it,
#: as it would a real service that is still starting).
SERVICE = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.3), sys.exit(0)))\n"
    "open(sys.argv[1], 'w').close()\n"
    "while True: time.sleep(0.05)\n"
)


class StandInCluster(LocalCluster):
    """A LocalCluster whose services are the small stand-in processes of SERVICE."""

    exit_codes: dict[str, int]
    """Service → exit code it starts with (a crash at start), else it runs."""

    def _spawn_service(self, ordinal: int, service: str, restarts: int = 0) -> Child:
        code = self.exit_codes.get(f"{service}@{pod_name(ordinal)}")
        script = SERVICE if code is None else f"import sys; sys.exit({code})"
        name = service if ordinal == 0 else f"{service}@{pod_name(ordinal)}"
        marker = self.ready_marker(name)
        marker.unlink(missing_ok=True)
        process = subprocess.Popen([sys.executable, "-c", script, str(marker)])
        return Child(name, process, Path("/dev/null"), "", service, ordinal, restarts)

    def ready_marker(self, name: str) -> Path:
        return self.config.run_dir / f"{name}.ready"

    def all_ready(self) -> bool:
        """Every running stand-in has its SIGTERM handler in place."""
        return all(
            self.ready_marker(c.name).exists()
            for pod in self.pods.values()
            for c in pod.children.values()
            if c.process.poll() is None
        )

    def running(self) -> dict[str, list[str]]:
        return {
            pod.name: sorted(s for s, c in pod.children.items() if c.process.poll() is None)
            for pod in self.pods.values()
        }
