"""The `pd` command line: a thin shell over the library (the only module that imports click).

Data goes to stdout (`-o -`), talk and progress to stderr. A `PdtoolError` becomes one line
`pd: error: ...` on stderr and exit code 1; usage errors exit 2 (click's convention).
"""
from __future__ import annotations

import os
import sys
import time

import click

from . import __version__
from .artifacts.plan import COST_MODELS, RECOMPUTE
from .artifacts.profile import GRANULARITIES, MEASURED, PRECISIONS
from .errors import PdtoolError
from .fields import check_schema
from .jsonio import check_writable, read_json
from .runtime.launcher.cluster_env import LAUNCHERS, detect, place
from .runtime.recipe import LR_SCHEDULES, OPTIMIZERS
from .runtime.run import DEVICES, INITS, TRANSPORTS
from .schedule.modes import DEFAULT, DEFAULT_TIED, GROUP, MODES, ROUND, modes_where
from .signals import Stopped, install as install_signal_handlers


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
        from .artifacts.pipedream import load_pipedream_graph

        imported = load_pipedream_graph(graph_txt, batch_size)
        imported.save(output)
        if output != "-" and not quiet:
            click.echo(f"wrote {output}: {len(imported.layers)} layers imported from {graph_txt}", err=True)
        return

    from .model.spec import parse_model_args
    from .artifacts.profile import ModelRef
    from .profiler import profile_model

    if threads:
        import torch

        torch.set_num_threads(threads)

    from .units import parse_bytes

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
        noisy = [layer.name for layer in result.layers if layer.noisy]
        if noisy:
            click.echo(f"pd: warning: the repeats of {_count(len(noisy), 'layer')} kept disagreeing after being measured "
                       f"again (spread over a quarter of the median): {', '.join(noisy[:5])}"
                       + (f" and {len(noisy) - 5} more" if len(noisy) > 5 else "")
                       + "; something else used the machine: profile again when it is quiet", err=True)


@cli.command(short_help="partition it over a cluster -> PLAN.json",
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
@click.option("--mode", type=click.Choice(MODES), default=None,
              help=f"Schedule mode the plan is to be trained with [default: {DEFAULT}, or {DEFAULT_TIED} when stages "
                   f"share a parameter (tied weights), which {DEFAULT} cannot train].")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="sgd", show_default=True,
              help="Optimizer state counted in the memory model (sgd with momentum: 1 buffer, adam: 2).")
@click.option("--recompute", type=click.Choice(RECOMPUTE), default="auto", show_default=True,
              help="Activation recomputation: a recomputing stage keeps only its input per minibatch in flight and "
                   "runs its forward again before each backward. auto: the stages that fit --memory only so; "
                   "all: every stage; none: no stage.")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, allow_dash=True),
              help="Plan JSON to write ('-' for stdout). Written atomically.")
def plan(profile_path, cluster_spec, memory, straight, data_parallel, cost_model, mode, optimizer, recompute, output):
    """Partition a profiled model over a cluster with PipeDream's optimizer (pdtool.plan/1).

    Chooses stage boundaries and replicas per stage to minimise the time per minibatch of the
    slowest stage, level by level over the cluster, and records the prediction.
    """
    import os

    from .artifacts.cluster import parse_cluster
    from .planner import make_plan
    from .planner.costmodel import OPTIMIZER_SLOTS
    from .artifacts.profile import Profile

    check_writable(output, (profile_path,) + ((cluster_spec,) if os.path.isfile(cluster_spec) else ()))
    cluster = parse_cluster(cluster_spec, memory)
    profile = Profile.load(profile_path)
    command = " ".join(["pd plan", os.path.basename(profile_path), "--cluster", cluster_spec]
                       + (["--memory", memory] if memory else []) + (["--straight"] if straight else [])
                       + (["--data-parallel"] if data_parallel else [])
                       + ["--cost-model", cost_model] + (["--mode", mode] if mode else []) + ["--optimizer", optimizer]
                       + (["--recompute", recompute] if recompute != "auto" else []))
    result = make_plan(profile, cluster, cost_model=cost_model, straight=straight, data_parallel=data_parallel, mode=mode,
                       optimizer_slots=OPTIMIZER_SLOTS[optimizer], command=command, recompute=recompute,
                       profile_file=None if profile_path == "-" else os.path.basename(profile_path),
                       say=lambda message: click.echo(f"pd: note: {message}", err=True))
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


@cli.command(short_help="run a plan's schedule in simulated time",
             epilog=_examples("pd simulate resnet.plan.json --trace resnet.trace.json",
                                "pd simulate resnet.plan.json --mode flush --group 8"))
@click.argument("plan_path", metavar="PLAN.json", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--mode", type=click.Choice(MODES), default=None,
              help="Schedule mode to simulate [default: the plan's].")
@click.option("--minibatches", "-n", type=Count(1, MAX_SIMULATED), default=None,
              help=f"Minibatches (microbatches in {PER_GROUP}) to run [default: 16 per worker, "
                   "a multiple of --group].")
@click.option("--group", "-g", type=Count(1, 65536), default=None,
              help=f"{PER_GROUP}: microbatches per optimizer step [default: the number of stages, "
                   "or more for replicated stages].")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, allow_dash=True), metavar="OUT.json",
              help="Also write the simulated run as a Chrome trace (open it in Perfetto); '-' for stdout.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False), metavar="PROFILE.json",
              help="The profile the plan was made from, to check the stages' data-flow order [default: found by "
                   "its sha256 beside the plan or here; unchecked when none is found].")
@click.option("--quiet", "-q", is_flag=True, help="No talk on stderr (the summary still goes to stdout).")
def simulate(plan_path, mode, minibatches, group, trace_path, profile_path, quiet):
    """Run a plan's schedule in simulated time with the profile's costs.

    Every worker runs its actions in order; transfers take bytes / bandwidth of the link and
    queue on it; replicated stages all-reduce at every step. Prints the steady-state time per
    minibatch beside the plan's cost-model figure, the bubble fraction and, per worker, its
    busy share, weight versions, in-flight minibatches and stashed activations.
    """
    from .errors import ArtifactError
    from .artifacts.plan import SCHEMA as PLAN_SCHEMA, Plan
    from .artifacts.profile import SCHEMA as PROFILE_SCHEMA
    from .views.show import simulation_table
    from .simulate import simulate as run_simulation
    from .views.trace import chrome_trace, write_trace

    if trace_path is not None:
        check_writable(trace_path, (plan_path,))
    data = read_json(plan_path)
    if isinstance(data, dict) and data.get("schema") == PROFILE_SCHEMA:
        raise ArtifactError(f"{plan_path} is a profile ({PROFILE_SCHEMA}), not a plan; make a plan from it first: "
                            f"pd plan {plan_path} --cluster SPEC -o PLAN.json")
    check_schema(data, PLAN_SCHEMA, plan_path)
    the_plan = Plan.from_json(data, plan_path)
    _plan_profile(plan_path, the_plan, profile_path, needed=False)
    result = run_simulation(the_plan, mode=mode, minibatches=minibatches, group=group)
    summary = simulation_table(result, the_plan)
    if trace_path is None:
        click.echo(summary, nl=False)
        return
    trace = chrome_trace(result, the_plan)
    write_trace(trace_path, trace)
    if trace_path == "-":  # stdout carries the trace: the summary goes to stderr
        if not quiet:
            click.echo(summary, err=True, nl=False)
        return
    click.echo(summary, nl=False)
    if not quiet:
        click.echo(f"wrote {trace_path}: {len(result.events)} actions and {len(result.transfers)} transfers on "
               f"{len(result.busy_ms)} workers; open it in https://ui.perfetto.dev", err=True)


@cli.command(short_help="run a plan on torch.distributed workers",
             epilog=_examples("pd train mlp.plan.json --data digits --epochs 10 --lr 0.1 --momentum 0.5 --evaluate",
                                "pd train gpt.plan.json --optimizer adamw --lr 3e-4 --weight-decay 0.1 --lr-schedule cosine "
                                "--warmup-steps 100 --clip-grad-norm 1.0 --precision bf16 --metrics m.csv",
                                "pd train resnet.plan.json --steps 200 --checkpoint-dir ckpt --checkpoint-every 50 --metrics m.csv --trace t.json",
                                "pd train resnet.plan.json --steps 400 --checkpoint-dir ckpt --resume"))
@click.argument("plan_path", metavar="PLAN.json", type=click.Path(dir_okay=False))
@click.option("--steps", type=Count(1, MAX_STEPS), default=20, show_default=True,
              help=f"Train until stage 0 has taken this many optimizer steps ({PER_ROUND}: one per round of its "
                   f"replicas' minibatches; {PER_GROUP}: one per group of microbatches).")
@click.option("--epochs", type=Count(1, 10**6), help="Instead of --steps: passes over the data set.")
@click.option("--model", "-m", "model_spec", metavar="PKG.MODULE:FACTORY",
              help="Build the model with this factory instead of the one the plan names (called with the plan's "
                   "kwargs; it must build the same model). Naming it here trusts it: see the README's Security.")
@click.option("--data", default="synthetic", show_default=True, metavar="SOURCE",
              help="synthetic (the model factory's batches), digits (the UCI handwritten digits shipped with "
                   "pdtool), or PKG.MODULE:FACTORY returning a torch Dataset of (input, target) items.")
@click.option("--mode", type=click.Choice(MODES),
              help="Schedule mode [default: the plan's].")
@click.option("--group", "-g", type=Count(1, 65536),
              help=f"{PER_GROUP}: microbatches per optimizer step [default: the number of stages, or more].")
@click.option("--seed", type=Count(0, 2**63 - 1), default=0, show_default=True, help="Seed of the initial weights and the data order.")
@click.option("--optimizer", default="sgd", show_default=True, metavar="|".join(OPTIMIZERS) + "|PKG.MODULE:FACTORY",
              help="sgd (with momentum), adam, adamw (decoupled weight decay), or a factory called as "
                   "factory(param_groups, lr=LR) that returns a torch optimizer (naming it here trusts it).")
@click.option("--lr", type=Finite(0, 1e6, min_open=True), default=0.01, show_default=True,
              help=f"Peak learning rate (a replicated stage in {PER_ROUND} uses lr * r_s / r_0, see the README).")
@click.option("--momentum", type=Finite(0, 1, max_open=True), help="SGD momentum [default: 0.9].")
@click.option("--betas", type=(Finite(0, 1, max_open=True), Finite(0, 1, max_open=True)), default=None,
              metavar="B1 B2", help="adam, adamw: the moments' decay rates [default: 0.9 0.999].")
@click.option("--eps", type=Finite(0, 1, min_open=True), help="adam, adamw: added to the denominator [default: 1e-8].")
@click.option("--weight-decay", type=Finite(0, 1e6), default=0.0, show_default=True,
              help="Weight decay of every parameter but biases, norms and embeddings (see the README's recipe).")
@click.option("--lr-schedule", type=click.Choice(LR_SCHEDULES), default="constant", show_default=True,
              help="After the warm-up: keep --lr, or decay it linearly or along a cosine to --min-lr.")
@click.option("--warmup-steps", type=Count(0, MAX_STEPS), default=0, show_default=True,
              help="Steps whose learning rate rises linearly to --lr.")
@click.option("--min-lr", type=Finite(0, 1e6), default=0.0, show_default=True,
              help="Where linear and cosine decay end.")
@click.option("--lr-decay-steps", type=Count(1, MAX_STEPS),
              help="The step where the decay reaches --min-lr [default: --steps, the whole run's].")
@click.option("--precision", type=click.Choice(PRECISIONS),
              help="Compute under autocast in bf16 or fp16 with fp32 master weights and optimizer state; messages "
                   "between stages travel in it (fp16 also scales the loss) [default: the profile's].")
@click.option("--clip-grad-norm", type=Finite(0, 1e9, min_open=True), metavar="MAX",
              help="Clip the gradients to this global norm before each step (the whole model's where stages step "
                   f"together; in {PER_ROUND} each stage its share: see the README).")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), help="Write checkpoints under this folder.")
@click.option("--checkpoint-every", type=Count(0, MAX_STEPS), default=0, show_default=True,
              help="Steps between checkpoints (0: only at the end).")
@click.option("--resume", is_flag=True, help="Continue from the newest complete checkpoint in --checkpoint-dir "
              "(also under a different plan).")
@click.option("--init-from", "init_from", type=click.Path(exists=True), metavar="PATH",
              help="Start from pretrained weights: a .safetensors file or a Hugging Face model folder "
                   "(model.safetensors, or shards with their index); each worker reads only its stage's tensors.")
@click.option("--max-restarts", type=Count(0, 1000), default=0, show_default=True,
              help="When a worker fails, start the job again from the newest complete checkpoint, up to this many "
                   "times (needs --checkpoint-dir; one machine).")
@click.option("--metrics", "metrics_path", type=click.Path(dir_okay=False),
              help="CSV, one row per step, written as the run goes (tail -f works): step, loss, samples/s, lr, "
                   "gradient norm, each worker's busy share and memory (pandas reads it as is).")
@click.option("--tensorboard", "tensorboard_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="Also write loss, lr, gradient norm and samples/s as TensorBoard scalars into DIR as the run goes "
                   "(needs the tensorboard package).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False),
              help="Chrome trace of the measured run, one track per worker (compare with pd simulate --trace).")
@click.option("--timeout", "timeout_s", type=Finite(1, 86400), default=60.0, show_default=True,
              help="Seconds a worker waits on a silent peer (a message, or a sign of life during start-up) before "
                   "the job is declared failed.")
@click.option("--startup-timeout", "startup_timeout_s", type=Finite(1, 86400), default=600.0, show_default=True,
              help="Seconds start-up may take in all: every worker imports and builds the model, cuts its stage "
                   "and joins the process groups.")
@click.option("--threads", type=Count(1, MAX_THREADS),
              help="Torch threads per CPU worker [default: this machine's cores / its workers, at least 1]; "
                   "profile with the same pd profile --threads.")
@click.option("--nnodes", type=Count(1, 16384), default=1, show_default=True,
              help="Machines in the job (each runs this same command).")
@click.option("--node-rank", type=Count(0, 16383), default=0, show_default=True, help="This machine's index.")
@click.option("--nproc-per-node", type=Count(1, 16384),
              help="Workers on this machine [default: the plan's workers / --nnodes].")
@click.option("--master-addr", default="127.0.0.1", show_default=True, help="Address of the node-rank-0 machine.")
@click.option("--master-port", type=Count(1, 65535),
              help="Its rendezvous port [default: a free one; required with --nnodes > 1].")
@click.option("--rdzv-endpoint", metavar="HOST:PORT",
              help="A c10d rendezvous instead of --master-addr/--master-port/--node-rank: every machine names "
                   "the same endpoint and the rendezvous numbers the machines.")
@click.option("--rdzv-id", default="pdtool", show_default=True,
              help="The job's name at the rendezvous (the same on every machine of one job).")
@click.option("--iface", metavar="NAME",
              help="Network interface of the workers' traffic (gloo and NCCL) [default: lo on one machine; the one "
                   "that routes to the rendezvous host across machines, or GLOO_SOCKET_IFNAME if set].")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="Where workers run: cuda gives each worker the GPU of its local rank and NCCL; cpu uses gloo; "
                   "auto takes the GPUs when torch sees one for every worker of this machine, else the CPU.")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="auto",
              show_default=True,
              help="How messages between workers of this machine travel: shared-memory rings (CPU, x86) or the "
                   "process group (gloo/NCCL); auto takes shared memory when this machine has a core per worker. "
                   "Links to other machines always use the process group.")
@click.option("--launcher", type=click.Choice(LAUNCHERS), default="auto",
              show_default=True,
              help="Who starts the workers: local (pd train starts them), or torchrun/slurm (this process is one "
                   "worker that torchrun or srun started; see the README's Cluster launchers); auto: torchrun or "
                   "slurm when their variables are set (TORCHELASTIC_RUN_ID; SLURM_PROCID in an srun step of "
                   "several tasks), else local.")
@click.option("--init", "init", type=click.Choice(INITS), default="rule", show_default=True,
              help="Initial weights: rule (each worker gives only its stage's parameters their values, each from a "
                   "generator seeded by --seed and the parameter's name, with its modules' own init methods: the same "
                   "under any plan) or factory (every process builds the whole model with the factory's own values).")
@click.option("--verbose", "-v", is_flag=True, help="Show the launcher's log and a failing worker's traceback.")
@click.option("--evaluate", is_flag=True,
              help="After training, run the data set's held-out split (digits' test split, or a factory's dataset for "
                   "train=False) through the pipeline and report its mean loss and top-1 accuracy.")
@click.option("--eval-every", type=click.IntRange(min=1), default=None, metavar="N",
              help="Every N steps, drain the pipeline and run the held-out split through it (forward only, eval mode): "
                   "its loss and accuracy go to the progress output, --metrics and --tensorboard.")
@click.option("--quiet", "-q", is_flag=True, help="No progress line on stderr.")
def train(plan_path, steps, epochs, model_spec, data, mode, group, seed, optimizer, lr, momentum, betas, eps, weight_decay,
          lr_schedule, warmup_steps, min_lr, lr_decay_steps, precision, clip_grad_norm, checkpoint_dir,
          checkpoint_every, resume, init_from, max_restarts, metrics_path, tensorboard_dir, trace_path, timeout_s, startup_timeout_s, threads, nnodes, node_rank, nproc_per_node,
          master_addr, master_port, rdzv_endpoint, rdzv_id, iface, device, transport, launcher, init, verbose, evaluate,
          eval_every, quiet):
    """Train a plan on torch.distributed workers (gloo on CPU, NCCL on GPUs), one process per rank.

    Every worker builds its stage from the model the plan names, checks the plan against the
    world size and the model's fingerprint, then runs its schedule in the plan's mode or --mode
    (1F1B with weight stashing by default). A failing worker stops the whole job.
    Under torchrun or srun (--launcher), this process is one of the workers.
    """
    from .artifacts.plan import Plan
    from .runtime.launcher.launch import Nodes
    from .runtime.recipe import LrSchedule, OptimizerConfig
    from .runtime.run import RunConfig

    where = place(detect(launcher))  # None: pd train starts the workers itself
    if where is not None:
        _refuse_local_options(where.launcher, transport)
    reporter = where is None or where.rank == 0  # the process that writes the outputs and prints the summary
    if init_from and resume:
        raise click.UsageError("--init-from starts a run from pretrained weights and --resume continues one from its "
                               "checkpoint; give one of them")
    if max_restarts and not checkpoint_dir:
        raise click.UsageError("--max-restarts needs --checkpoint-dir: a restart continues from the newest checkpoint")
    if max_restarts and (nnodes > 1 or rdzv_endpoint):
        raise click.UsageError("--max-restarts restarts the workers of one machine; across machines, restart the "
                               "job with --resume")
    recipe = OptimizerConfig(optimizer, lr, momentum, weight_decay, betas, eps,
                             LrSchedule(lr_schedule, warmup_steps, min_lr, lr_decay_steps), clip_grad_norm)
    if recipe.problem():
        raise click.UsageError(recipe.problem())
    plan = Plan.load(plan_path)
    if nnodes > 1 and master_port is None and not rdzv_endpoint:
        raise click.UsageError("--nnodes > 1 needs --master-port (the same on every machine) or --rdzv-endpoint")
    if rdzv_endpoint and (node_rank or master_port is not None):
        raise click.UsageError("--rdzv-endpoint numbers the machines itself: drop --node-rank and --master-port")
    for path in (metrics_path, trace_path):
        if path and reporter:
            check_writable(path, (plan_path,) + tuple(p for p in (metrics_path, trace_path) if p and p != path))
    config = RunConfig(plan_path=os.path.abspath(plan_path), steps=steps, mode=mode, group=group, seed=seed,
                       optimizer=recipe, precision=precision, timeout_s=timeout_s,
                       startup_timeout_s=startup_timeout_s,
                       threads=threads, data=data, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                       progress=not quiet, evaluate=evaluate, eval_every=eval_every, device=device, transport=transport,
                       model=model_spec, init=init, init_from=os.path.abspath(init_from) if init_from else None,
                       metrics=os.path.abspath(metrics_path) if metrics_path and where is None else None,
                       tensorboard=os.path.abspath(tensorboard_dir) if tensorboard_dir else None)
    if tensorboard_dir:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:  # torch.utils.tensorboard writes with it
            raise click.UsageError("--tensorboard needs the tensorboard package: pip install tensorboard")
    from .model.spec import local_origin
    from .runtime.launcher.train import train as run_training

    origin = local_origin(plan.profile.model["spec"]) if plan.profile.model and not model_spec else None
    if origin and reporter:  # the plan names code of the experiment folder: say which file runs before it does
        click.echo(f"pd: importing the plan's model factory {plan.profile.model['spec']} from {origin} "
                   "(experiment folder)", err=True)
    talk = (lambda message: None) if quiet else (lambda message: click.echo(f"pd: {message}", err=True))  # noqa: E731
    warn = lambda message: click.echo(f"pd: warning: {message}", err=True)  # noqa: E731
    say = lambda message: click.echo(f"pd: {message}", err=True)  # noqa: E731
    nodes = Nodes(nnodes, node_rank, nproc_per_node, master_addr, master_port, rdzv_endpoint, rdzv_id, iface)
    ran = run_training(plan, config, where=where, nodes=nodes, epochs=epochs, resume=resume, restarts=max_restarts,
                       verbose=verbose, warn=warn, say=say, talk=talk)  # every check before any worker starts
    if ran is None:
        return  # a worker of torchrun or srun that is not rank 0: rank 0 reports
    result, job = ran
    config = job.config
    from .views.summary import train_summary

    shared = (config.threads, job.local, job.cores, job.on_cpu)  # what gap_reasons needs to explain a measurement
    if metrics_path:
        from .views.metrics import write_metrics

        write_metrics(metrics_path, result)
    if trace_path:
        from .views.trace import write_measured_trace

        write_measured_trace(trace_path, result)
    for line in train_summary(result, plan, config, shared):
        click.echo(line)
    if evaluate:
        evals = result.evals
        if evals:
            held_loss, accuracy, samples = evals[max(evals)][:3]
            click.echo((f"held-out accuracy: {accuracy:.1%} of {samples} samples, " if accuracy is not None else
                        f"held-out: {samples} samples, ") + f"loss {held_loss:.4f}")
        else:
            click.echo("held-out: not measured here (the last stage runs on another machine)")
    for label, path in (("checkpoints", checkpoint_dir), ("metrics", metrics_path), ("trace", trace_path)):
        if path:
            click.echo(f"{label}: {path}", err=True)


_LOCAL_LAUNCHER = ("nnodes", "node_rank", "nproc_per_node", "master_addr", "master_port", "rdzv_endpoint", "rdzv_id",
                   "max_restarts", "tensorboard_dir")
"""pd train's options that only its own launcher uses (a cluster's launcher places the workers itself)."""


def _refuse_local_options(launcher: str, transport: str) -> None:
    """Usage errors for what a worker started by torchrun or srun cannot do."""
    ctx = click.get_current_context()
    given = [name for name in _LOCAL_LAUNCHER
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    if given:
        raise click.UsageError(f"--{given[0].replace('_', '-')} is for pd train's own launcher; under {launcher}, "
                               f"drop it and give {launcher} its own option for it")
    if transport == "shared-memory":
        raise click.UsageError(f"--transport shared-memory needs pd train's own launcher (it removes the rings of "
                               f"workers that die); under {launcher} the workers talk through the process group")


@cli.command(name="export", short_help="write a checkpoint as safetensors -> DIR",
             epilog=_examples("pd export ckpt/step-00000200 -o gpt2-trained"))
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False),
              help="The folder to write (model-0000k-of-0000n.safetensors per stage, model.safetensors.index.json).")
@click.option("--config-from", type=click.Path(file_okay=False), metavar="DIR",
              help="A Hugging Face model folder (the one --init-from read) whose config.json and generation_config.json "
                   "to copy, so that from_pretrained reads the result as it is.")
def export_checkpoint(checkpoint, output, config_from):
    """Write a checkpoint's weights as a Hugging Face-style safetensors folder, one stage at a time.

    CHECKPOINT is a checkpoint folder or a --checkpoint-dir (its newest complete checkpoint).
    Tensors keep the model's own names, so transformers' from_pretrained (with the model's
    config: --config-from) or pd train --init-from reads the folder."""
    from .model.weights import export

    files, size = export(checkpoint, output, config_from)
    click.echo(f"wrote {output}: {_count(files, 'file')} of safetensors, {size / 2 ** 20:.1f} MiB, and its index")


@cli.command(short_help="draw a metrics CSV's curves -> PICTURE",
             epilog=_examples("pd plot m.csv -o loss.png", "pd plot m.csv -o curves.svg --column loss --column samples_per_s"))
@click.argument("metrics_path", metavar="METRICS.csv", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The picture: .png, .svg or .pdf.")
@click.option("--column", "columns", multiple=True, metavar="NAME",
              help="A column to draw, one panel each [default: loss, lr and grad_norm where recorded].")
def plot(metrics_path, output, columns):
    """Draw the curves of pd train --metrics against the step (also of a run still writing it)."""
    from .views.plot import plot_metrics

    check_writable(output, (metrics_path,))
    drawn = plot_metrics(metrics_path, output, tuple(columns) or None)
    click.echo(f"wrote {output}: {', '.join(drawn)} by step", err=True)


@cli.command(short_help="print a summary of a profile or plan; draw a plan",
             epilog=_examples("pd show resnet.profile.json --top 10",
                                "pd show resnet.plan.json --render resnet.svg"))
@click.argument("artifact", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--top", type=Count(1, 100000), default=15, show_default=True,
              help="Profiles: how many of the heaviest layers to list.")
@click.option("--render", "picture", type=click.Path(dir_okay=False), metavar="PICTURE",
              help="Plans: also draw the layer graph with one coloured box per stage to PICTURE "
                   "(.svg, .png, .pdf or .dot; the .dot source when graphviz's dot is missing).")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False), metavar="PROFILE.json",
              help="Plans: the profile the plan was made from, for --render [default: X.profile.json beside X.plan.json].")
def show(artifact, top, picture, profile_path):
    """Print a readable summary of a profile or plan JSON file (and draw a plan)."""
    from .artifacts.plan import SCHEMA as PLAN_SCHEMA, Plan
    from .artifacts.profile import SCHEMA as PROFILE_SCHEMA, Profile
    from .views.show import plan_table, profile_table

    data = read_json(artifact)
    if isinstance(data, dict) and data.get("schema") == PLAN_SCHEMA:
        plan = Plan.from_json(data, artifact)
        if picture:
            from .views.render import render_plan

            source, profile = _plan_profile(artifact, plan, profile_path, needed=True)
            check_writable(picture, (artifact, source))
            written, warning = render_plan(plan, profile, picture)
            if warning:
                click.echo(f"pd: warning: {warning}", err=True)
            click.echo(f"wrote {written}", err=True)
        click.echo(plan_table(plan), nl=False)
        return
    if picture or profile_path:
        raise click.UsageError("--render and --profile apply to plan files only")
    check_schema(data, PROFILE_SCHEMA, artifact)
    click.echo(profile_table(Profile.from_json(data, artifact), top), nl=False)


def _plan_profile(plan_path: str, plan, profile_path: str | None, needed: bool):
    """The plan's profile (given, or found by its sha256), checked against the plan; None when
    not `needed` and not found. Raises a usage error naming what to pass when needed and missing."""
    from .artifacts.plan import check_against_profile, find_profile
    from .artifacts.profile import Profile

    source = profile_path or find_profile(plan_path, plan)
    if source is None:
        if needed:
            raise click.UsageError(f"--render needs the layer graph of {plan_path}: no profile with its sha256 "
                                   f"({plan.profile.sha256[:12]}...) beside it or here; give --profile PROFILE.json "
                                   f"(the plan was made by: {plan.command or 'an unknown command'})")
        return None, None
    profile = Profile.load(source)
    check_against_profile(plan, profile, plan_path, source)
    return source, profile


def main() -> None:
    """Console-script entry point of `pd`."""
    # torch's C++ warnings (e.g. a peer whose host name has no reverse DNS entry) are not one line
    # of what to do; pd says what matters itself. TORCH_CPP_LOG_LEVEL=WARNING shows them again.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    install_signal_handlers()
    cli(prog_name="pd")
