"""Shared test set-up: the tests folder is importable, so model specs like `toymodels:dynamic` work;
every test of tests/dist (and every module that says `pytestmark = pytest.mark.workers`) carries
the `workers` marker: it starts worker processes (`make test-fast` leaves those out). See
tests/README.md for the tiers."""
import atexit
import os
import shutil
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

# pd train keeps its captures between runs (runtime.launcher.capture_cache): the tests share a folder of
# their own (one per test process), never the user's
_CACHE = tempfile.mkdtemp(prefix="pdtool-test-captures-")
os.environ["PDTOOL_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)
# the benches the tests run write no result file into bench/results/ (bench/record.py)
os.environ["PDTOOL_BENCH_RESULTS"] = "off"

# pytest keeps the test modules it rewrote for its assertion messages in __pycache__, unless Python
# writes no bytecode (PYTHONDONTWRITEBYTECODE): then every test process rewrote all of them again,
# about 7 s of a core each (`make test` starts four). Kept while the tests are collected.
_WRITE_BYTECODE = sys.dont_write_bytecode
sys.dont_write_bytecode = False


def pytest_collection_finish(session):
    sys.dont_write_bytecode = _WRITE_BYTECODE


def pytest_collection_modifyitems(config, items):
    dist = os.path.join(HERE, "dist") + os.sep
    for item in items:
        if str(item.fspath).startswith(dist):
            item.add_marker(pytest.mark.workers)

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs as many test processes as cores: one thread each,
    import torch                           # as pd train gives its workers (torch's default: every core each)

    torch.set_num_threads(1)
