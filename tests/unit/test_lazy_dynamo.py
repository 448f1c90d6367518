"""`pdtool.lazy_dynamo`: a worker does everything eager torch does in a training step
without importing torch._dynamo (2.7 s of a core), and anything that needs dynamo gets the real
one. Run in a fresh interpreter: the stand-in must be installed before anything imports dynamo."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a fresh Python process importing torch: seconds

STEP = textwrap.dedent("""
    import json, os, sys
    from pdtool import lazy_dynamo
    import torch
    lazy_dynamo.install()
    import torch._dynamo  # what torch.optim's step wrapper does: the stand-in answers
    import torch.distributed as dist
    from torch import nn

    seen = {}
    def real():
        return type(sys.modules["torch._dynamo"]).__name__ != "_Standin"

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    reference = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    reference.load_state_dict(model.state_dict())
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # clears dynamo's trace rules' caches
    x = torch.randn(8, 4)
    for net in (model,):
        for opt in (torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                    torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)):
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
            for _ in range(2):
                opt.zero_grad()
                net(x).square().mean().backward()
                for p in net.parameters():
                    dist.all_reduce(p.grad)
                nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                sched.step()
            opt.load_state_dict(opt.state_dict())
    seen["after_steps"] = real()  # the same steps with the real dynamo follow, for the values
    disabled = torch._disable_dynamo(lambda t: t + 1)
    seen["disabled_before"] = disabled(torch.ones(1)).tolist()
    # a submodule first: Python reads the stand-in's __path__ (the real package is imported, and the
    # submodule with it), then finds the submodule: it must be the one the real package imported
    from torch._dynamo.exc import Unsupported
    seen["one_copy"] = Unsupported is sys.modules["torch._dynamo.symbolic_convert"].Unsupported
    seen["torch_attribute_is_real"] = torch._dynamo is sys.modules["torch._dynamo"] and real()
    from torch._dynamo import config  # the real module answers everything now
    seen["disabled_after"] = disabled(torch.ones(1)).tolist()
    seen["compiled"] = torch.compile(lambda t: t * 2, backend="eager")(torch.ones(2)).tolist()
    for opt in (torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9),
                torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)):
        for _ in range(2):
            opt.zero_grad()
            reference(x).square().mean().backward()
            nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            opt.step()
    seen["equal"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    dist.destroy_process_group()
    print(json.dumps(seen))
""")


def test_a_training_step_runs_without_dynamo_and_anything_else_gets_the_real_one():
    done = subprocess.run([sys.executable, "-c", STEP], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"after_steps": False, "disabled_before": [2.0], "one_copy": True, "torch_attribute_is_real": True,
                    "disabled_after": [2.0], "compiled": [2.0, 2.0], "equal": True}


FORKSERVER = textwrap.dedent("""
    import multiprocessing, os, sys
    from pdtool import lazy_dynamo
    from pdtool.runtime.launcher import forked

    if sys.argv[1] == "pd":  # pd's own process (`cli.main`) runs with the stand-in
        lazy_dynamo.install()
    forked.start_early("cpu", 1)
    forked.tell(())
    worker = multiprocessing.get_context("forkserver").Process(target=exec, args=(
        "import sys; print(type(sys.modules['torch._dynamo']).__name__, 'sympy' in sys.modules, flush=True)",))
    worker.start()
    worker.join(60)
""")


@pytest.mark.parametrize("launcher, dynamo", [("pd", "_Standin"), ("library", "module")])
def test_a_forkserver_for_pds_one_launch_has_the_stand_in_and_one_for_many_the_real_one(launcher, dynamo):
    """`pd train` launches once: its workers' forkserver keeps dynamo out. A process that launches
    many times (the test suite, a bench) keeps the real one in its forkserver, imported once, for the
    workers that need it (a worker that captures its stage itself traces with fake tensors)."""
    done = subprocess.run([sys.executable, "-c", FORKSERVER, launcher], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [dynamo, "True"]  # sympy: a stage built from meta tensors needs it (preloaded)


def _pd_says_dynamo(tmp_path, *argv: str) -> str:
    """`pd argv...` in a fresh process (no capture cache); what torch._dynamo was at its end."""
    code = ("import atexit, sys; from pdtool.cli import main; "
            "atexit.register(lambda: print('dynamo:', type(sys.modules.get('torch._dynamo')).__name__)); "
            f"sys.argv = ['pd', *{list(argv)!r}]; main()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PDTOOL_CACHE_DIR": "off"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split("dynamo: ")[-1].strip()


def test_pd_profile_and_pd_trains_checks_of_a_traceable_model_never_import_dynamo(tmp_path):
    """`pd` installs the stand-in first thing; timing an optimizer step does not need the real one,
    nor do the launcher's checks, whose fake tensors read dynamo's settings (`torch._dynamo.config`,
    loaded alone) and are made without a name from dynamo (`model.dryrun._fake`): 1.3 s of a core."""
    assert _pd_says_dynamo(tmp_path, "profile", "-m", "pdtool.zoo:mlp", "-a", "hidden=16", "-a", "depth=2", "-b", "4",
                           "--repeats", "1", "-q", "-o", "p.json") == "_Standin"
    subprocess.run([str(Path(sys.executable).parent / "pd"), "plan", "p.json", "--cluster", "2x10GB/s", "--straight",
                    "--cost-model", "pipedream", "-o", "p.plan.json"], cwd=tmp_path, check=True, capture_output=True)
    assert _pd_says_dynamo(tmp_path, "train", "p.plan.json", "--steps", "1", "--quiet") == "_Standin"
