"""Options in groups and from a TOML file (`pdtool.cli.settings`): `pd plan` and `pd train --config`.
The same training from flags and from a file: tests/dist/test_cli_train.py."""
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pdtool.cli import cli
from pdtool.cli.settings import GroupedCommand

PROFILE = str(Path(__file__).resolve().parents[2] / "profiles" / "mlp.profile.json")


def _pd(*args):
    return CliRunner().invoke(cli, list(args))


def test_a_plan_from_a_config_file_is_the_plan_from_the_same_flags(tmp_path):
    flagged = tmp_path / "flags.plan.json"
    assert _pd("plan", PROFILE, "--cluster", "4x10Gbit/s", "--straight", "--mode", "flush", "--optimizer", "adam",
               "-o", str(flagged)).exit_code == 0
    folder = tmp_path / "experiment"
    folder.mkdir()
    (folder / "plan.toml").write_text('[cluster]\ncluster = "4x10Gbit/s"\n[search]\nstraight = true\nmode = "flush"\n'
                                      'optimizer = "adam"\n[outputs]\noutput = "configured.plan.json"\n')
    result = _pd("plan", PROFILE, "--config", str(folder / "plan.toml"))
    assert result.exit_code == 0, result.output
    assert (folder / "configured.plan.json").read_bytes() == flagged.read_bytes()  # relative to the file's folder


def test_the_command_line_wins_over_the_file(tmp_path):
    (tmp_path / "plan.toml").write_text('cluster = "4x10Gbit/s"\noutput = "from-file.json"\nmode = "gpipe"\n')
    result = _pd("plan", PROFILE, "--config", str(tmp_path / "plan.toml"), "-o", str(tmp_path / "typed.json"),
                 "--mode", "flush")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "typed.json").exists() and not (tmp_path / "from-file.json").exists()
    assert '"mode": "flush"' in (tmp_path / "typed.json").read_text()


@pytest.mark.parametrize("content, fragment", [
    ("lr = 0.1\n[launch]\nlrr = 2\n", "run.toml: [launch] lrr: pd train has no option --lrr; did you mean lr?"),
    ("[launch]\nlr = 2\n", "[launch] lr: --lr is one of the recipe options; move it to [recipe] or the top level"),
    ('lr = "abc"\n', "run.toml: lr: 'abc' is not a valid finite float; give a value --lr accepts"),
    ("lr = -1\n", "run.toml: lr: -1.0 is not in the range 0<x<=1000000.0; give a value --lr accepts"),
    ("lr = true\n", "run.toml: lr: --lr takes finite float, not true/false"),
    ("resume = 1\n", "run.toml: resume: --resume is a switch; write true or false, not 1"),
    ("betas = 0.9\n", "run.toml: betas: --betas takes 2 values; write them as a list"),
    ("betas = [0.9, 1.5]\n", "run.toml: betas: 1.5 is not in the range 0<=x<1"),
    ("lr = [1]\n", "run.toml: lr: --lr takes finite float, not a list"),
    ('mode = "nope"\n', "run.toml: mode: 'nope' is not one of 'pipedream'"),
    ("lr = \n", "run.toml is not TOML (Invalid value (at line 1, column 6))"),
    ("[foo]\nlr = 1\n", "run.toml: [foo] is not a group of options; the groups are [run], [recipe]"),
    ("[recipe.more]\nlr = 1\n", "[recipe.more]: option groups do not nest"),
    ('config = "other.toml"\n', "run.toml: config: --config cannot be set in a config file"),
    ("lr = 0.1\n[recipe]\nlr = 0.2\n", "[recipe] lr: --lr is set twice in the file; keep one"),
    ("steps = 0\n", "run.toml: steps: 0 is not in the range 1<=x<=1000000000"),
])
def test_a_bad_config_file_is_one_line_naming_the_file_and_the_key(tmp_path, content, fragment):
    (tmp_path / "run.toml").write_text(content)
    result = _pd("train", str(tmp_path / "missing.plan.json"), "--config", str(tmp_path / "run.toml"))
    assert result.exit_code == 2  # a usage error, before the plan is even read
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: ") and fragment in last, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]


def test_a_missing_config_file_is_one_line(tmp_path):
    result = _pd("train", "x.plan.json", "--config", str(tmp_path / "none.toml"))
    assert result.exit_code == 2 and "none.toml: cannot read it (No such file or directory)" in result.stderr


def test_underscores_and_dashes_name_the_same_key(tmp_path):
    (tmp_path / "plan.toml").write_text('cluster = "2x10Gbit/s"\ndata_parallel = true\noutput = "p.json"\n')
    assert _pd("plan", PROFILE, "--config", str(tmp_path / "plan.toml")).exit_code == 0
    assert '"replicas": 2' in (tmp_path / "p.json").read_text()


def test_help_lists_the_options_under_their_groups():
    text = _pd("train", "--help").output
    headings = [line for line in text.splitlines() if line.endswith("options:")]
    assert headings == ["Run options:", "Recipe options:", "Checkpoints options:", "Launch options:",
                        "Devices options:", "Outputs options:", "Other options:"]
    recipe = text.split("Recipe options:")[1].split("Checkpoints options:")[0]
    assert "--lr FINITE FLOAT" in recipe and "--weight-decay" in recipe and "--steps INTEGER" not in recipe
    assert "--config FILE.toml" in text.split("Other options:")[1]
    assert "Cluster options:" in _pd("plan", "--help").output


def test_every_option_of_a_grouped_command_has_a_group():
    with pytest.raises(TypeError, match=r"options without a help group: \['extra'\]"):
        GroupedCommand("x", params=[click.Option(["--kept"]), click.Option(["--extra"])],
                       groups={"run": ("kept",)})
