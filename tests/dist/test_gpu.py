"""The runtime on GPUs (TF32 off: torch's default for matmuls) with NCCL, one GPU per worker (skipped on machines with fewer than 3 GPUs):
the same oracles as on the CPU, with looser tolerances for GPU arithmetic."""
import pytest
import torch

from helpers import assert_same_run, config_for, gradient_accumulation, merged, plan_with, reference

from pdtool.runtime.launch import launch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 CUDA GPUs (one per worker, NCCL)")


def test_flush_on_gpus_equals_gradient_accumulation(tmp_path):
    plan, path = plan_with(tmp_path, [((0, 1), 2), ((2, 3), 1)], mode="flush")
    config = config_for(path, steps=3, group=4, device="cuda")
    losses, weights = merged(launch(config, 3))
    expected_losses, expected_weights = gradient_accumulation(plan, config_for(path, steps=3, group=4))
    assert_same_run(losses, weights, expected_losses, expected_weights, rel=1e-4, weight_tolerance=1e-4)


@pytest.mark.parametrize("mode", ["pipedream", "2bw"])
def test_asynchronous_modes_on_gpus_equal_the_reference_executor(tmp_path, mode):
    plan, path = plan_with(tmp_path, [((0, 0), 1), ((1, 2), 1), ((3, 3), 1)], mode=mode)
    config = config_for(path, steps=4, device="cuda")
    losses, weights = merged(launch(config, 3))
    run = reference(plan, config_for(path, steps=4))
    assert_same_run(losses, weights, run.losses, run.weights, rel=1e-4, weight_tolerance=1e-4)
