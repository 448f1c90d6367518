"""`pd plot`: a metrics CSV's curves as a picture."""
from __future__ import annotations

import click

from ..jsonio import check_writable
from .group import _examples, cli


@cli.command(short_help="draw a metrics CSV's curves -> PICTURE",
             epilog=_examples("pd plot m.csv -o loss.png", "pd plot m.csv -o curves.svg --column loss --column samples_per_s"))
@click.argument("metrics_path", metavar="METRICS.csv", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The picture: .png, .svg or .pdf.")
@click.option("--column", "columns", multiple=True, metavar="NAME",
              help="A column to draw, one panel each [default: loss, lr and grad_norm where recorded].")
def plot(metrics_path, output, columns):
    """Draw the curves of pd train --metrics against the step (also of a run still writing it)."""
    from ..views.plot import plot_metrics

    check_writable(output, (metrics_path,))
    drawn = plot_metrics(metrics_path, output, tuple(columns) or None)
    click.echo(f"wrote {output}: {', '.join(drawn)} by step", err=True)
