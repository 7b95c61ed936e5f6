"""Policy-drift warnings: a trained step whose mismatch KL or update size leaves the band of
``loop.drift_warnings`` (docs/algorithms.md, "When RL drifts") gets a warning that names the
knobs to turn. Unknown figures (None) never warn: nothing was measured."""

from __future__ import annotations

from typing import Any

from podrl.config.loop import DriftWarningsConfig

#: What to turn when a figure leaves its band, by (figure, side).
KNOBS = {
    ("mismatch_kl", "high"): (
        "the trainer and the generator disagree on the samples' log-probabilities (stale "
        "samples, a step too large, or numerics): lower trainer.lr, lower loop.max_staleness, "
        "or set trainer.off_policy.mask: token (or sequence) so far-off tokens get no gradient"
    ),
    # AdamW's step scales with the lr, hardly with the gradient's size: grad_clip is no knob.
    ("update_ratio", "high"): "one step moved the weights too far: lower trainer.lr",
    ("update_ratio", "low"): (
        "the policy does not move: raise trainer.lr (check trainer.warmup_steps), or widen "
        "trainer.off_policy.mask_low/mask_high if the mask leaves no token a gradient"
    ),
}


def drift_warnings(
    step: int, figures: dict[str, Any], band: DriftWarningsConfig
) -> list[dict[str, Any]]:
    """The warnings of one step's figures: each {step, figure, value, limit, side, knobs,
    message}, in the order mismatch_kl, update_ratio."""
    checks = (
        ("mismatch_kl", "high", band.mismatch_kl_max),
        ("update_ratio", "high", band.update_ratio_max),
        ("update_ratio", "low", band.update_ratio_min),
    )
    out = []
    for figure, side, limit in checks:
        value = figures.get(figure)
        if value is None:
            continue
        outside = value > limit if side == "high" else value < limit
        if not outside:
            continue
        knobs = KNOBS[(figure, side)]
        field = f"loop.drift_warnings.{figure}_{'max' if side == 'high' else 'min'}"
        relation = ">" if side == "high" else "<"
        out.append(
            {
                "step": step,
                "figure": figure,
                "value": value,
                "limit": limit,
                "side": side,
                "knobs": knobs,
                "message": f"step {step}: {figure} {value:.3g} {relation} {limit:g} "
                f"({field}): {knobs}",
            }
        )
    return out
