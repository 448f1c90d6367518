import json

import pytest
from click.testing import CliRunner

from pdtool.cli import cli
from pdtool.profile import Profile

TINY = ["--model", "pdtool.zoo:mlp", "-a", "in_features=12", "-a", "hidden=8", "-a", "depth=2",
        "-b", "4", "--repeats", "2", "--warmup", "0"]


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def assert_one_line_error(result, fragment, code=1):
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pd: error: "), result.stderr
    assert fragment in lines[0]
    assert "Traceback" not in result.output


def test_profile_writes_a_valid_profile_and_reports_on_stderr(tmp_path):
    out = tmp_path / "m.profile.json"
    result = invoke("profile", *TINY, "-o", str(out))
    assert result.exit_code == 0, result.output
    profile = Profile.load(out)
    assert [l.name for l in profile.layers] == ["0", "2", "4"]
    assert profile.model.kwargs == {"in_features": 12, "hidden": 8, "depth": 2}
    assert result.stdout == "" and f"wrote {out}: 3 layers" in result.stderr


def test_profile_to_stdout_writes_only_json_there():
    result = invoke("profile", *TINY, "-o", "-", "--quiet")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["schema"] == "pdtool.profile/1"


def test_profile_options_reach_the_profiler(tmp_path):
    out = tmp_path / "p.json"
    result = invoke("profile", *TINY, "-o", str(out), "--granularity", "op", "--method", "modules")
    assert result.exit_code == 0, result.output
    profile = Profile.load(out)
    assert profile.method == "modules" and profile.granularity == "op" and len(profile.layers) == 5


def test_show_prints_heaviest_layers_and_totals(tmp_path):
    out = tmp_path / "m.profile.json"
    invoke("profile", *TINY, "-o", str(out))
    result = invoke("show", str(out), "--top", "2")
    assert result.exit_code == 0
    assert "heaviest 2 of 3 layers" in result.stdout
    assert "layer sum / step" in result.stdout and "pdtool.zoo:mlp" in result.stdout
    assert len([l for l in result.stdout.splitlines() if l.strip().startswith(("0 ", "1 ", "2 "))]) == 2


@pytest.mark.parametrize("args, fragment", [
    (["--model", "no_such_module_xyz:f"], "cannot import 'no_such_module_xyz'"),
    (["--model", "pdtool.zoo:nothing"], "has no attribute 'nothing'"),
    (["--model", "toymodels:raises"], "the factory raised ValueError"),
    (["--model", "pdtool.zoo:mlp", "-a", "bogus=1"], "unexpected keyword argument 'bogus'"),
    (["--model", "toymodels:wrong_shape"], "rejected its sample input"),
    (["--model", "pdtool.zoo:mlp", "-a", "width"], "not KEY=VALUE"),
    (["--model", "toymodels:dynamic", "--method", "fx"], "torch.fx cannot trace"),
])
def test_bad_models_get_one_line_exit_1_and_no_file(tmp_path, args, fragment):
    out = tmp_path / "x.json"
    result = invoke("profile", *args, "-o", str(out), "--repeats", "1")
    assert_one_line_error(result, fragment)
    assert not out.exists()


def test_a_failed_profile_leaves_the_old_output_untouched(tmp_path):
    out = tmp_path / "x.json"
    out.write_text("old\n")
    result = invoke("profile", "--model", "toymodels:raises", "-o", str(out))
    assert result.exit_code == 1 and out.read_text() == "old\n"


def test_missing_model_is_a_usage_error():
    result = invoke("profile", "-o", "x.json")
    assert result.exit_code == 2 and "Missing option '--model'" in result.stderr


def test_output_into_a_missing_folder_is_one_line(tmp_path):
    result = invoke("profile", *TINY, "-o", str(tmp_path / "no" / "x.json"))
    assert_one_line_error(result, "does not exist")


@pytest.mark.parametrize("content, fragment", [
    (None, "no such file"),
    ("{not json", "not valid JSON"),
    ('{"schema": "pdtool.plan/9"}', "schema is 'pdtool.plan/9'"),
    ('{"schema": "pdtool.profile/1"}', "missing field; regenerate the file"),
    ("[1, 2]", "not a pdtool artifact"),
])
def test_show_rejects_bad_files_in_one_line(tmp_path, content, fragment):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    assert_one_line_error(invoke("show", str(path)), fragment)


def test_help_and_version():
    assert "profile" in invoke("--help").stdout
    assert "--granularity" in invoke("profile", "--help").stdout
    assert invoke("--version").stdout.startswith("pdtool, version ")
