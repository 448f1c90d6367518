"""`pd show`: a profile's or plan's summary; a plan's picture."""
from __future__ import annotations

import click

from ..fields import check_schema
from ..jsonio import check_writable, read_json
from .group import Count, _examples, cli


@cli.command(short_help="print a summary of a profile or plan; draw a plan",
             epilog=_examples("pd show resnet.profile.json --top 10",
                                "pd show resnet.plan.json --render resnet.svg"))
@click.argument("artifact", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--top", type=Count(1, 100000), default=15, show_default=True,
              help="Profiles: how many of the heaviest layers to list.")
@click.option("--render", "picture", type=click.Path(dir_okay=False), metavar="PICTURE",
              help="Plans: also draw the partition to PICTURE: one coloured box per stage holding its layers "
                   "grouped by the model's blocks (.svg, .png, .pdf or .dot; the .dot source when graphviz's dot "
                   "is missing).")
@click.option("--layers", is_flag=True, help="Plans, with --render: draw every layer as its own node instead of "
                                             "grouping them into blocks.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False), metavar="PROFILE.json",
              help="Plans: the profile the plan was made from, for --render [default: X.profile.json beside X.plan.json].")
def show(artifact, top, picture, layers, profile_path):
    """Print a readable summary of a profile or plan JSON file (and draw a plan)."""
    from ..artifacts.plan import OLDER as OLDER_PLANS, SCHEMA as PLAN_SCHEMA, Plan
    from ..artifacts.profile import SCHEMA as PROFILE_SCHEMA, Profile
    from ..views.show import plan_table, profile_table

    data = read_json(artifact)
    if isinstance(data, dict) and data.get("schema") in (PLAN_SCHEMA, *OLDER_PLANS):
        plan = Plan.from_json(data, artifact)
        if picture:
            from ..views.render import render_plan

            source, profile = _plan_profile(artifact, plan, profile_path, needed=True)
            check_writable(picture, (artifact, source))
            written, warning = render_plan(plan, profile, picture, layers=layers)
            if warning:
                click.echo(f"pd: warning: {warning}", err=True)
            click.echo(f"wrote {written}", err=True)
        click.echo(plan_table(plan), nl=False)
        return
    if picture or profile_path or layers:
        raise click.UsageError("--render, --layers and --profile apply to plan files only")
    check_schema(data, PROFILE_SCHEMA, artifact)
    click.echo(profile_table(Profile.from_json(data, artifact), top), nl=False)


def _plan_profile(plan_path: str, plan, profile_path: str | None, needed: bool,
                  purpose: str = "--render needs the layer graph of"):
    """The plan's profile (given, or found by its sha256), checked against the plan; None when
    not `needed` and not found. Raises a usage error naming what to pass when needed and missing."""
    from ..artifacts.plan import check_against_profile, find_profile
    from ..artifacts.profile import Profile

    source = profile_path or find_profile(plan_path, plan)
    if source is None:
        if needed:
            raise click.UsageError(f"{purpose} {plan_path}: no profile with its sha256 "
                                   f"({plan.profile.sha256[:12]}...) beside it or here; give --profile PROFILE.json "
                                   f"(the plan was made by: {plan.command or 'an unknown command'})")
        return None, None
    profile = Profile.load(source)
    check_against_profile(plan, profile, plan_path, source)
    return source, profile
