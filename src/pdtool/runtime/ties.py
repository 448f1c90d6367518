"""Tied weights' rules, read by the launcher and the workers alike (`runtime.worker.tied` is the
workers' torch side: the all-reduce of the copies' gradients): which mode refuses them, which stage
owns a tied parameter in checkpoints, and which stages share one. Pure: no torch."""
from __future__ import annotations

from ..errors import LaunchError
from ..schedule.modes import ties_refusal


def check_mode(stages, mode: str) -> None:
    """Refuse tied weights across stages in a mode that updates the copies at different times
    (the launcher's check of the built stages; `Plan.untrainable` says the same from the plan)."""
    ties = sorted({(stage.param_names[name], users) for stage in stages for name, users in stage.tied.items()})
    refusal = ties_refusal(mode)
    if ties and refusal:
        name, users = ties[0]
        stages_text = ", ".join(map(str, users[:-1])) + f" and {users[-1]}"
        raise LaunchError(f"parameter {name} is used by stages {stages_text} (tied weights), and {refusal}")


def owner(users: tuple[int, ...]) -> int:
    """The stage whose shard holds a tied parameter in checkpoints."""
    return min(users)


def sets(stages) -> list[tuple[int, ...]]:
    """The sets of stages that share a parameter, sorted (the `ties` of `schedule.lower`)."""
    return sorted({users for stage in stages for users in stage.tied.values()})
