"""Auth section of the run config: whether the services authenticate each other.

The run secret itself is never part of the run config (the config is a ConfigMap on Kubernetes
and a file anyone may read): every service reads it at start from the environment,

- ``PODRL_RUN_SECRET_FILE``: a file holding it (``podrl up``/``podrl run`` write one per start
  under the run dir with mode 0600; the Helm chart mounts its Secret and sets the variable), or
- ``PODRL_RUN_SECRET``: the value itself (docker-compose passes it this way).

``podrl.common.auth.load_run_secret`` reads it; a service without one refuses to start (exit
2) unless ``auth.disabled`` is true. The trust model is docs/security.md.
"""

from __future__ import annotations

from pydantic import Field

from podrl.config.base import Section

#: Environment variables naming the run secret (a file, or the value); not config overrides.
SECRET_FILE_ENV = "PODRL_RUN_SECRET_FILE"
SECRET_VALUE_ENV = "PODRL_RUN_SECRET"
#: Shorter secrets are refused: 32 characters of `openssl rand -hex 16` are 128 bits.
MIN_SECRET_CHARS = 32


class AuthConfig(Section):
    """How the run's services authenticate each other (docs/security.md)."""

    disabled: bool = Field(
        False,
        description="Run without authentication: every caller that reaches a port may call "
        "every RPC, as any worker. Only for debugging on a machine of your own; by default a "
        f"service refuses to start without a run secret ({SECRET_FILE_ENV} or "
        f"{SECRET_VALUE_ENV}).",
    )
