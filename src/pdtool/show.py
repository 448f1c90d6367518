"""Readable tables of artifacts, for `pd show` (pandas renders them)."""
from __future__ import annotations

import pandas as pd

from .profile import Profile

MB = 1e6


def profile_table(profile: Profile, top: int = 15) -> str:
    """The `top` heaviest layers (forward + backward time) and the profile's totals, as text."""
    total = profile.layer_sum_ms or 1.0
    frame = pd.DataFrame(
        {
            "id": layer.id,
            "layer": layer.name,
            "kind": layer.kind,
            "fwd ms": layer.fwd_ms,
            "bwd ms": layer.bwd_ms,
            "% time": 100.0 * layer.total_ms / total,
            "act MB": layer.act_bytes / MB,
            "param MB": layer.param_bytes / MB,
        }
        for layer in profile.layers
    )
    heaviest = frame.assign(_t=frame["fwd ms"] + frame["bwd ms"]).nlargest(top, "_t", keep="first").drop(columns="_t")
    table = heaviest.to_string(index=False, float_format=lambda x: f"{x:.3f}")
    model = profile.model.spec if profile.model else "(imported)"
    kwargs = " ".join(f"{k}={v}" for k, v in sorted(profile.model.kwargs.items())) if profile.model else ""
    skips = sum(1 for s, d in profile.edges if d > s + 1)
    ratio = profile.layer_sum_over_step
    lines = [
        f"model        {model} {kwargs}".rstrip(),
        f"measured on  {profile.device}, torch {profile.torch_version}, batch {profile.batch_size}, "
        f"{profile.repeats} repeats",
        f"layers       {len(profile.layers)} ({profile.method}, granularity {profile.granularity}"
        f"{f', depth {profile.depth}' if profile.depth else ''}), {len(profile.edges)} edges ({skips} skip layers)",
        f"parameters   {profile.param_bytes / MB:.3f} MB",
        f"layer sum    {profile.layer_sum_ms:.3f} ms (fwd {sum(l.fwd_ms for l in profile.layers):.3f} + "
        f"bwd {sum(l.bwd_ms for l in profile.layers):.3f})",
        f"whole step   {profile.step_ms:.3f} ms (spread {profile.step_ms_spread:.3f}); layer sum / step = "
        + (f"{ratio:.3f}" if ratio is not None else "n/a"),
        "",
        f"heaviest {min(top, len(profile.layers))} of {len(profile.layers)} layers:",
        table,
    ]
    return "\n".join(lines) + "\n"
