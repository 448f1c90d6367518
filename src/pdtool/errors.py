"""The error family of pdtool and the exit codes the CLI maps it to.

Every error a user can cause is a `PdtoolError` whose message is one line saying what was
wrong, where, and how to fix it. The CLI prints that line and exits with `EXIT_ERROR`;
click's own usage errors exit with `EXIT_USAGE`.
"""

EXIT_ERROR = 1
EXIT_USAGE = 2


class PdtoolError(Exception):
    """A mistake in what the user gave pdtool (input file, flag value, model)."""

    exit_code = EXIT_ERROR


class ArtifactError(PdtoolError):
    """A JSON artifact that is missing, malformed, of the wrong schema or inconsistent."""


class ModelError(PdtoolError):
    """A model spec that cannot be imported, a factory that fails, or a bad factory result."""


class ProfileError(PdtoolError):
    """Profiling failed: the model rejected its input or could not be measured."""


class PlanError(PdtoolError):
    """The planner was given an impossible problem (e.g. a plan that cannot fit memory)."""


class ScheduleError(PdtoolError):
    """A schedule that breaks an invariant (order, dependencies, stash depth)."""


class LaunchError(PdtoolError):
    """Workers could not be started, or one of them failed."""


class Interrupted(PdtoolError):
    """`pd train` was stopped by a signal (Ctrl-C, SIGTERM): exit code 128 + the signal's number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum
