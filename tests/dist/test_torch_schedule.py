"""A schedule pdtool writes (`pd simulate --write-schedule`) runs in torch.distributed.pipelining's
own `_PipelineScheduleRuntime` on gloo and trains what pdtool trains (issue 39 item 2)."""
import os

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from helpers import MLP, SGD, config_for, gradient_accumulation, plan_with, torch_ranks

from pdtool.artifacts.plan import Plan
from pdtool.cli import cli
from pdtool.model.build import initial_model
from pdtool.model.data import synthetic_source
from pdtool.model.stages import PositionalStage, plan_stages
from pdtool.runtime.optimizers import build_optimizer

pytestmark = pytest.mark.workers

STEPS, GROUP = 2, 4


def _torch_worker(rank: int, world: int, port: int, plan_path: str, csv_path: str, results) -> None:
    """One rank of torch's runtime running the CSV: the weights of its stage, by the model's names."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    plan = Plan.load(plan_path)
    bundle = initial_model(MLP, 0)
    stage = plan_stages(plan, bundle.module)[rank]
    module = PositionalStage(stage, rank == world - 1)
    schedule = _PipelineScheduleRuntime([PipelineStage(module, rank, world, torch.device("cpu"))],
                                        n_microbatches=GROUP, loss_fn=bundle.loss_fn)
    schedule._load_csv(csv_path)
    named = [(stage.param_names[n], p) for n, p in stage.module.named_parameters()]
    optimizer = build_optimizer(SGD, named)
    batch = synthetic_source(bundle, plan.profile.batch_size, 0).batch
    for step in range(STEPS):
        parts = [batch(step * GROUP + k) for k in range(GROUP)]
        inputs = tuple(torch.cat(t) for t in zip(*(p[0] for p in parts))) if rank == 0 else ()
        target = {"target": torch.cat([p[1] for p in parts])} if rank == world - 1 else {}
        schedule.step(*inputs, **target)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    results.put({name: p.detach().numpy().copy() for name, p in named})  # by value: this process ends next
    dist.destroy_process_group()


def test_a_schedule_pdtool_writes_trains_in_torchs_runtime_as_pdtool_trains(tmp_path):
    plan, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="zb")
    csv_path = tmp_path / "zb.csv"
    result = CliRunner().invoke(cli, ["simulate", str(path), "--group", str(GROUP), "--write-schedule", str(csv_path)])
    assert result.exit_code == 0, result.output
    assert "0I" in csv_path.read_text() and "1W" in csv_path.read_text()  # the split backward, torch's I and W
    trained = torch_ranks(_torch_worker, 2, str(path), str(csv_path))
    _, expected = gradient_accumulation(plan, config_for(path, steps=STEPS, group=GROUP))
    assert trained.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6)
