"""A plan exported for torch.distributed.pipelining (`pd export-plan --to pipelining`, issue 39 item 1) trains
there as pd train trains it: a Llama written as torchtitan writes it (`pdtool.zoo:llama`: layers in a dict, a
forward that skips removed modules), split by the exported module names the way torchtitan splits it, run by
the schedule class the export names on gloo ranks from pdtool's initial weights, ends with pd train's weights."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from helpers import SGD, config_for, merged, torch_ranks

from pdtool.artifacts.profile import ModelRef
from pdtool.cli import cli
from pdtool.errors import PdtoolError
from pdtool.model.build import initial_model
from pdtool.model.data import synthetic_source
from pdtool.profiler import profile_model
from pdtool.runtime.launcher.launch import launch
from pdtool.runtime.optimizers import build_optimizer
from pdtool.targets.torch_stage import check_covered, stage_module

pytestmark = pytest.mark.workers

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "pipelining"))  # train_exported: the docs' example (docs/export-plan.md)

LLAMA = ModelRef("pdtool.zoo:llama", {"vocab": 64, "seq_len": 8, "dim": 16, "layers": 3, "heads": 2, "kv_heads": 1,
                                      "hidden": 32})
STEPS, GROUP = 2, 4


def _torch_rank(rank: int, world: int, port: int, exported: dict, folder: str, results) -> None:
    """One rank of torch.distributed.pipelining running the export: the weights of its stages by name."""
    from train_exported import pipeline  # here: torch.distributed.pipelining costs every test process 1 s to import

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    bundle = initial_model(LLAMA, 0)  # pd train's initial weights (the initialization rule, seed 0)
    schedule, modules = pipeline(exported, bundle.module, bundle.loss_fn, rank, folder)
    named = [(name, p) for module in modules for name, p in module.named_parameters()]
    optimizer = build_optimizer(SGD, named)
    batch = synthetic_source(bundle, exported["microbatch_size"], 0).batch
    indices = [s["index"] for s in exported["stages"] if s["rank"] == rank]
    for step in range(STEPS):
        parts = [batch(step * GROUP + k) for k in range(GROUP)]
        inputs = tuple(torch.cat(t) for t in zip(*(p[0] for p in parts))) if 0 in indices else ()
        target = {"target": torch.cat([p[1] for p in parts])} if len(exported["stages"]) - 1 in indices else {}
        schedule.step(*inputs, **target)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    results.put({name: p.detach().numpy().copy() for name, p in named})
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    profile = profile_model(LLAMA, batch_size=2, repeats=1, warmup=0, depth=2)
    path = folder / "llama.profile.json"
    profile.save(path)
    return folder, profile, path


@pytest.mark.parametrize("mode, workers", [("flush", 2), ("zbv", 2)])
def test_an_exported_plan_trains_in_torchs_pipelining_to_pd_trains_weights(profiled, mode, workers):
    folder, profile, profile_path = profiled
    assert [layer.name for layer in profile.layers] == ["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm",
                                                        "output"]
    args = ["--straight"] if mode == "flush" else ["--virtual-stages", "2"]
    plan_path = folder / f"{mode}.plan.json"
    runner = CliRunner()
    result = runner.invoke(cli, ["plan", str(profile_path), "--cluster", f"{workers}x1GB/s", "--mode", mode,
                                 "--group", str(GROUP), *args, "-o", str(plan_path)])
    assert result.exit_code == 0, result.output
    export_path = folder / f"{mode}.pp.json"
    result = runner.invoke(cli, ["export-plan", str(plan_path), "--to", "pipelining", "-o", str(export_path)])
    assert result.exit_code == 0, result.output
    exported = json.loads(export_path.read_text())
    assert exported["schedule"] == {"flush": "1F1B", "zbv": "ZBVZeroBubble"}[mode]
    assert exported["n_microbatches"] == GROUP and len(exported["stages"]) == (2 if mode == "flush" else 4)

    _, expected = merged(launch(config_for(plan_path, steps=STEPS, group=GROUP), workers))

    trained = torch_ranks(_torch_rank, workers, exported, str(folder))
    assert trained.keys() == expected.keys()
    for name, value in expected.items():  # torch's order of summing microbatch gradients is its own
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6)


def test_a_name_the_model_does_not_have_is_one_line():
    bundle = initial_model(LLAMA, 0)
    with pytest.raises(PdtoolError, match=r"module 'layers\.7' of the export is not in the model Transformer") as caught:
        stage_module(bundle.module, ["layers.0", "layers.7"])
    assert "\n" not in str(caught.value)
    kept = stage_module(initial_model(LLAMA, 0).module, ["layers.1", "norm"])
    assert kept.tok_embeddings is None and kept.output is None and list(kept.layers) == ["1"]
    with pytest.raises(PdtoolError, match="module 'norm' of the model Transformer is in no stage of the export"):
        check_covered(bundle.module, [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "output"]])
