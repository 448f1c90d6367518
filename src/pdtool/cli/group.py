"""The `pd` command group: error handling, option types and the helpers every command shares."""
from __future__ import annotations

import click

from .. import __version__
from ..errors import PdtoolError
from ..schedule.modes import GROUP, ROUND, modes_where
from ..signals import Stopped


PER_GROUP, PER_ROUND = "/".join(modes_where(steps=GROUP)), "/".join(modes_where(steps=ROUND))  # for --help


class _Pd(click.Group):
    """A click group that turns pdtool's errors into one line and an exit code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except PdtoolError as exc:
            click.echo(f"pd: error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except Stopped as stop:  # SIGINT/SIGTERM outside the workers' run (pdtool.signals)
            command = ctx.invoked_subcommand or "pd"
            click.echo(f"pd: {stop} during pd {command}; files pd writes are replaced whole, so none is half-written",
                       err=True)
            ctx.exit(stop.exit_code)


class _AsciiDigits:
    """A number option written with the digits 0-9 only (Python's int() and float() also read
    other scripts' digits, e.g. '٢' as 2)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.isascii():
            self.fail(f"{value!r} is not a number written with the digits 0-9.", param, ctx)
        return super().convert(value, param, ctx)


class Count(_AsciiDigits, click.IntRange):
    """An integer option within [min, max], in the digits 0-9."""


class CountOrAuto(Count):
    """A `Count`, or the word auto (returned as "auto")."""

    def convert(self, value, param, ctx):
        if value == "auto":
            return value
        return super().convert(value, param, ctx)

    def get_metavar(self, param, *args, **kwargs) -> str:
        return "N|auto"


class Finite(_AsciiDigits, click.FloatRange):
    """A float option within [min, max] that is a real number (click's FloatRange lets nan through)."""

    name = "finite float"

    def convert(self, value, param, ctx):
        import math

        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


# Bounds of the sizes a user can type (each says its bound in --help and in its error).
MAX_STEPS = 10**9
MAX_REPEATS = 1000
MAX_BATCH = 2**20
MAX_THREADS = 1024
MAX_SIMULATED = 10**5


def _count(n: int, noun: str) -> str:
    """'1 stage', '3 stages'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _examples(*lines: str) -> str:
    """A command's help epilog: example command lines, kept as written (click's \\b)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


@click.group(cls=_Pd, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pdtool")
def cli() -> None:
    """pdtool: PipeDream pipeline-parallel training for PyTorch.

    The three phases, each a command below: pd profile MODEL -> PROFILE.json, pd plan
    PROFILE.json -> PLAN.json, pd train PLAN.json (pd show and pd simulate look at the files).
    `pd COMMAND --help` has examples."""
