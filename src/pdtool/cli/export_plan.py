"""`pd export-plan`: a plan as the settings of another runtime (torchtitan, Megatron-Core, torch pipelining)."""
from __future__ import annotations

import click

from .group import _count, _examples, cli


@cli.command(name="export-plan", short_help="write a plan for torchtitan, Megatron or torch pipelining -> FILE",
             epilog=_examples("pd export-plan llama.plan.json --to torchtitan -o llama.pp.toml",
                                "pd export-plan llama.plan.json --to megatron -o llama.pp.sh",
                                "pd export-plan llama.plan.json --to pipelining -o llama.pp.json"))
@click.argument("plan_path", metavar="PLAN.json", type=click.Path(dir_okay=False))
@click.option("--to", "target", required=True, type=click.Choice(("torchtitan", "megatron", "pipelining")),
              help="The runtime: torchtitan (a TOML fragment of its job config), megatron (a bash array of "
                   "Megatron-Core arguments with the layout string), pipelining (a JSON of each PipelineStage's "
                   "modules and the schedule class).")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, allow_dash=True),
              help="The file to write ('-' for stdout). Written atomically.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False), metavar="PROFILE.json",
              help="The profile the plan was made from (its layer names are the module names written) [default: "
                   "found by its sha256 beside the plan or here].")
def export_plan(plan_path, target, output, profile_path):
    """Write a plan's partition and schedule as the settings another runtime reads.

    Not `pd export`, which writes a checkpoint's weights. Module names are the profiled model's
    own: profile the model class the target runs (e.g. torchtitan's Llama). What the target
    cannot express is refused in one line, or approximated with a line saying what is lost and
    what the target runs instead; either way pd simulate's time per minibatch for what the target
    runs is printed. Modes zb and zb2 (torch has no class for them) also write pdtool's schedule
    as a CSV beside the file (FILE.schedule.csv), which torch's _PipelineScheduleRuntime loads.
    """
    import os
    import shlex
    import sys

    from ..artifacts.plan import Plan
    from ..jsonio import check_writable, write_text_atomic
    from ..schedule import generate
    from ..schedule.torch_csv import to_csv
    from ..targets import formats
    from ..targets.export import NAMES, exported
    from .show import _plan_profile

    check_writable(output, (plan_path,) + ((profile_path,) if profile_path else ()))
    plan = Plan.load(plan_path)
    _, profile = _plan_profile(plan_path, plan, profile_path, needed=True, purpose="pd export-plan needs the layer "
                               "names of")
    export = exported(plan, profile, target)
    command = shlex.join(["pd", "export-plan"] + sys.argv[2:]) if sys.argv[1:2] == ["export-plan"] else \
        f"pd export-plan {plan_path} --to {target} -o {output}"
    csv_path = csv_name = None
    if export.csv:
        if output == "-":
            raise click.UsageError(f"mode {export.mode} writes its schedule as a CSV beside the file: give -o FILE, "
                                   "not -")
        csv_path = os.path.splitext(output)[0] + ".schedule.csv"
        csv_name = os.path.basename(csv_path)
        check_writable(csv_path, (plan_path,))
    if target == "torchtitan":
        text = formats.torchtitan(export, command, csv_path)  # torchtitan reads it from where it runs
    elif target == "megatron":
        text = formats.megatron(export, command)
    else:
        text = formats.pipelining(export, command, os.path.basename(plan_path), plan.profile.model, csv_name)
    write_text_atomic(output, text)
    if csv_path:
        schedule = generate(export.mode, tuple(1 for _ in plan.stages), export.microbatches, export.microbatches,
                            placement=plan.placement)
        write_text_atomic(csv_path, to_csv(schedule))
    for note in export.notes:
        click.echo(f"pd: approximated: {note}", err=True)
    where = "stdout" if output == "-" else output
    click.echo(f"wrote {where}" + (f" and {csv_path}" if csv_path else "") + f": {len(plan.stages)} stages on "
               f"{export.pipeline} pipeline ranks x {_count(export.replicas, 'replica')}, {NAMES[target]} schedule "
               f"{export.schedule}, {export.microbatches} microbatches of {export.microbatch}", err=True)
    click.echo(f"pd simulate: what {NAMES[target]} runs takes {export.target_ms:.3f} ms per minibatch (the plan as "
               f"pdtool runs it: {export.plan_ms:.3f} ms)", err=True)
