"""Shared set-up for the distributed tests: small plans with chosen splits, and oracles."""
import dataclasses
import functools
import json

import torch

from pdtool.artifacts.cluster import parse_cluster
from pdtool.artifacts.plan import with_boundaries
from pdtool.model.build import initial_model
from pdtool.planner import make_plan, shared_parameters
from pdtool.artifacts.profile import ModelRef
from pdtool.profiler import profile_model
from pdtool.runtime.optimizers import build_optimizer, no_decay
from pdtool.model.stages import plan_stages, sample_inputs
from pdtool.model.data import load_source, synthetic_source
from pdtool.runtime.run import OptimizerConfig, RunConfig, make_schedule

from reference_executor import run_reference

MLP = ModelRef("pdtool.zoo:mlp", {"in_features": 12, "hidden": 8, "depth": 3, "classes": 3})
SGD = OptimizerConfig(name="sgd", lr=0.05, momentum=0.9, weight_decay=0.0)


def profiled(ref, batch_size):
    """`ref` profiled once (1 repeat) per test process: the plans of the tests split its layers,
    whose times they do not read (a Profile is frozen). Capturing a transformers model takes a
    second or two; the MLP is profiled by a hundred tests."""
    return _profiled(ref.spec, json.dumps(ref.kwargs, sort_keys=True), batch_size)


@functools.lru_cache(maxsize=None)
def _profiled(spec, kwargs, batch_size):
    return profile_model(ModelRef(spec, json.loads(kwargs)), batch_size=batch_size, repeats=1, warmup=0)


def plan_with(tmp_path, split, mode="pipedream", ref=MLP, batch_size=4, name="p.plan.json"):
    """A plan of `ref` whose stages are `split`: [((first, last), replicas), ...]; saved in tmp_path."""
    profile = profiled(ref, batch_size)
    workers = sum(r for _, r in split)
    plan = make_plan(profile, parse_cluster(f"{workers}x1GB/s"), simulate=False)
    template = plan.stages[0]
    stages, rank = [], 0
    for (first, last), replicas in split:
        stages.append(dataclasses.replace(template, layers=tuple(range(first, last + 1)),
                                          first_name=profile.layers[first].name, last_name=profile.layers[last].name,
                                          ranks=tuple(range(rank, rank + replicas))))
        rank += replicas
    stages = with_boundaries(profile, stages)
    plan = dataclasses.replace(plan, stages=stages, groups=(), mode=mode,
                               shared=shared_parameters(profile, stages))
    path = tmp_path / name
    plan.save(path)
    return plan, path


def reference(plan, config, ref=MLP):
    """The reference executor's run of the same plan and schedule (resumed like the runtime
    when config.resume names a checkpoint: its weights and optimizer state, minibatches from
    config.first_step on)."""
    from pdtool.runtime.worker.shards import restore
    from pdtool.runtime.run import minibatches_per_step

    bundle = initial_model(ref, config.seed)
    stages = plan_stages(plan, bundle.module, sample_inputs(bundle, plan))
    schedule = make_schedule(plan, config)
    source = synthetic_source(bundle, plan.profile.batch_size, config.seed)
    first = config.first_step * minibatches_per_step(schedule)
    prepare = (lambda worker: restore(worker, config.resume)) if config.resume else None
    run = run_reference(stages, schedule, config.recipe, bundle.loss_fn, lambda b: source.batch(first + b), prepare,
                        config.seed, first, no_decay(bundle.module), sum(p.numel() for p in bundle.module.parameters()),
                        config.precision or "fp32", tuple(s.recompute for s in plan.stages))
    run.losses = {first + b: loss for b, loss in run.losses.items()}
    return run


def gradient_accumulation(plan, config, ref=MLP, skipped=None):
    """One process, no pipeline: per step, the mean gradient of `group` microbatches, then the
    recipe (torch's clip_grad_norm_, the schedule's learning rate for the step, the optimizer),
    in `config.precision` with torch's own autocast (and GradScaler in fp16: the steps it skips are
    appended to the list `skipped`)."""
    schedule = make_schedule(plan, config)
    recipe = config.recipe
    precision = config.precision or "fp32"
    scaler = torch.amp.GradScaler("cpu", init_scale=recipe.initial_loss_scale) if precision == "fp16" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    bundle = initial_model(ref, config.seed)
    net = bundle.module
    optimizer = build_optimizer(recipe, list(net.named_parameters()), 1.0, no_decay(net))
    base = [g["lr"] for g in optimizer.param_groups]
    batch = load_source(config.data, bundle, plan.profile.batch_size, config.seed).batch
    losses = {}
    for step in range(config.steps):
        optimizer.zero_grad()
        for k in range(schedule.group):
            b = step * schedule.group + k
            inputs, target = batch(b)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                # keyword inputs (a sample that is a dict) by keyword, as the user's own loop calls the model
                output = net(**dict(zip(bundle.keywords, inputs))) if bundle.keywords else net(*inputs)
                loss = bundle.loss_fn(output, target)
            losses[b] = float(loss.detach())
            (loss / schedule.group if scaler is None else scaler.scale(loss / schedule.group)).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        if recipe.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), recipe.clip_grad_norm)
        for group, lr in zip(optimizer.param_groups, base):
            group["lr"] = lr * recipe.schedule.factor(recipe.lr, step)
        if scaler is None:
            optimizer.step()
            continue
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if skipped is not None and scaler.get_scale() < scale:
            skipped.append(step)
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}


def config_for(path, **overrides):
    values = dict(plan_path=str(path), steps=3, seed=0, optimizer=SGD, return_weights=True, timeout_s=30.0,
                  progress=False, device="cpu")  # exact oracles on the CPU, also on GPU machines (test_gpu.py)
    values.update(overrides)
    return RunConfig(**values)


def assert_same_run(losses, weights, expected_losses, expected_weights, rel=1e-6, weight_tolerance=None):
    """Losses equal (to `rel`) and every expected weight equal (`assert_close`, to `weight_tolerance`
    relative and absolute when given, else torch's defaults for the dtype)."""
    import pytest

    assert losses == pytest.approx(expected_losses, rel=rel)
    for name, expected in expected_weights.items():
        tolerance = {} if weight_tolerance is None else {"rtol": weight_tolerance, "atol": weight_tolerance}
        torch.testing.assert_close(weights[name], expected, **tolerance)


def merged(reports):
    """The losses of a launch's reports, and the weights of every stage's first replica."""
    losses, weights = {}, {}
    for report in reports.values():
        losses.update(report.losses)
        if report.replica == 0:
            weights.update(report.weights)
    return losses, weights


def torch_ranks(target, world, *args):
    """Run `target(rank, world, port, *args, results)` as `world` gloo ranks (forkserver processes, the
    suite's, with torch imported already); the merged {name: tensor} each rank put in `results`."""
    import multiprocessing
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("forkserver")
    results = context.Queue()
    ranks = [context.Process(target=target, args=(rank, world, port, *args, results)) for rank in range(world)]
    for rank in ranks:
        rank.start()
    trained = {}
    for _ in ranks:
        trained.update({name: torch.from_numpy(value) for name, value in results.get(timeout=120).items()})
    for rank in ranks:
        rank.join(timeout=60)
        assert rank.exitcode == 0
    return trained
