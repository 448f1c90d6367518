"""`pd simulate`: a plan's schedule in simulated time."""
from __future__ import annotations

import click

from ..fields import check_schema
from ..jsonio import check_writable, read_json
from ..schedule.modes import MODES
from .group import MAX_SIMULATED, PER_GROUP, Count, _examples, cli
from .show import _plan_profile

EVENT_WORKERS = 256
"""Above this many workers `pd simulate` gives the steady state of one period by default: the event
simulation of a 448-worker plan of 300 layers took 38 s here, its steady state well under a second."""


@cli.command(short_help="run a plan's schedule in simulated time",
             epilog=_examples("pd simulate resnet.plan.json --trace resnet.trace.json",
                                "pd simulate resnet.plan.json --mode flush --group 8",
                                "pd simulate gpt.plan.json --write-schedule gpt.schedule.csv --group 8",
                                "pd simulate gpt.plan.json --schedule torch_zbv.csv"))
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
@click.option("--events", is_flag=True,
              help=f"Run the event simulation (every action of every worker) on a plan of more than {EVENT_WORKERS} "
                   "workers too, where the steady state of one period is the default (seconds instead of minutes); "
                   "--trace and --minibatches imply it.")
@click.option("--schedule", "schedule_path", type=click.Path(dir_okay=False), metavar="FILE.csv",
              help="Simulate this torch.distributed.pipelining schedule (its CSV: one row of actions such as 0F1, 1I0, "
                   "1W0, 0B2 per rank, as a schedule's _dump_csv writes it) as one optimizer step of the plan, after "
                   "checking it (every microbatch's actions once, no deadlock, the mode's in-flight bound); the mode "
                   "is --mode, the plan's where it places several stages on a worker, else the first of flush, gpipe "
                   "(zb, zb2 where it splits backwards) that it obeys. docs/schedules.md says how actions map.")
@click.option("--write-schedule", "write_path", type=click.Path(dir_okay=False), metavar="FILE.csv",
              help="Write one optimizer step of the plan's schedule (--mode, --group) in torch's CSV instead of "
                   "simulating (modes that step per group, stages without replicas).")
@click.option("--quiet", "-q", is_flag=True, help="No talk on stderr (the summary still goes to stdout).")
def simulate(plan_path, mode, minibatches, group, trace_path, profile_path, events, schedule_path, write_path, quiet):
    """Run a plan's schedule in simulated time with the profile's costs.

    Every worker runs its actions in order; transfers take bytes / bandwidth of the link and
    queue on it; replicated stages all-reduce at every step. Prints the steady-state time per
    minibatch beside the plan's cost-model figure, the bubble fraction and, per worker, its
    busy share, weight versions, in-flight minibatches and stashed activations. On a plan of more
    than 256 workers it prints the steady state of one period alone (no per-worker figures),
    unless --events asks for the event simulation.
    """
    from ..errors import ArtifactError
    from ..artifacts.plan import OLDER as OLDER_PLANS, SCHEMA as PLAN_SCHEMA, Plan
    from ..artifacts.profile import SCHEMA as PROFILE_SCHEMA
    from ..views.show import simulation_table
    from ..sim.simulate import simulate as run_simulation
    from ..views.trace import chrome_trace, write_trace

    if trace_path is not None:
        check_writable(trace_path, (plan_path,))
    if write_path is not None:
        check_writable(write_path, (plan_path,))
    data = read_json(plan_path)
    if isinstance(data, dict) and data.get("schema") == PROFILE_SCHEMA:
        raise ArtifactError(f"{plan_path} is a profile ({PROFILE_SCHEMA}), not a plan; make a plan from it first: "
                            f"pd plan {plan_path} --cluster SPEC -o PLAN.json")
    check_schema(data, PLAN_SCHEMA, plan_path, OLDER_PLANS)
    the_plan = Plan.from_json(data, plan_path)
    _plan_profile(plan_path, the_plan, profile_path, needed=False)
    if write_path is not None or schedule_path is not None:
        _torch_schedule(the_plan, mode, group, schedule_path, write_path, minibatches or trace_path)
        return
    if not (events or trace_path or minibatches) and len(the_plan.used_ranks) > EVENT_WORKERS:
        from ..sim.steady import steady_state
        from ..views.show import steady_table

        state = steady_state(the_plan, mode, group)
        if state is not None:
            click.echo(steady_table(state, the_plan, mode, group), nl=False)
            return
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


def _torch_schedule(plan, mode, group, read: str | None, write: str | None, extra) -> None:
    """`--schedule` (read torch's CSV, check it, simulate it beside the plan's own schedule of its
    mode) or `--write-schedule` (the plan's schedule of one step in torch's CSV)."""
    from ..errors import ScheduleError
    from ..jsonio import write_text_atomic
    from ..schedule import generate
    from ..schedule.check import validate
    from ..schedule.modes import rules
    from ..schedule.torch_csv import read_csv, schedule_of, to_csv
    from ..sim.simulate import simulate as run_simulation, simulate_schedule
    from ..views.show import simulation_table

    if read and write:
        raise click.UsageError("--schedule reads a schedule and --write-schedule writes the plan's: give one")
    if extra:
        raise click.UsageError("--schedule and --write-schedule are one step of the plan: leave out --minibatches and "
                               "--trace")
    replicated = [i for i, s in enumerate(plan.stages) if s.replicas > 1]
    if replicated:
        raise ScheduleError(f"stage {replicated[0]} of the plan has {plan.stages[replicated[0]].replicas} replicas, which "
                            "torch.distributed.pipelining's schedules do not hold (one rank a stage): plan with "
                            "--straight or --virtual-stages")
    replicas = tuple(1 for _ in plan.stages)
    if write:
        run = plan.run(mode, group)
        if run.mode.per_round:
            raise ScheduleError(f"mode {run.name} steps each stage after its own minibatches, which torch's schedules "
                                "(one optimizer step a file) cannot hold; give --mode flush, gpipe, zb or zb2")
        schedule = generate(run.name, replicas, run.group, run.group, placement=plan.placement)
        write_text_atomic(write, to_csv(schedule))
        click.echo(f"wrote {write}: one step of mode {run.name}, {run.group} microbatches, {len(schedule.workers)} "
                   "ranks (torch.distributed.pipelining's compute-only CSV)", err=True)
        return
    try:
        with open(read, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as error:
        raise ScheduleError(f"cannot read --schedule {read} ({getattr(error, 'strerror', None) or error}); give "
                            "the CSV a torch schedule's _dump_csv or pd simulate --write-schedule wrote") from None
    rows = read_csv(text, read)
    splits = any(kind in ("I", "W") for row in rows for kind, _, _ in row)
    candidates = ([mode] if mode else [plan.mode] if plan.placement else
                  ["zb", "zb2"] if splits else ["flush", "gpipe"])
    errors = []
    for candidate in candidates:
        try:
            schedule = schedule_of(rows, candidate, replicas, plan.placement, read)
            validate(schedule)
            break
        except ScheduleError as error:
            errors.append(error)
    else:
        why = "; ".join(f"in mode {c}: {e}" for c, e in zip(candidates, errors)) if len(errors) > 1 else str(errors[0])
        raise ScheduleError(f"{read} is not a schedule pdtool can run in mode {' or '.join(candidates)}: {why}")
    result = simulate_schedule(plan, schedule)
    own = run_simulation(plan, mode=schedule.mode, minibatches=schedule.group, group=schedule.group)
    click.echo(simulation_table(result, plan), nl=False)
    click.echo(f"schedule     {read}: {schedule.group} microbatches, checked in mode {schedule.mode}; one step takes "
               f"{result.makespan_ms:.3f} ms, pdtool's own {schedule.mode} schedule of the plan {own.makespan_ms:.3f} ms "
               + (f"({result.makespan_ms / own.makespan_ms:.3f}x)" if own.makespan_ms else "(both take no time)"))
