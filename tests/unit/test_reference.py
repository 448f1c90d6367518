"""docs/cli.md is what the code says: every command's --help, the mode table, the module index."""
from pdtool.cli import reference


def test_the_command_line_reference_is_current():
    """Run `python -m pdtool.cli.reference` after changing an option, a help text, a mode or a module.
    In a fresh process: click remembers each command's help option from the first context that
    asks, and other tests call the commands in their own ways."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pdtool.cli.reference", "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_reference_holds_every_option_of_every_command():
    import click

    from pdtool.cli import cli

    written = reference.TARGET.read_text(encoding="utf-8")
    with click.Context(cli, info_name="pd") as context:
        for name in cli.list_commands(context):
            for param in cli.get_command(context, name).params:
                for option in getattr(param, "opts", []):
                    if option.startswith("--"):
                        assert option in written, (name, option)
    assert all(f"`{mode}`" in written for mode in ("pipedream", "flush", "zb2"))


def test_the_readme_is_short_and_every_link_of_the_docs_resolves():
    """README at most 300 lines and no dated lines (measurements live in bench/results/); every
    relative link of README.md and docs/ names a file of the repository."""
    import re
    from pathlib import Path

    root = reference.TARGET.parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    assert not re.search(r"20\d\d-\d\d-\d\d", readme)
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target:
                assert (page.parent / target).exists(), (page.name, target)
