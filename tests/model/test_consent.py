"""Consent before code (`pdtool.consent`): a spec read from a file is imported and called only
when it is a file of the experiment folder, marked by its author, or named by the user; anything
else is refused before its module is imported, so nothing of it runs."""
import sys
import textwrap

import pytest

from pdtool.consent import consent
from pdtool.model.data import DataError
from pdtool.errors import ModelError
from pdtool.model.spec import resolve_factory

RUNS = "open({marker!r}, 'w').close()\n"  # a module's top level that leaves a file when it runs


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A folder on sys.path outside the experiment folder (like site-packages), and an empty
    experiment folder as the current folder. Returns a writer of modules into it."""
    site = tmp_path / "site"
    site.mkdir()
    experiment = tmp_path / "experiment"
    experiment.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.chdir(experiment)
    made = []

    def write(relative: str, source: str):
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
        made.append(relative.removesuffix(".py").removesuffix("/__init__").replace("/", "."))
        return path
    yield write
    for name in made:
        sys.modules.pop(name, None)


def test_an_installed_unmarked_function_is_refused_before_its_module_runs(installed, tmp_path):
    marker = tmp_path / "IMPORTED"
    installed("evil_tools/__init__.py", RUNS.format(marker=str(marker)) + "def run(command): pass\n")
    with pytest.raises(ModelError, match="is not a pdtool model factory") as info:
        resolve_factory("evil_tools:run")
    line = str(info.value)
    assert "\n" not in line and "-m evil_tools:run" in line and "@pdtool.factory" in line
    assert not marker.exists() and "evil_tools" not in sys.modules


@pytest.mark.parametrize("source", [
    "import pdtool\n@pdtool.factory\ndef build(width=2):\n    return width\n",
    "from pdtool import factory\n@factory\ndef build(width=2):\n    return width\n",
    "import pdtool.consent\n@pdtool.consent.factory\ndef build(width=2):\n    return width\n",
    "from pdtool.consent import factory as mark\n@mark\ndef build(width=2):\n    return width\n",
], ids=["pdtool.factory", "factory", "pdtool.consent.factory", "renamed"])
def test_a_function_its_author_marked_is_accepted(installed, source):
    installed("marked_models.py", source)
    assert consent("marked_models:build", given=False).marked
    assert resolve_factory("marked_models:build")(width=3) == 3


def test_a_marked_function_re_exported_by_its_package_is_accepted(installed):
    installed("zoo_pkg/__init__.py", "from .impl import build\n")
    installed("zoo_pkg/impl.py", "import pdtool\n@pdtool.factory\ndef build():\n    return 'built'\n")
    assert resolve_factory("zoo_pkg:build")() == "built"


@pytest.mark.parametrize("source", [
    "def factory(f):\n    return f\n@factory\ndef build():\n    pass\n",  # a decorator named factory, not pdtool's
    "import other as pdtool\n@pdtool.factory\ndef build():\n    pass\n",  # a module bound to the name pdtool
    "import pdtool\n@pdtool.factory\ndef other():\n    pass\ndef build():\n    pass\n",  # another function marked
    "import pdtool\n@pdtool.factory\ndef build():\n    pass\n@pdtool.factory\nclass build:\n    pass\n",  # a class last
], ids=["own-factory", "alias", "other-function", "class"])
def test_what_only_looks_like_a_mark_is_refused(installed, source, tmp_path):
    marker = tmp_path / "IMPORTED"
    installed("lookalike.py", RUNS.format(marker=str(marker)) + source)
    with pytest.raises(ModelError, match="is not a pdtool model factory"):
        resolve_factory("lookalike:build")
    assert not marker.exists()


def test_a_mark_the_module_overrides_later_is_refused_after_import(installed):
    installed("rebound.py", "import os\nimport pdtool\n@pdtool.factory\ndef build():\n    pass\nbuild = os.system\n")
    with pytest.raises(ModelError, match="not on the function its module finally defines"):
        resolve_factory("rebound:build")


def test_a_file_of_the_experiment_folder_is_accepted_and_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mymodel.py").write_text("def build():\n    return 'mine'\n")
    try:
        allowed = consent("mymodel:build", given=False)
        assert allowed.origin == "mymodel.py" and not allowed.marked
        assert resolve_factory("mymodel:build")() == "mine"
    finally:
        sys.modules.pop("mymodel", None)


def test_an_installed_package_inside_the_experiment_folder_is_not_the_experiments(tmp_path, monkeypatch):
    """A virtual environment or a src/ folder on sys.path under the current folder holds installed
    code (e.g. pdtool's own tools when run from its checkout), not the experiment's."""
    site = tmp_path / ".venv" / "lib" / "site-packages"
    (site / "helper_pkg").mkdir(parents=True)
    (site / "helper_pkg" / "__init__.py").write_text("def remove(path):\n    pass\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="is not a pdtool model factory"):
        consent("helper_pkg:remove", given=False)


def test_pdtools_source_tree_is_not_an_experiment_folder(monkeypatch):
    """From a checkout of pdtool, `src.pdtool.jsonio` is pdtool's installed code under another name."""
    import pdtool

    root = pdtool.__file__.rsplit("/src/pdtool/", 1)[0]
    monkeypatch.chdir(root)
    with pytest.raises(ModelError, match="is not a pdtool model factory"):
        consent("src.pdtool.jsonio:write_json", given=False)


def test_a_spec_the_user_named_is_trusted():
    assert consent("os:getcwd", given=True).how == "named on the command line"


def test_an_entry_point_of_a_packages_metadata_marks_a_factory(installed, tmp_path):
    installed("plugin_models.py", "def build():\n    return 'plugin'\n")
    info = tmp_path / "site" / "plugin_models-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-models\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pdtool.models]\nbuild = plugin_models:build\n")
    assert "entry point" in consent("plugin_models:build", given=False).how
    assert resolve_factory("plugin_models:build")() == "plugin"
    with pytest.raises(DataError, match="pdtool.datasets entry point"):  # the models group marks no data set
        consent("plugin_models:build", given=False, what="data", error=DataError)


def test_a_module_that_does_not_exist_is_the_import_error_it_would_be(installed):
    with pytest.raises(ModelError, match="cannot import 'no_such_module_xyz'"):
        consent("no_such_module_xyz.sub:f", given=False)
    installed("flat_module.py", "x = 1\n")
    with pytest.raises(ModelError, match="cannot import 'flat_module.sub'"):
        consent("flat_module.sub:f", given=False)


def test_a_dist_info_folder_in_the_experiment_folder_consents_nothing(tmp_path, monkeypatch):
    """Issue 35 item 2: `fake-0.1.dist-info/entry_points.txt` listing `x = os:system` in the experiment folder
    made a plan naming os:system run its command."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # the experiment folder is importable, as pd makes it
    info = tmp_path / "fake-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pdtool.models]\nx = os:system\ny = local_models:build\n")
    with pytest.raises(ModelError, match="'os:system' is not a pdtool model factory") as info_:
        consent("os:system", given=False)
    assert "\n" not in str(info_.value)
    with pytest.raises(ModelError, match="is not a pdtool model factory"):
        resolve_factory("os:system")  # refused before anything could call it
    (tmp_path / "local_models.py").write_text("def build():\n    return 'local'\n")  # a file of the folder: its own
    assert resolve_factory("local_models:build")() == "local"
