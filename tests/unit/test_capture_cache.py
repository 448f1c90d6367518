"""pd train's launcher keeps its capture between runs (`runtime.launcher.capture_cache`): a run of
the same plan, model, data and folder takes the stages from the cache, and anything it came from
that changed makes it capture again."""
import dataclasses
import json
import os
import shutil
import sys
import textwrap

import pytest

from pdtool.artifacts.profile import ModelRef
from pdtool.errors import PdtoolError
from pdtool.runtime.launcher import capture_cache, preflight as preflight_module
from pdtool.runtime.launcher.preflight import preflight

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dist"))
from helpers import plan_with  # noqa: E402

FACTORY = '''
import torch
from torch import nn
import pdtool


@pdtool.factory
def make(width: int = 6):
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3))
    sample = lambda batch: ((torch.randn(batch, 4),), torch.randint(0, 3, (batch,)))
    return model, sample, lambda out, target: nn.functional.cross_entropy(out, target)


@pdtool.factory
def from_config():
    """A model built from a config file on disk, as a Hugging Face folder's config.json builds one."""
    import json
    import pathlib

    config = json.loads((pathlib.Path(__file__).parent / "config.json").read_text())
    model = nn.Sequential(nn.Linear(4, config["width"]), getattr(nn, config["activation"])(), nn.Linear(config["width"], 3))
    sample = lambda batch: ((torch.randn(batch, 4),), torch.randint(0, 3, (batch,)))
    return model, sample, lambda out, target: nn.functional.cross_entropy(out, target)


@pdtool.factory
def rows():
    """Data read from a file beside this one: its width is the file's."""
    import pathlib

    width = int((pathlib.Path(__file__).parent / "width.txt").read_text())
    return torch.utils.data.TensorDataset(torch.randn(8, width), torch.randint(0, 3, (8,)))
'''


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """An experiment folder (the current one) with its own model factory, and a cache of its own."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(capture_cache.ENV, str(tmp_path / "cache"))
    name = f"cachedmodel_{abs(hash(str(tmp_path))) % 10 ** 8}"
    (tmp_path / f"{name}.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path, name
    sys.modules.pop(name, None)


@pytest.fixture
def cuts(monkeypatch):
    """The captures the launcher makes (`model.capture.cut` calls)."""
    made = []
    real = preflight_module.cut

    def counting(plan, bundle):
        made.append(plan)
        return real(plan, bundle)

    monkeypatch.setattr(preflight_module, "cut", counting)
    return made


def _run(plan, path, heard=None, data="synthetic", mode="flush"):
    return preflight(
        plan, plan_path=str(path), mode=mode, data=data, seed=0, imports=(heard if heard is not None else []).append
    )


def _plan(tmp_path, name):
    return plan_with(tmp_path, [((0, 0), 1), ((1, 1), 1)], mode="flush", ref=ModelRef(f"{name}:make", {}),
                     batch_size=2)


def test_a_second_run_of_a_plan_takes_the_capture_from_the_cache(folder, cuts, monkeypatch):
    tmp_path, name = folder
    plan, path = _plan(tmp_path, name)
    first = _run(plan, path)
    assert len(cuts) == 1 and len(list((tmp_path / "cache").glob("*.json"))) == 1
    order = []
    real_build = preflight_module.build_model
    monkeypatch.setattr(preflight_module, "build_model", lambda *a: (order.append("build"), real_build(*a))[1])
    second = _run(plan, path, order)
    assert len(cuts) == 1  # no second capture
    assert second.capture == first.capture and second.parameters == first.parameters
    assert first.cached is None and second.cached.startswith(str(tmp_path / "cache"))
    # the workers' forkserver hears the model's modules (its factory's and its classes') at once, and the
    # launcher does not build the model
    assert order == [(name, "torch.nn.modules.activation", "torch.nn.modules.container", "torch.nn.modules.linear")]
    assert first.modules == second.modules == order[0]  # what job.prepare hands the launch (RunConfig.modules)


def test_a_config_file_the_factory_read_is_part_of_the_capture(folder, cuts):
    tmp_path, name = folder
    (tmp_path / "config.json").write_text('{"width": 6, "activation": "ReLU"}')
    plan, path = plan_with(tmp_path, [((0, 0), 1), ((1, 1), 1)], mode="flush",
                           ref=ModelRef(f"{name}:from_config", {}), batch_size=2)
    _run(plan, path)
    _run(plan, path)
    assert len(cuts) == 1
    (tmp_path / "config.json").write_text('{"width": 6, "activation": "Tanh"}')  # same parameters, another graph
    _run(plan, path)
    assert len(cuts) == 2


def test_data_read_from_files_is_checked_again(folder, cuts):
    tmp_path, name = folder
    plan, path = _plan(tmp_path, name)
    (tmp_path / "width.txt").write_text("4")
    first = _run(plan, path, data=f"{name}:rows")
    second = _run(plan, path, data=f"{name}:rows")
    assert second.cached and dataclasses.replace(second, cached=None) == first and len(cuts) == 1
    (tmp_path / "width.txt").write_text("5")  # the model takes 4 features: the full checks say so
    with pytest.raises(PdtoolError, match="does not fit the model"):
        _run(plan, path, data=f"{name}:rows")
    assert len(cuts) == 2


def test_an_edited_model_file_other_data_or_another_folder_capture_again(folder, cuts, tmp_path_factory):
    tmp_path, name = folder
    plan, path = _plan(tmp_path, name)
    _run(plan, path)
    source = tmp_path / f"{name}.py"
    source.write_text(FACTORY + "\n# edited\n")
    _run(plan, path)
    assert len(cuts) == 2
    _run(plan, path)
    assert len(cuts) == 2
    _run(plan, path, mode="gpipe")  # the mode is checked, not captured: still a hit
    assert len(cuts) == 2
    whole, whole_path = plan_with(tmp_path, [((0, 1), 1)], mode="flush", ref=ModelRef(f"{name}:make", {}),
                                  batch_size=2, name="whole.plan.json")
    assert len(_run(whole, whole_path).capture.stages) == 1  # another split of the same model
    assert len(cuts) == 3
    assert len(_run(plan, path).capture.stages) == 2 and len(cuts) == 3
    os.chdir(tmp_path_factory.mktemp("elsewhere"))
    _run(plan, path)
    assert len(cuts) == 4


def test_a_first_minibatch_of_other_shapes_captures_again():
    entry = capture_cache.Entry(capture="{}", batch=[[[[2, 4], "torch.float32"], [[2], "torch.int64"]], []],
                                modules=[], keywords=[], warnings=[], files={})
    assert entry.fits([[[[2, 4], "torch.float32"], [[2], "torch.int64"]], []])
    assert not entry.fits([[[[2, 5], "torch.float32"], [[2], "torch.int64"]], []])
    assert not entry.fits(None)
    moved = capture_cache.Entry(capture="{}", batch=[], modules=[], keywords=[], warnings=[],
                                files={"json": ["/elsewhere/json/__init__.py", 1, 1]})
    assert not moved.fits([])  # a module loaded now from another file than the capture's


def test_a_damaged_entry_is_a_miss_and_is_replaced(folder, cuts):
    tmp_path, name = folder
    plan, path = _plan(tmp_path, name)
    _run(plan, path)
    entry, = (tmp_path / "cache").glob("*.json")
    data = json.loads(entry.read_text())
    entry.write_text(json.dumps(dict(data, capture='{"stages": 3}')))
    _run(plan, path)
    assert len(cuts) == 2
    assert json.loads(entry.read_text())["capture"] == data["capture"]
    entry.write_text("{not json")
    _run(plan, path)
    assert len(cuts) == 3
    for damage in ({"files": {"x": 3}}, {"modules": [3]}, {"files": {"x": ["/nowhere", 1, 2]}}):
        entry.write_text(json.dumps(dict(data, **damage)))
        _run(plan, path)
    assert len(cuts) == 6


def test_the_cache_can_be_turned_off(folder, cuts, monkeypatch):
    tmp_path, name = folder
    monkeypatch.setenv(capture_cache.ENV, "off")
    plan, path = _plan(tmp_path, name)
    _run(plan, path)
    _run(plan, path)
    assert len(cuts) == 2 and not (tmp_path / "cache").exists()


def test_the_folder_keeps_the_newest_entries(tmp_path, monkeypatch):
    monkeypatch.setenv(capture_cache.ENV, str(tmp_path))
    monkeypatch.setattr(capture_cache, "KEEP", 3)
    for index in range(5):
        capture_cache.store(
            f"k{index}", capture_cache.Entry(capture="{}", batch=[], modules=[], keywords=[], warnings=[], files={})
        )
        os.utime(tmp_path / f"k{index}.json", (index, index))
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["k2.json", "k3.json", "k4.json"]
    assert capture_cache.lookup("k4") is not None and capture_cache.lookup("k0") is None


def test_reads_records_the_files_opened_for_reading_but_not_the_kernels(tmp_path):
    config = tmp_path / "config.json"
    config.write_text("{}")
    with capture_cache.Reads() as read:
        config.read_text()
        if os.path.exists("/proc/self/mountinfo"):
            open("/proc/self/mountinfo").close()  # a library asking about mounts: its times change always
        (tmp_path / "out.txt").write_text("x")  # written, not read
    assert read == {str(config)}
    open(config).close()  # after the block: nothing recorded
    assert read == {str(config)}
    files = capture_cache.loaded_files(read)
    assert files[f"<read>{config}"][0] == str(config)
    entry = capture_cache.Entry(capture="{}", batch=[], modules=[], keywords=[], warnings=[], files=files,
                                hashes=capture_cache.content_hashes(files))
    assert entry.unchanged() and str(config) in entry.hashes and os.__file__ not in entry.hashes
    stat = os.stat(config)
    config.write_text("[]")  # the same size, its time put back: the content tells
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert not entry.unchanged()


def test_files_of_the_python_installation_are_left_to_its_modules():
    with capture_cache.Reads() as read:
        open(os.__file__).close()  # the standard library: it changes with the installation, as its modules do
    assert read == set()


# ----- an entry is data (issue 35 items 1, 12 and 13) ------------------------------------------------

def _hit_then_plant(folder, **changes):
    """The plan run once (its entry stored), then `changes` applied to the entry's JSON."""
    tmp_path, name = folder
    plan, path = _plan(tmp_path, name)
    _run(plan, path)
    entry, = (tmp_path / "cache").glob("*.json")
    data = json.loads(entry.read_text())
    for key, change in changes.items():
        data[key] = change(data[key]) if callable(change) else change
    entry.write_text(json.dumps(data))
    return plan, path, entry


def _warned_run(plan, path):
    heard, said = [], []
    checked = preflight(
        plan, plan_path=str(path), mode="flush", data="synthetic", seed=0, imports=heard.append, warn=said.append
    )
    return checked, heard, said


def test_a_planted_program_node_is_a_miss_with_one_warning_and_runs_nothing(folder, cuts):
    planted = lambda capture: capture.replace("_operator:getitem", "posix:system")
    plan, path, entry = _hit_then_plant(folder, capture=planted)
    assert "posix:system" in entry.read_text()
    checked, heard, said = _warned_run(plan, path)
    assert len(cuts) == 2 and checked.cached is None  # captured again
    assert len(said) == 1 and "calls posix:system, which a program may not call" in said[0] and "\n" not in said[0]
    assert "posix" not in checked.capture.to_json()
    assert all("posix" not in modules for modules in heard)


def test_an_entry_naming_a_standard_library_module_is_a_miss_and_it_is_never_imported(folder, cuts):
    sys.modules.pop("this", None)
    plan, path, _ = _hit_then_plant(folder, modules=lambda modules: ["this", *modules])
    checked, heard, said = _warned_run(plan, path)
    assert len(cuts) == 2 and "this" not in sys.modules and all("this" not in m for m in heard)
    assert len(said) == 1 and "module 'this' of Python's standard library" in said[0]


def test_the_forkserver_hears_an_entrys_modules_only_after_consent(folder, cuts, monkeypatch):
    tmp_path, name = folder
    plan, path = _plan(tmp_path, name)
    _run(plan, path)
    order = []
    real = preflight_module.consent
    monkeypatch.setattr(preflight_module, "consent", lambda *a, **k: (order.append("consent"), real(*a, **k))[1])
    preflight(plan, plan_path=str(path), mode="flush", data="synthetic", seed=0,
              imports=lambda modules: order.append("imports"))
    assert order == ["consent", "imports"]
    monkeypatch.setattr(preflight_module, "consent", lambda *a, **k: (_ for _ in ()).throw(PdtoolError("refused")))
    told = []
    with pytest.raises(PdtoolError, match="refused"):
        preflight(plan, plan_path=str(path), mode="flush", data="synthetic", seed=0, imports=told.append)
    assert told == []


@pytest.mark.parametrize("whose", ["entry-group-writable", "folder-other-writable", "entry-other-owner",
                                   "folder-other-owner", "entry-link"])
def test_an_entry_or_folder_that_is_not_the_users_alone_is_a_miss_with_one_warning(folder, cuts, whose):
    tmp_path, name = folder
    plan, path = _plan(tmp_path, name)
    _run(plan, path)
    entry, = (tmp_path / "cache").glob("*.json")
    if whose == "entry-group-writable":
        os.chmod(entry, 0o660)
    elif whose == "folder-other-writable":
        os.chmod(tmp_path / "cache", 0o777)
    elif whose == "entry-link":
        os.rename(entry, tmp_path / "elsewhere.json")
        os.symlink(tmp_path / "elsewhere.json", entry)
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(entry if whose == "entry-other-owner" else tmp_path / "cache", os.geteuid() + 4242, -1)
    checked, _, said = _warned_run(plan, path)
    assert len(cuts) == 2 and checked.cached is None
    assert len(said) == 1 and "\n" not in said[0], said
    assert {"entry-group-writable": "writable by its group", "folder-other-writable": "writable by others",
            "entry-other-owner": "owned by user id", "folder-other-owner": "owned by user id",
            "entry-link": "symbolic link"}[whose] in said[0]


def test_a_new_entry_and_folder_are_the_users_alone(folder):
    tmp_path, name = folder
    plan, path = _plan(tmp_path, name)
    _run(plan, path)
    entry, = (tmp_path / "cache").glob("*.json")
    assert (os.stat(tmp_path / "cache").st_mode & 0o777) == 0o700 and (os.stat(entry).st_mode & 0o777) == 0o600


@pytest.mark.parametrize("damage", [{"capture": "[" * 100000 + "]" * 100000}, {"files": ["a", "b"]},
                                    {"hashes": [1]}, {"batch": "x"}, {"modules": ["a b"]}])
def test_a_damaged_entry_of_any_shape_is_a_miss_never_a_traceback(folder, cuts, damage):
    plan, path, _ = _hit_then_plant(folder, **damage)
    checked, _, _ = _warned_run(plan, path)
    assert len(cuts) == 2 and checked.cached is None


def test_deeply_nested_entry_json_is_a_miss(folder, cuts):
    tmp_path, name = folder
    plan, path = _plan(tmp_path, name)
    _run(plan, path)
    entry, = (tmp_path / "cache").glob("*.json")
    entry.write_text("[" * 100000 + "]" * 100000)  # RecursionError in json
    checked, _, _ = _warned_run(plan, path)
    assert len(cuts) == 2 and checked.cached is None


def test_a_model_file_edited_to_other_shapes_with_its_time_put_back_is_checked_again(folder, cuts):
    """Issue 35 item 13: the entry's content hash of the experiment's files sees the edit, so the plan's
    fingerprint check runs and refuses the model whose shapes are no longer the plan's."""
    tmp_path, name = folder
    plan, path = _plan(tmp_path, name)
    _run(plan, path)
    source = tmp_path / f"{name}.py"
    stat = os.stat(source)
    source.write_text(FACTORY.replace("width: int = 6", "width: int = 7"))  # the same size
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(source).st_size == stat.st_size
    sys.modules.pop(name, None)
    # Python's own bytecode check (the source's mtime and size) misses such an edit too: where Python writes
    # bytecode, the old module's would be imported again (and checked as the plan's); this is the cache's check
    shutil.rmtree(tmp_path / "__pycache__", ignore_errors=True)
    with pytest.raises(PdtoolError, match="fingerprint|shape|not the plan"):
        _run(plan, path)
