"""docs/cli.md, generated: every command's `--help`, the mode table and the module index.

    python -m pdtool.cli.reference            # rewrite docs/cli.md
    python -m pdtool.cli.reference --check    # exit 1 when docs/cli.md is not what the code says

`tests/unit/test_reference.py` fails when the file drifts from the code (an option added, a help
text changed, a mode or a module added): run the first command and commit the result.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import click

from ..schedule.modes import MODES, TABLE
from .group import cli  # the package (pdtool.cli) has added every command to it by now

WIDTH = 100  # the help text's width, whatever the terminal's
PACKAGE = Path(__file__).resolve().parents[1]
TARGET = PACKAGE.parents[1] / "docs" / "cli.md"


def _context(command: click.Command, name: str, parent: click.Context | None = None) -> click.Context:
    """The context `pd` gives `command` (its settings, a parent's inherited), at a fixed width;
    click remembers a command's help option from the first context that asks for it."""
    return click.Context(command, info_name=name, parent=parent,
                         **{**command.context_settings, "terminal_width": WIDTH, "max_content_width": WIDTH})


def commands() -> list[tuple[str, str]]:
    """(`pd NAME`, its --help) for pd and each of its commands, in the order `pd --help` lists them."""
    with _context(cli, "pd") as root:
        found = [("pd", cli.get_help(root))]
        for name in cli.list_commands(root):
            command = cli.get_command(root, name)
            with _context(command, name, root) as context:
                found.append((f"pd {name}", command.get_help(context)))
    return found


CONFIG_INTRO = """`pd train` and `pd plan` read option values from a TOML file: `--config FILE.toml`. A key is a
long option's name as typed after the two dashes (`checkpoint-dir = "ck"`; `checkpoint_dir` is the
same key), at the top level or in the table of the option's group (the headings of `--help`). Options
typed on the command line win over the file, the file's over the defaults. Each value is checked as
the option checks it; an unknown key, a wrong type or a value out of range is one line naming the file,
the key and the fix. A relative path in the file is relative to the file's folder. Every run records
its resolved settings (each option's value and where it came from, and what the run resolved them to:
mode, group, steps, precision, threads, recipe) in its checkpoints' `manifest.json` (`meta.settings`)
and beside its metrics (`--metrics m.csv` writes `m.csv.json`). Each command's keys, by table, with
their defaults:"""


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_keys(command: click.Command) -> str:
    """A command's configuration file: every key in its table, commented out, with its default."""
    from .settings import long_name

    by_name = {p.name: p for p in command.params}
    lines = []
    with _context(command, command.name) as context:
        for heading, names in command.groups.items():
            lines.append(f"[{heading}]")
            for name in names:
                option = by_name[name]
                default = option.get_default(context)
                unset = default is None or option.value_is_missing(default)
                lines.append(f"# {long_name(option)} =" + ("" if unset else f" {_toml(default)}"))
            lines.append("")
    return "\n".join(lines).rstrip()


def mode_table() -> str:
    """The mode table (`schedule.modes.TABLE`) as Markdown."""
    rows = ["| mode | what it runs | steps | order | flushes | split backward | weight versions kept | tied weights "
            "| stages per worker | in pd plan and pd train |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for mode in TABLE.values():
        chunks = "one" if mode.placement is None else f"several, {mode.placement}"
        offered = "yes" if mode.name in MODES else "pd plan --virtual-stages V --mode (pd train runs the plan's)"
        rows.append(f"| `{mode.name}` | {mode.about} | {mode.steps} | {mode.order} | {'yes' if mode.flushes else 'no'} "
                    f"| {'yes' if mode.split else 'no'} | {mode.versions_kept or 'one per minibatch in flight'} "
                    f"| {'yes' if mode.ties else 'no'} | {chunks} | {offered} |")
    return "\n".join(rows)


def module_index() -> str:
    """Every module of the package with the first line of its docstring, as Markdown rows."""
    rows = ["| module | what it is |", "|---|---|"]
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        first = " ".join(doc.strip().split("\n\n")[0].split())
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        rows.append(f"| `{name}` | {first.replace('|', '/')} |")
    return "\n".join(rows)


def text() -> str:
    """docs/cli.md as the code says it."""
    parts = ["# Command-line reference", "",
             "Generated by `python -m pdtool.cli.reference` from the code; a test fails when it drifts.", "",
             "## Commands", ""]
    for name, help_text in commands():
        parts += [f"### `{name}`", "", "```", help_text.rstrip(), "```", ""]
    parts += ["## Configuration files", "", CONFIG_INTRO, ""]
    with _context(cli, "pd") as root:
        for name in cli.list_commands(root):
            command = cli.get_command(root, name)
            if hasattr(command, "groups"):
                parts += [f"### `pd {name} --config`", "", "```toml", config_keys(command), "```", ""]
    parts += ["## Modes", "", "`pd plan --mode`, `pd simulate --mode`, `pd train --mode` ([schedules](schedules.md)):", "",
              mode_table(), "", "## Modules", "", "The package `pdtool` ([architecture](architecture.md)):", "",
              module_index(), ""]
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    wanted = text()
    if "--check" in argv:
        if not TARGET.exists() or TARGET.read_text(encoding="utf-8") != wanted:
            print(f"{TARGET} is not what the code says; run: python -m pdtool.cli.reference", file=sys.stderr)
            return 1
        return 0
    TARGET.parent.mkdir(exist_ok=True)
    TARGET.write_text(wanted, encoding="utf-8")
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
