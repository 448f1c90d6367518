"""The pure core (artifacts, planner, schedules, simulator, pictures) imports no torch: it runs
where torch is not installed, and `pd plan`/`pd simulate`/`pd show` start fast."""
import subprocess
import sys

CORE = ["pdtool.errors", "pdtool.fields", "pdtool.jsonio", "pdtool.units",
        "pdtool.artifacts", "pdtool.artifacts.cluster", "pdtool.artifacts.profile", "pdtool.artifacts.plan",
        "pdtool.artifacts.pipedream", "pdtool.artifacts.schemas", "pdtool.artifacts.manifest",
        "pdtool.planner", "pdtool.planner.costmodel", "pdtool.planner.states", "pdtool.planner.partition",
        "pdtool.planner.make", "pdtool.schedule", "pdtool.schedule.core", "pdtool.schedule.generator",
        "pdtool.schedule.check", "pdtool.schedule.lower", "pdtool.schedule.modes", "pdtool.sim.simulate",
        "pdtool.sim.prediction", "pdtool.sim.steady", "pdtool.runtime.run", "pdtool.runtime.recipe", "pdtool.runtime.ties", "pdtool.views.metrics",
        "pdtool.artifacts.record", "pdtool.views", "pdtool.views.trace", "pdtool.views.render", "pdtool.views.show",
        "pdtool.consent", "pdtool.signals", "pdtool.runtime.launcher.cluster_env", "pdtool.runtime.launcher.folder_lock"]

BLOCK_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, NoTorch())
"""


def test_the_core_imports_without_torch():
    code = BLOCK_TORCH + "".join(f"import {module}\n" for module in CORE) + "print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
