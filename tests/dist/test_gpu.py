"""The runtime on GPUs with NCCL, one GPU per worker: the same oracles as on the CPU, with looser
tolerances for GPU arithmetic (TF32 is off for matmuls, torch's default). NCCL cannot put two ranks
of one job on one GPU, so the pipeline tests need 3 GPUs; one GPU runs a one-stage plan (device
placement, data, optimizer and checkpoints on the GPU, NCCL without point-to-point)."""
import pytest
import torch

from helpers import assert_same_run, config_for, gradient_accumulation, merged, plan_with, reference

from pdtool.runtime.launcher.launch import launch

three_gpus = pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 CUDA GPUs (one per worker, NCCL)")
one_gpu = pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")


@one_gpu
def test_one_stage_on_a_gpu_equals_gradient_accumulation_and_checkpoints(tmp_path):
    from pdtool.artifacts.checkpoint import latest_complete, load_checkpoint
    from pdtool.runtime.launcher.session import run

    plan, path = plan_with(tmp_path, [((0, 3), 1)], mode="flush")
    config = config_for(path, steps=3, group=2, device="cuda", checkpoint_dir=str(tmp_path / "ckpt"))
    result = run(config)
    losses, weights = merged(result.reports)
    expected_losses, expected_weights = gradient_accumulation(plan, config_for(path, steps=3, group=2))
    assert_same_run(losses, weights, expected_losses, expected_weights, rel=1e-4, weight_tolerance=1e-4)
    _, saved, _ = load_checkpoint(latest_complete(tmp_path / "ckpt"))
    assert all(t.device.type == "cpu" for t in saved.values())
    resumed = run(config_for(path, steps=4, group=2, device="cuda", checkpoint_dir=str(tmp_path / "ckpt")), resume=True)
    assert resumed.first_step == 3 and sorted(resumed.losses) == [6, 7]


@three_gpus
def test_flush_on_gpus_equals_gradient_accumulation(tmp_path):
    plan, path = plan_with(tmp_path, [((0, 1), 2), ((2, 3), 1)], mode="flush")
    config = config_for(path, steps=3, group=4, device="cuda")
    losses, weights = merged(launch(config, 3))
    expected_losses, expected_weights = gradient_accumulation(plan, config_for(path, steps=3, group=4))
    assert_same_run(losses, weights, expected_losses, expected_weights, rel=1e-4, weight_tolerance=1e-4)


@three_gpus
@pytest.mark.parametrize("mode", ["pipedream", "2bw"])
def test_asynchronous_modes_on_gpus_equal_the_reference_executor(tmp_path, mode):
    plan, path = plan_with(tmp_path, [((0, 0), 1), ((1, 2), 1), ((3, 3), 1)], mode=mode)
    config = config_for(path, steps=4, device="cuda")
    losses, weights = merged(launch(config, 3))
    run = reference(plan, config_for(path, steps=4))
    assert_same_run(losses, weights, run.losses, run.weights, rel=1e-4, weight_tolerance=1e-4)
