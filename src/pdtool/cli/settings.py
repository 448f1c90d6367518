"""Options in groups, read from a TOML file too, and recorded as the run resolved them.

A command built with `GroupedCommand` lists its options under headings in `--help` (its
`groups`: heading -> option names) and takes `--config FILE`: a TOML file whose keys are the long
options' names as typed after the two dashes (`checkpoint-dir = "ck"`; `checkpoint_dir` is the
same key), at the top level or in a table named after the option's group (`[recipe]`). Options
typed on the command line win over the file; the file's win over the defaults. Each key is checked
as its option is (type, range, choices) and a bad one is one line naming the file, the key and the
fix. A relative path in the file is relative to the file's folder, so a run file checked in beside
its plan means the same from any working directory. `settings(ctx)` is what a run records: every
option's value and where it came from.
"""
from __future__ import annotations

import difflib
import os
import tomllib

import click
from click.core import ParameterSource

CONFIG = "config_file"
"""The parameter name of --config."""

_SOURCES = {ParameterSource.COMMANDLINE: "command line", ParameterSource.DEFAULT_MAP: "config file",
            ParameterSource.ENVIRONMENT: "environment", ParameterSource.DEFAULT: "default"}


class GroupedCommand(click.Command):
    """A command whose options appear under headings in `--help` and may come from `--config`."""

    def __init__(self, *args, groups: dict[str, tuple[str, ...]], **kwargs):
        super().__init__(*args, **kwargs)
        self.groups = groups
        self.params.append(click.Option(
            ["--config", CONFIG], type=click.Path(dir_okay=False), is_eager=True, expose_value=False,
            callback=_read_config, metavar="FILE.toml",
            help="Read option values from a TOML file (keys: the long options' names, e.g. lr = 0.1, at the top "
                 "level or in a table named after the option's group, e.g. [recipe]); options on the command line "
                 "win. See docs/cli.md#configuration-files."))
        known = {name for names in groups.values() for name in names}
        missing = [p.name for p in self.params if isinstance(p, click.Option) and p.name not in known
                   and p.name != CONFIG and not p.hidden]
        if missing:
            raise TypeError(f"pd {self.name}: options without a help group: {missing}")

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        by_name = {p.name: p for p in self.get_params(ctx)}
        for heading, names in self.groups.items():
            rows = [by_name[name].get_help_record(ctx) for name in names if name in by_name]
            with formatter.section(f"{heading.capitalize()} options"):
                formatter.write_dl([row for row in rows if row])
        rest = [p.get_help_record(ctx) for p in self.get_params(ctx)
                if isinstance(p, click.Option) and not any(p.name in names for names in self.groups.values())]
        with formatter.section("Other options"):
            formatter.write_dl([row for row in rest if row])


def long_name(param: click.Parameter) -> str:
    """The option's long name without its dashes ('checkpoint-dir')."""
    longs = [opt for opt in param.opts if opt.startswith("--")]
    return (longs[0] if longs else param.opts[0])[2:]


def settings(ctx: click.Context) -> dict:
    """What a run records of its options: each one's value by its long name, where the values came
    from (command line, config file, default), and the config file's path."""
    options, sources = {}, {}
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name == CONFIG or param.hidden:
            continue
        value = ctx.params.get(param.name)
        options[long_name(param)] = list(value) if isinstance(value, tuple) else value
        source = ctx.get_parameter_source(param.name)
        sources[long_name(param)] = _SOURCES.get(source, str(source))
    config = ctx.meta.get(CONFIG)
    return {"command": f"pd {ctx.command.name}", "config_file": config, "options": options, "sources": sources}


def _read_config(ctx: click.Context, param: click.Parameter, path: str | None) -> None:
    """--config's callback (eager: before every other option): the file's values become the
    defaults of the options it names (click's `default_map`)."""
    if path is None or ctx.resilient_parsing:
        return
    try:
        with open(path, "rb") as file:
            document = tomllib.load(file)
    except OSError as exc:
        raise click.BadParameter(f"{path}: cannot read it ({exc.strerror or exc})", ctx, param) from None
    except tomllib.TOMLDecodeError as exc:
        raise click.BadParameter(f"{path} is not TOML ({exc}); see docs/cli.md#configuration-files", ctx, param) from None
    command: GroupedCommand = ctx.command
    by_key = {long_name(p): p for p in command.params
              if isinstance(p, click.Option) and p.name != CONFIG and not p.hidden and p.name != "help"}
    group_of = {name: heading for heading, names in command.groups.items() for name in names}
    values: dict[str, object] = {}
    for key, value, section in _entries(document, path, command.groups):
        name = key.replace("_", "-")
        where = f"{path}: {f'[{section}] ' if section else ''}{key}"
        option = by_key.get(name)
        if option is None and name in ("config", "help", "version"):
            raise click.UsageError(f"{where}: --{name} cannot be set in a config file; give it on the command line", ctx)
        if option is None:
            close = difflib.get_close_matches(name, by_key, n=1)
            raise click.UsageError(f"{where}: pd {command.name} has no option --{name}"
                                   + (f"; did you mean {close[0]}?" if close else
                                      f"; see pd {command.name} --help for its options"), ctx)
        if section and group_of.get(option.name) != section:
            raise click.UsageError(f"{where}: --{name} is one of the {group_of.get(option.name)} options; move it to "
                                   f"[{group_of.get(option.name)}] or the top level", ctx)
        if option.name in values:
            raise click.UsageError(f"{where}: --{name} is set twice in the file; keep one", ctx)
        values[option.name] = _checked(ctx, option, value, where, os.path.dirname(os.path.abspath(path)))
    ctx.meta[CONFIG] = os.path.abspath(path)
    ctx.default_map = {**(ctx.default_map or {}), **values}


def _entries(document: dict, path: str, groups: dict[str, tuple[str, ...]]):
    """(key, value, section or None) of every setting of a config document."""
    for key, value in document.items():
        if isinstance(value, dict):
            if key not in groups:
                raise click.UsageError(f"{path}: [{key}] is not a group of options; the groups are "
                                       f"{', '.join(f'[{g}]' for g in groups)} (or write the keys at the top level)")
            for inner, setting in value.items():
                if isinstance(setting, dict):
                    raise click.UsageError(f"{path}: [{key}.{inner}]: option groups do not nest; write "
                                           f"{inner} = VALUE under [{key}]")
                yield inner, setting, key
        else:
            yield key, value, None


def _checked(ctx: click.Context, option: click.Option, value, where: str, folder: str):
    """`value` from the file as `option` takes it (checked by the option's own type), or one line."""
    typed = f"--{long_name(option)}"
    if option.is_flag:
        if not isinstance(value, bool):
            raise click.UsageError(f"{where}: {typed} is a switch; write true or false, not {value!r}", ctx)
        return value
    if option.nargs > 1:
        if not isinstance(value, list) or len(value) != option.nargs:
            raise click.UsageError(f"{where}: {typed} takes {option.nargs} values; write them as a list, e.g. "
                                   f"[{', '.join(['...'] * option.nargs)}]", ctx)
        items = value
    else:
        items = [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise click.UsageError(f"{where}: {typed} takes {option.type.name if option.nargs == 1 else 'numbers'}, "
                                   f"not {_toml_kind(item)}; write it as on the command line, e.g. "
                                   f"{long_name(option)} = {_example(option)}", ctx)
    if isinstance(option.type, click.Path) and isinstance(value, str) and value not in ("-", ""):
        value = os.path.join(folder, os.path.expanduser(value))  # an absolute path stays as it is
    try:
        option.type_cast_value(ctx, value)
    except click.BadParameter as exc:
        raise click.UsageError(f"{where}: {exc.message.rstrip('.')}; give a value {typed} accepts (pd {ctx.command.name} "
                               "--help)", ctx) from None
    return tuple(value) if isinstance(value, list) else value


def _toml_kind(value) -> str:
    return {bool: "true/false", list: "a list", dict: "a table"}.get(type(value), type(value).__name__)


def _example(option: click.Option) -> str:
    if isinstance(option.type, click.Choice):
        return f'"{option.type.choices[0]}"'
    if isinstance(option.type, (click.IntRange, click.FloatRange)) or option.type in (click.INT, click.FLOAT):
        return "1"
    return '"..."'
