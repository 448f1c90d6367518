"""`pd profile`: measure a model layer by layer -> PROFILE.json."""
from __future__ import annotations

import sys
import time

import click

from ..artifacts.profile import GRANULARITIES, MEASURED, PRECISIONS
from ..jsonio import check_writable
from .group import MAX_BATCH, MAX_REPEATS, MAX_THREADS, Count, _count, _examples, cli


class _ProfileProgress:
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


@cli.command(short_help="measure a model layer by layer -> PROFILE.json",
             epilog=_examples("pd profile -m pdtool.zoo:resnet50 -a width=16 -a image_size=64 -b 16 -o resnet.profile.json",
                                "pd profile --from-pipedream graph.txt -o vgg16.profile.json"))
@click.option("--model", "-m", "spec", metavar="PKG.MODULE:FACTORY",
              help="Model factory to profile, e.g. pdtool.zoo:resnet50 (the current folder is importable).")
@click.option("--from-pipedream", "graph_txt", type=click.Path(dir_okay=False), metavar="GRAPH.TXT",
              help="Instead of measuring, convert a profile of the original PipeDream (its graph.txt).")
@click.option("--model-arg", "-a", "model_args", multiple=True, metavar="KEY=VALUE",
              help="Keyword argument for the factory (value parsed as JSON, else a string); repeatable.")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, allow_dash=True),
              help="Profile JSON to write ('-' for stdout). Written atomically.")
@click.option("--batch-size", "-b", type=Count(1, MAX_BATCH), default=None,
              help="Minibatch size to profile at [default: the factory's, else 32].")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--repeats", type=Count(1, MAX_REPEATS), default=10, show_default=True,
              help="Timed repetitions per layer; the median is recorded, the interquartile range as spread.")
@click.option("--warmup", type=Count(0, MAX_REPEATS), default=2, show_default=True,
              help="Untimed repetitions before timing.")
@click.option("--granularity", type=click.Choice(GRANULARITIES), default="module", show_default=True,
              help="module: fold trivial ops (ReLU, add, view, ...) into neighbouring layers; op: every traced op is a layer.")
@click.option("--depth", type=Count(1, 64), default=None,
              help="Make every submodule nested DEPTH levels deep one layer (e.g. 2: each ResNet block).")
@click.option("--method", type=click.Choice(("auto",) + MEASURED),
              default="auto", show_default=True,
              help="How to find layers: torch.fx, torch.export, leaf modules in execution order, or auto "
                   "(fx, else export, else leaf modules).")
@click.option("--threads", type=Count(1, MAX_THREADS),
              help="Torch threads while measuring [default: torch's]; use the count each pd train worker will have.")
@click.option("--memory", metavar="SIZE",
              help="The profiler's memory budget, e.g. 8GiB [default: what the device has free]: a model whose whole "
                   "profiling needs more (about 4x its parameters) is profiled one layer's weights at a time.")
@click.option("--layerwise", is_flag=True, help="Profile one layer's weights at a time whatever the model's size.")
@click.option("--reuse-identical", is_flag=True,
              help="Layer by layer, time a layer identical to an earlier one (kind, parameter and input shapes: "
                   "transformer blocks) only once; the profile says which layers carry another's figures.")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True,
              help="Time the layers under autocast in bf16 or fp16 (weights fp32) and count their outputs in it, as "
                   "pd train --precision runs them; the plan and pd train take it from the profile.")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
def profile(spec, graph_txt, model_args, output, batch_size, device, repeats, warmup, granularity, depth, method,
            threads, memory, layerwise, reuse_identical, precision, quiet):
    """Measure a model layer by layer and write its profile (pdtool.profile/1).

    Per layer: forward and backward time (ms, median of --repeats), output activation bytes,
    parameter bytes, and the edges between layers. The whole training step is timed too, and
    the ratio of the summed layer times to it is recorded.

    With --from-pipedream GRAPH.TXT, convert a profile of the original PipeDream instead
    (--batch-size is needed when it cannot be inferred from a 224x224 image input).
    """
    if (spec is None) == (graph_txt is None):
        raise click.UsageError("give exactly one of --model and --from-pipedream")
    check_writable(output, (graph_txt,) if graph_txt else ())
    if graph_txt is not None:
        from ..artifacts.pipedream import load_pipedream_graph

        imported = load_pipedream_graph(graph_txt, batch_size)
        imported.save(output)
        if output != "-" and not quiet:
            click.echo(f"wrote {output}: {len(imported.layers)} layers imported from {graph_txt}", err=True)
        return

    from ..model.spec import parse_model_args
    from ..artifacts.profile import ModelRef
    from ..profiler import profile_model

    if threads:
        import torch

        torch.set_num_threads(threads)

    from ..units import parse_bytes

    budget = parse_bytes(memory) if memory is not None else None  # a bad size: one line
    progress = _ProfileProgress(quiet)
    ref = ModelRef(spec, parse_model_args(model_args))
    try:
        result = profile_model(ref, batch_size=batch_size, device=device, repeats=repeats, warmup=warmup,
                               granularity=granularity, depth=depth, method=method, progress=progress,
                               warn=lambda message: (progress.done(), click.echo(f"pd: warning: {message}", err=True)),
                               memory=budget, layerwise=layerwise, reuse_identical=reuse_identical,
                               precision=precision)
    finally:
        progress.done()
    result.save(output)
    if output != "-" and not quiet:
        ratio = result.layer_sum_over_step
        how = (f"layer sum / step {ratio:.3f}" if ratio is not None else
               f"profiled one layer at a time, {sum(1 for layer in result.layers if layer.same_as is not None)} "
               "layer(s) carrying an identical earlier one's figures")
        click.echo(f"wrote {output}: {len(result.layers)} layers ({result.method}), step {result.step_ms:.3f} ms, "
                   f"{how}", err=True)
        gap = result.sum_gap()
        if gap:
            click.echo(f"pd: warning: {gap}", err=True)
        noisy = [layer.name for layer in result.layers if layer.noisy and layer.same_as is None]  # measured ones
        if noisy:
            click.echo(f"pd: warning: the repeats of {_count(len(noisy), 'layer')} kept disagreeing after being measured "
                       f"again (spread over a quarter of the median): {', '.join(noisy[:5])}"
                       + (f" and {len(noisy) - 5} more" if len(noisy) > 5 else "")
                       + "; something else used the machine: profile again when it is quiet", err=True)
