"""bench/device_env.sh, the GPU machine's setup (docs/cuda.md): it installs the carried wheels
into ``PODRL_SITE`` and puts it on ``PYTHONPATH``, then unsets ``PODRL_SITE``, because every
``PODRL_*`` variable is read as a run-config override and an unknown one is refused."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from podrl.config import load_config
from podrl.config.loading import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_the_site_is_on_the_path_and_its_variable_is_gone(tmp_path: Path) -> None:
    (tmp_path / ".device-wheels").mkdir()
    (tmp_path / ".device-wheels" / "a-1.0-py3-none-any.whl").touch()
    site = tmp_path / "site"
    site.mkdir()
    (site / ".podrl-wheels").write_text("a-1.0-py3-none-any.whl \n")  # installed already
    script = f"export PODRL_SITE={site}; source {REPO / 'bench/device_env.sh'} || exit 3; "
    script += 'echo "site=${PODRL_SITE-unset}"; echo "path=$PYTHONPATH"'
    out = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout
    assert "site=unset" in out
    assert str(site) in out.split("path=", 1)[1]


def test_a_left_podrl_site_would_be_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match="site"):
        load_config(None, {"PODRL_SITE": "/somewhere"})
