"""The `pd` command line: a thin shell over the library (the only module that imports click).

Data goes to stdout (`-o -`), talk and progress to stderr. A `PdtoolError` becomes one line
`pd: error: ...` on stderr and exit code 1; usage errors exit 2 (click's convention).
"""
from __future__ import annotations

import sys
import time

import click

from . import __version__
from .errors import PdtoolError
from .fields import check_schema
from .jsonio import check_writable, read_json


class _Pd(click.Group):
    """A click group that turns pdtool's errors into one line and an exit code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except PdtoolError as exc:
            click.echo(f"pd: error: {exc}", err=True)
            ctx.exit(exc.exit_code)


class _Progress:
    """Progress lines on stderr: rewritten in place on a terminal, at most one a second otherwise."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, message: str) -> None:
        if self.quiet:
            return
        if self.tty:
            click.echo(f"\r\033[K{message}", err=True, nl=False)
        elif time.monotonic() - self.last >= 1.0:
            click.echo(message, err=True)
            self.last = time.monotonic()

    def done(self) -> None:
        if self.tty and not self.quiet:
            click.echo("\r\033[K", err=True, nl=False)


@click.group(cls=_Pd, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pdtool")
def cli() -> None:
    """pdtool: PipeDream pipeline-parallel training for PyTorch.

    \b
    pd profile  measure a model layer by layer -> PROFILE.json
    pd show     print a readable summary of a profile
    """


@cli.command()
@click.option("--model", "-m", "spec", required=True, metavar="PKG.MODULE:FACTORY",
              help="Model factory to profile, e.g. pdtool.zoo:resnet50 (the current folder is importable).")
@click.option("--model-arg", "-a", "model_args", multiple=True, metavar="KEY=VALUE",
              help="Keyword argument for the factory (value parsed as JSON, else a string); repeatable.")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, allow_dash=True),
              help="Profile JSON to write ('-' for stdout). Written atomically.")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=None,
              help="Minibatch size to profile at [default: the factory's, else 32].")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--repeats", type=click.IntRange(min=1), default=10, show_default=True,
              help="Timed repetitions per layer; the median is recorded, the interquartile range as spread.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True,
              help="Untimed repetitions before timing.")
@click.option("--granularity", type=click.Choice(["module", "op"]), default="module", show_default=True,
              help="module: fold trivial ops (ReLU, add, view, ...) into neighbouring layers; op: every traced op is a layer.")
@click.option("--depth", type=click.IntRange(min=1), default=None,
              help="Make every submodule nested DEPTH levels deep one layer (e.g. 2: each ResNet block).")
@click.option("--method", type=click.Choice(["auto", "fx", "modules"]), default="auto", show_default=True,
              help="How to find layers: torch.fx, leaf modules in execution order, or fx with a fallback.")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
def profile(spec, model_args, output, batch_size, device, repeats, warmup, granularity, depth, method, quiet):
    """Measure a model layer by layer and write its profile (pdtool.profile/1).

    Per layer: forward and backward time (ms, median of --repeats), output activation bytes,
    parameter bytes, and the edges between layers. The whole training step is timed too, and
    the ratio of the summed layer times to it is recorded.
    """
    from .modelspec import parse_model_args
    from .profile import ModelRef
    from .profiler import profile_model

    check_writable(output)
    progress = _Progress(quiet)
    ref = ModelRef(spec, parse_model_args(model_args))
    try:
        result = profile_model(ref, batch_size=batch_size, device=device, repeats=repeats, warmup=warmup,
                               granularity=granularity, depth=depth, method=method, progress=progress)
    finally:
        progress.done()
    result.save(output)
    if output != "-" and not quiet:
        ratio = result.layer_sum_over_step
        click.echo(f"wrote {output}: {len(result.layers)} layers, step {result.step_ms:.3f} ms, "
                   f"layer sum / step {ratio:.3f}", err=True)


@cli.command()
@click.argument("artifact", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--top", type=click.IntRange(min=1), default=15, show_default=True,
              help="How many of the heaviest layers to list.")
def show(artifact, top):
    """Print a readable summary of a profile JSON file."""
    from .profile import SCHEMA as PROFILE_SCHEMA, Profile
    from .show import profile_table

    data = read_json(artifact)
    check_schema(data, PROFILE_SCHEMA, artifact)
    click.echo(profile_table(Profile.from_json(data, artifact), top), nl=False)


def main() -> None:
    """Console-script entry point of `pd`."""
    cli(prog_name="pd")
