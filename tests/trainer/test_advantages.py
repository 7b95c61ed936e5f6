"""Group-relative advantages (pure Python; the controller imports them without torch)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from podrl.algorithms.advantages import batch_advantages, group_advantages


def test_mean_baseline_and_std_normalisation():
    result = group_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0)
    std = math.sqrt((4 * 0.25) / 3)  # sample std
    assert not result.dropped
    assert result.mean == 0.5 and result.std == pytest.approx(std)
    assert result.advantages == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])


def test_without_std_normalisation_only_the_mean_is_removed():
    result = group_advantages([3.0, 1.0, 2.0], normalize_std=False)
    assert result.advantages == pytest.approx([1.0, -1.0, 0.0])


def test_zero_variance_and_singleton_groups_are_dropped():
    groups = batch_advantages({"same": [0.5, 0.5, 0.5], "one": [1.0], "mixed": [0.0, 1.0]})
    assert groups["same"].dropped and groups["same"].advantages == ()
    assert groups["one"].dropped
    assert not groups["mixed"].dropped and sum(groups["mixed"].advantages) == pytest.approx(0)


def test_non_finite_reward_is_an_error():
    with pytest.raises(ValueError, match=r"rewards\[1\] of group 'p'"):
        group_advantages([0.0, float("nan")], key="p")


def test_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
        "from podrl.algorithms.advantages import group_advantages\n"
        "print(group_advantages([0, 1]).advantages)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "0.707" in out.stdout
