"""Schedules as data: what every worker does, in order.

One generator builds a `Schedule` for each mode; the runtime, the reference executor and the
simulator all interpret it, and `validate` checks it without running anything.

    >>> s = generate("pipedream", (1, 1, 1, 1), 8)
    >>> " ".join(map(str, s.workers[0][:9]))
    '0F0 0F1 0F2 0F3 0B0 0U 0F4 0B1 0U'

Modes (PipeDream SOSP'19 sections 3.2-3.3; PipeDream-2BW/Flush arXiv 2006.09503 sections 3.1-3.2):
`pipedream` (1F1B with weight stashing), `vsync` (1F1B, one staleness for all stages), `2bw`
(1F1B, double-buffered weights, a step every m microbatches), `flush` (1F1B per batch of m, then
a flush and a step), `gpipe` (all forwards, all backwards, a step, per batch of m), `zb` (flush
with each backward split in two, the weight gradients filling the drain: ZB-H1, Qi et al. 2023),
`zb2` (zb with twice the warm-up forwards and weight lag, filling the start of a batch too: ZB-H2).

The package's modules, all pure standard library:
- `modes`: the mode table (`TABLE`, one `Mode` row of rules per mode; `MODES`, its keys; `rules`),
  `resolve` (a run's effective mode, group and minibatches per step), and the rules that need
  only plain values (`warmup_forwards`, `weight_lag`, `copies_per_step`, `default_group`, `checkpoint_unit`);
- `core`: `Action`, `Schedule` (ranks, text form, `versions`), the rules that need a schedule
  (`step_group`, `steps`, `stash_depth`), `peak_versions` and `stash_copies`;
- `generator`: `generate`, the schedule of each mode;
- `lower`: `lower`, every worker's ops with their communication made explicit (`Op`): what
  the runtime, the simulator and the validator read;
- `check`: `validate`.
Import the names from here.
"""
from .check import validate
from .core import (
    ASYNC_MODES, FLUSH_MODES, KINDS, SPLIT_MODES, TIE_MODES, Action, Schedule, check_parameters, peak_versions,
    stash_copies, stash_depth, step_group, steps,
)
from .modes import (
    DEFAULT, DEFAULT_TIED, MODES, TABLE, Mode, Run, checkpoint_unit, copies_per_step, default_group, listed,
    modes_where, resolve, rules, warmup_forwards,
)
from .generator import generate
from .lower import ACTIVATION, GRADIENT, Lowered, Op, lower

__all__ = [
    "ACTIVATION", "ASYNC_MODES", "DEFAULT", "DEFAULT_TIED", "FLUSH_MODES", "GRADIENT", "KINDS", "Lowered", "MODES",
    "Mode", "Op", "Run", "SPLIT_MODES", "TABLE", "TIE_MODES", "lower", "Action", "Schedule", "check_parameters",
    "checkpoint_unit", "default_group", "generate", "listed", "modes_where", "peak_versions", "resolve", "rules",
    "stash_depth", "step_group", "steps", "validate", "warmup_forwards",
]
