"""`pd plan`: PipeDream's optimizer over a cluster -> PLAN.json."""
from __future__ import annotations

import click

from ..artifacts.plan import COST_MODELS, RECOMPUTE, SHARDS
from ..errors import PlanError
from ..jsonio import check_writable
from ..runtime.recipe import OPTIMIZERS
from ..schedule.modes import (AUTO_CHUNKS, DEFAULT, DEFAULT_CHUNKED, DEFAULT_TIED, TABLE, chunked_modes, listed,
                              synchronous_modes)
from .settings import GroupedCommand
from .group import Count, CountOrAuto, _count, _examples, cli


GROUPS = {"cluster": ("cluster_spec", "memory"),
          "search": ("straight", "data_parallel", "mode", "virtual_stages", "group", "batch", "recompute", "shard", "optimizer",
                     "cost_model"),
          "outputs": ("output",)}
"""pd plan's options by group: the headings of its --help and the tables of a --config file."""


@cli.command(cls=GroupedCommand, groups=GROUPS, short_help="partition it over a cluster -> PLAN.json",
             epilog=_examples("pd plan resnet.profile.json --cluster 4x12GB/s,4x10Gbit/s -o resnet.plan.json",
                                "pd plan resnet.profile.json --cluster cluster-a:2 --memory 16GiB --straight -o straight.plan.json",
                                "pd plan gpt.profile.json --cluster 8x10GB/s --mode auto --batch 256 -o gpt.plan.json"))
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
@click.option("--mode", metavar="MODE|A,B,...|auto", default=None, callback=lambda ctx, param, value: _modes(value),
              help=f"Schedule mode the plan is to be trained with [default: {DEFAULT}, or {DEFAULT_TIED} when stages "
                   f"share a parameter (tied weights), which {DEFAULT} cannot train]. {listed(chunked_modes())} put "
                   "several stages on each worker (--virtual-stages). A list (A,B,...) plans each mode alone and keeps "
                   f"the fastest; auto: every synchronous mode ({', '.join(synchronous_modes())}). Modes: "
                   f"{', '.join(TABLE)}.")
@click.option("--virtual-stages", type=CountOrAuto(1, 64), default=None,
              help="Stages (chunks) on each worker, for the modes of several (looped: stage s on worker s mod p; "
                   f"in a V: worker r holds stages r and 2p-1-r); auto: {', '.join(map(str, AUTO_CHUNKS))} where "
                   "the mode places them and the layers fill them [default: auto with a list of modes or one of "
                   "several chunks] (docs/schedules.md).")
@click.option("--group", "-g", type=CountOrAuto(1, 65536), default=None,
              help="Microbatches per optimizer step, recorded in the plan as pd train's default [default (auto): "
                   "SAMPLES / the profile's batch with --batch; with a list of modes the largest default among them "
                   "(v x workers), so they are compared on one batch; else the mode's default, not recorded].")
@click.option("--batch", type=Count(1, 2**31), default=None, metavar="SAMPLES",
              help="Samples of one optimizer step: the group is SAMPLES / the profile's batch (the microbatch pd "
                   "train runs).")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="sgd", show_default=True,
              help="Optimizer state counted in the memory model (sgd with momentum: 1 buffer, adam: 2).")
@click.option("--recompute", type=click.Choice(RECOMPUTE), default="auto", show_default=True,
              help="Activation recomputation: a recomputing stage keeps only its input per minibatch in flight and "
                   "runs its forward again before each backward. auto: the stages that fit --memory only so; "
                   "all: every stage; none: no stage.")
@click.option("--shard", type=click.Choice(SHARDS + ("auto",)), default="none", show_default=True,
              help="What the replicas of each replicated stage shard among themselves: optimizer (each keeps the "
                   "optimizer state of 1/replicas of the stage, ZeRO stage 1: the memory model divides that state by "
                   "the replicas, the simulator adds the all-gather of the weights after each step), gradients (also "
                   "1/replicas of the summed gradients, all-reduced bucket by bucket after every backward: ZeRO stage "
                   "2), parameters (also 1/replicas of the weights, gathered layer by layer for each forward and "
                   "backward: ZeRO stage 3, FSDP2), none, or auto (each replicated stage shards where it fits --memory only so, the least it "
                   "needs).")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, allow_dash=True),
              help="Plan JSON to write ('-' for stdout). Written atomically.")
def plan(profile_path, cluster_spec, memory, straight, data_parallel, cost_model, mode, virtual_stages, group, batch,
         optimizer, recompute, shard, output):
    """Partition a profiled model over a cluster with PipeDream's optimizer (pdtool.plan/2).

    Chooses stage boundaries and replicas per stage to minimise the time per minibatch of the
    slowest stage, level by level over the cluster, and records the prediction. With --mode auto
    (or a list of modes) it plans every schedule family (a mode at its stages per worker) alone
    and keeps the fastest.
    """
    import dataclasses
    import os

    from ..artifacts.cluster import parse_cluster
    from ..planner import make_plan
    from ..planner.search import search, table
    from ..planner.costmodel import OPTIMIZER_SLOTS
    from ..artifacts.profile import Profile

    check_writable(output, (profile_path,) + ((cluster_spec,) if os.path.isfile(cluster_spec) else ()))
    cluster = parse_cluster(cluster_spec, memory)
    profile = Profile.load(profile_path)
    command = " ".join(["pd plan", os.path.basename(profile_path), "--cluster", cluster_spec]
                       + (["--memory", memory] if memory else []) + (["--straight"] if straight else [])
                       + (["--data-parallel"] if data_parallel else [])
                       + ["--cost-model", cost_model] + (["--mode", ",".join(mode)] if mode else [])
                       + (["--virtual-stages", str(virtual_stages)] if virtual_stages else [])
                       + (["--group", str(group)] if group else []) + (["--batch", str(batch)] if batch else [])
                       + ["--optimizer", optimizer] + (["--recompute", recompute] if recompute != "auto" else [])
                       + (["--shard", shard] if shard != "none" else []))
    if shard != "none" and straight:
        raise click.UsageError(f"--shard {shard} shards the state of a stage among its replicas, and --straight "
                               "plans no replicas: leave one of them out")
    if shard != "none" and virtual_stages not in (None, 1, "auto") and not (mode and len(mode) > 1):
        raise click.UsageError(f"--shard {shard} shards the state of a stage among its replicas, and --virtual-stages "
                               f"{virtual_stages} plans chunks without replicas: leave one of them out")
    options = dict(cost_model=cost_model, optimizer_slots=OPTIMIZER_SLOTS[optimizer], command=command,
                   recompute=recompute, profile_file=None if profile_path == "-" else os.path.basename(profile_path),
                   shard=shard)
    say = lambda message: click.echo(f"pd: note: {message}", err=True)  # noqa: E731
    m = _group(group, batch, profile.batch_size)
    single = mode[0] if mode and len(mode) == 1 else None
    chunked = single is not None and TABLE[single].placement is not None
    if virtual_stages == "auto" or (mode and len(mode) > 1) or (chunked and virtual_stages is None):
        if data_parallel:
            raise click.UsageError("--data-parallel plans one mode without cuts: give one --mode (not a list or auto) "
                                   "and no --virtual-stages")
        result, outcomes = search(profile, cluster, modes=mode or (DEFAULT,),
                                  virtual=None if virtual_stages == "auto" else virtual_stages, group=m,
                                  straight=straight, say=say, **options)
        for line in table(outcomes, result):
            click.echo(line, err=True)
    elif virtual_stages not in (None, 1) or chunked:
        from ..planner.chunks import make_chunked_plan

        if straight or data_parallel:
            raise click.UsageError("--virtual-stages plans a straight pipeline of chunks already: leave out "
                                   "--straight and --data-parallel")
        result = make_chunked_plan(profile, cluster, chunks=virtual_stages, mode=single or DEFAULT_CHUNKED, group=m,
                                   say=say, **options)
    else:
        result = make_plan(profile, cluster, straight=straight, data_parallel=data_parallel, mode=single, group=m,
                           say=say, **options)
    result = dataclasses.replace(result, optimizer=optimizer)  # what its memory figures counted: pd show's terms
    refusal = result.sharding_refusal()
    if refusal:
        raise PlanError(f"{profile_path}: the plan's {refusal}"
                        + (" (--shard auto chose that sharding: give --shard optimizer)" if shard == "auto" else ""))
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


def _modes(value: str | None) -> tuple[str, ...] | None:
    """--mode: one mode, a comma-separated list, or auto (`schedule.modes.synchronous_modes`)."""
    if value is None:
        return None
    if value == "auto":
        return synchronous_modes()
    names = tuple(dict.fromkeys(name.strip() for name in value.split(",")))
    unknown = [name for name in names if name not in TABLE]
    if unknown or not names:
        raise click.BadParameter(f"{unknown[0] if unknown else value!r} is not a mode; give one of {', '.join(TABLE)}, "
                                 "a comma-separated list of them, or auto")
    return names


def _group(group, batch: int | None, microbatch: int) -> int | None:
    """The group asked for: --group N, or --batch SAMPLES over the profile's batch (they must agree)."""
    if batch is None:
        return None if group in (None, "auto") else group
    if batch % microbatch:
        below = batch - batch % microbatch
        raise click.UsageError(f"--batch {batch} is not a multiple of the profile's batch {microbatch} (the microbatch "
                               f"pd train runs); use {f'{below} or ' if below else ''}{below + microbatch}")
    if group not in (None, "auto") and group * microbatch != batch:
        raise click.UsageError(f"--group {group} and --batch {batch} disagree: {batch} samples are "
                               f"{batch // microbatch} microbatches of the profile's {microbatch}; give one of them")
    return batch // microbatch
