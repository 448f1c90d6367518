"""`pd plan`: PipeDream's optimizer over a cluster -> PLAN.json."""
from __future__ import annotations

import click

from ..artifacts.plan import COST_MODELS, RECOMPUTE
from ..jsonio import check_writable
from ..runtime.recipe import OPTIMIZERS
from ..schedule.modes import DEFAULT, DEFAULT_CHUNKED, DEFAULT_TIED, TABLE, chunked_modes, listed
from .settings import GroupedCommand
from .group import _count, _examples, cli


GROUPS = {"cluster": ("cluster_spec", "memory"),
          "search": ("straight", "data_parallel", "mode", "virtual_stages", "recompute", "optimizer", "cost_model"),
          "outputs": ("output",)}
"""pd plan's options by group: the headings of its --help and the tables of a --config file."""


@cli.command(cls=GroupedCommand, groups=GROUPS, short_help="partition it over a cluster -> PLAN.json",
             epilog=_examples("pd plan resnet.profile.json --cluster 4x12GB/s,4x10Gbit/s -o resnet.plan.json",
                                "pd plan resnet.profile.json --cluster cluster-a:2 --memory 16GiB --straight -o straight.plan.json"))
@click.argument("profile_path", metavar="PROFILE.json", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--cluster", "-c", "cluster_spec", required=True, metavar="SPEC",
              help="Levels innermost first, COUNTxBANDWIDTH[+LATENCY],... (e.g. 4x12GB/s,4x10Gbit/s or "
                   "2x10Gbit/s+100us), a JSON file, or a preset (cluster-a[:SERVERS], cluster-b[:SERVERS]).")
@click.option("--memory", metavar="SIZE", help="Memory per worker, e.g. 16GiB; stages that do not fit are ruled out.")
@click.option("--straight", is_flag=True, help="No replicated stages: every stage runs on one unit of each level.")
@click.option("--data-parallel", is_flag=True, help="No cuts: one stage replicated on every worker (to compare a "
              "pipeline with data parallelism, e.g. in pd train).")
@click.option("--cost-model", type=click.Choice(COST_MODELS), default="pdtool", show_default=True,
              help="pdtool: max(compute, all-reduce, transfer) per stage; pipedream: the original optimizer's formulas.")
@click.option("--mode", type=click.Choice(tuple(TABLE)), default=None,
              help=f"Schedule mode the plan is to be trained with [default: {DEFAULT}, or {DEFAULT_TIED} when stages "
                   f"share a parameter (tied weights), which {DEFAULT} cannot train]. {listed(chunked_modes())} "
                   f"put several stages on each worker: give --virtual-stages ({DEFAULT_CHUNKED} by default there).")
@click.option("--virtual-stages", type=click.IntRange(2, 64), default=None, metavar="V",
              help="Stages (chunks) on each worker, with a mode of several (V >= 2 looped: stage s on worker s mod p; "
                   "V = 2 in a V: worker r holds stages r and 2p-1-r); one level of workers (docs/schedules.md).")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="sgd", show_default=True,
              help="Optimizer state counted in the memory model (sgd with momentum: 1 buffer, adam: 2).")
@click.option("--recompute", type=click.Choice(RECOMPUTE), default="auto", show_default=True,
              help="Activation recomputation: a recomputing stage keeps only its input per minibatch in flight and "
                   "runs its forward again before each backward. auto: the stages that fit --memory only so; "
                   "all: every stage; none: no stage.")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, allow_dash=True),
              help="Plan JSON to write ('-' for stdout). Written atomically.")
def plan(profile_path, cluster_spec, memory, straight, data_parallel, cost_model, mode, virtual_stages, optimizer,
         recompute, output):
    """Partition a profiled model over a cluster with PipeDream's optimizer (pdtool.plan/2).

    Chooses stage boundaries and replicas per stage to minimise the time per minibatch of the
    slowest stage, level by level over the cluster, and records the prediction.
    """
    import os

    from ..artifacts.cluster import parse_cluster
    from ..planner import make_plan
    from ..planner.costmodel import OPTIMIZER_SLOTS
    from ..artifacts.profile import Profile

    check_writable(output, (profile_path,) + ((cluster_spec,) if os.path.isfile(cluster_spec) else ()))
    cluster = parse_cluster(cluster_spec, memory)
    profile = Profile.load(profile_path)
    command = " ".join(["pd plan", os.path.basename(profile_path), "--cluster", cluster_spec]
                       + (["--memory", memory] if memory else []) + (["--straight"] if straight else [])
                       + (["--data-parallel"] if data_parallel else [])
                       + ["--cost-model", cost_model] + (["--mode", mode] if mode else [])
                       + (["--virtual-stages", str(virtual_stages)] if virtual_stages else []) + ["--optimizer", optimizer]
                       + (["--recompute", recompute] if recompute != "auto" else []))
    options = dict(cost_model=cost_model, optimizer_slots=OPTIMIZER_SLOTS[optimizer], command=command,
                   recompute=recompute, profile_file=None if profile_path == "-" else os.path.basename(profile_path),
                   say=lambda message: click.echo(f"pd: note: {message}", err=True))
    if virtual_stages or (mode and TABLE[mode].placement):
        from ..planner.chunks import make_chunked_plan

        if not virtual_stages:
            raise click.UsageError(f"--mode {mode} puts several stages on each worker: give --virtual-stages V")
        if straight or data_parallel:
            raise click.UsageError("--virtual-stages plans a straight pipeline of chunks already: leave out "
                                   "--straight and --data-parallel")
        result = make_chunked_plan(profile, cluster, chunks=virtual_stages, mode=mode or DEFAULT_CHUNKED, **options)
    else:
        result = make_plan(profile, cluster, straight=straight, data_parallel=data_parallel, mode=mode, **options)
    result.save(output)
    if output != "-":
        pred = result.predicted
        model_single, model_dp = pred.cost_model_speedups
        idle = result.workers - len(result.used_ranks)
        click.echo(f"wrote {output}: {_count(len(result.stages), 'stage')} ({result.mode}"
                   f"{f', {idle} of {result.workers} workers idle' if idle else ''}), {pred.expected_ms:.3f} ms per "
                   f"minibatch{' (simulated)' if pred.simulated_ms is not None else ''}, "
                   f"{pred.speedup_over_single:.2f}x over one worker, "
                   + (f"{pred.speedup_over_data_parallel:.2f}x over data parallel" if pred.data_parallel_over_bytes is None
                      else "data parallel does not fit in memory")
                   + (f"; cost model {pred.time_ms:.3f} ms, {model_single:.2f}x, {model_dp:.2f}x"
                      if pred.simulated_ms is not None else ""), err=True)
