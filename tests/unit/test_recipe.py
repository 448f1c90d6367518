"""The recipe's parts on their own: the learning-rate schedule, the checks of the options, the
weight-decay groups and the optimizer factory (no worker processes)."""
import math

import pytest
import torch
from click.testing import CliRunner

from pdtool.cli import cli
from pdtool.errors import LaunchError
from pdtool.runtime.recipe import LrSchedule, OptimizerConfig
from pdtool.runtime.optimizers import build_optimizer, check_optimizer, no_decay
from pdtool.runtime.worker.optim import clip, squared_norm


def test_warm_up_then_cosine_or_linear_decay_to_the_floor():
    cosine = LrSchedule("cosine", warmup_steps=4, min_lr=0.1, total_steps=14)
    assert [cosine.lr(1.0, t) for t in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert cosine.lr(1.0, 4) == pytest.approx(1.0)
    assert cosine.lr(1.0, 9) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert cosine.lr(1.0, 14) == pytest.approx(0.1) and cosine.lr(1.0, 99) == pytest.approx(0.1)
    linear = LrSchedule("linear", min_lr=0.0, total_steps=10)
    assert [linear.lr(2.0, t) for t in (0, 5, 10)] == pytest.approx([2.0, 1.0, 0.0])
    assert LrSchedule().lr(0.3, 1000) == 0.3
    # fractional clocks (a stage that steps every other step of stage 0) lie on the same curve
    assert cosine.lr(1.0, 6.5) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))


@pytest.mark.parametrize("recipe, line", [
    (OptimizerConfig(name="adam", momentum=0.9), "--momentum: adam has none; use --betas"),
    (OptimizerConfig(name="sgd", betas=(0.9, 0.99)), "--betas is for adam and adamw, not sgd; use --momentum"),
    (OptimizerConfig(name="sgd", eps=1e-6), "--eps is for adam and adamw"),
    (OptimizerConfig(name="adamx"), "--optimizer 'adamx': use sgd, adam, adamw or a pkg.module:factory"),
    (OptimizerConfig(name="sgd", lr=0.1, schedule=LrSchedule("cosine", min_lr=0.5)), "--min-lr 0.5 is above --lr 0.1"),
    (OptimizerConfig(name="sgd", schedule=LrSchedule("constant", min_lr=0.001)), "--min-lr needs --lr-schedule"),
    (OptimizerConfig(name="torch.optim:RMSprop", momentum=0.5), "--momentum: the factory sets its own"),
])
def test_options_that_do_not_fit_the_optimizer_are_one_line(recipe, line):
    assert line in recipe.problem()


def test_pd_train_refuses_them_before_reading_the_plan(tmp_path):
    result = CliRunner().invoke(cli, ["train", str(tmp_path / "none.plan.json"), "--optimizer", "adamw",
                                      "--momentum", "0.9"])
    assert result.exit_code == 2 and "--momentum: adamw has none; use --betas" in result.output
    assert "Traceback" not in result.output


def test_no_weight_decay_on_biases_norms_and_embeddings():
    from pdtool.zoo import gpt

    with torch.device("meta"):
        bundle = gpt(vocab=50, seq_len=8, d_model=16, heads=2, layers=1)
    skipped = no_decay(bundle.module)
    names = dict(bundle.module.named_parameters())
    assert "pos_emb" in skipped and "tok_emb.weight" in skipped  # a bare position embedding and nn.Embedding
    assert all(n in skipped for n, p in names.items() if p.dim() < 2)  # biases, LayerNorm scales and shifts
    decayed = sorted(set(names) - skipped)
    assert decayed and all(names[n].dim() == 2 and ".ln" not in n for n in decayed)


def test_the_groups_decay_only_what_the_rule_keeps():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    optimizer = build_optimizer(OptimizerConfig(name="adamw", lr=0.1, weight_decay=0.5), list(model.named_parameters()),
                                skip=no_decay(model))
    assert isinstance(optimizer, torch.optim.AdamW)
    decay, plain = optimizer.param_groups
    assert decay["weight_decay"] == 0.5 and [p.shape for p in decay["params"]] == [torch.Size([2, 3])]
    assert plain["weight_decay"] == 0.0 and len(plain["params"]) == 4


def test_an_optimizer_factory_named_on_the_command_line_is_called_with_the_groups():
    optimizer = build_optimizer(OptimizerConfig(name="torch.optim:RMSprop", lr=0.01, weight_decay=0.1),
                                [("w", torch.nn.Parameter(torch.ones(2, 2))), ("b", torch.nn.Parameter(torch.ones(2)))],
                                skip=frozenset({"b"}))
    assert isinstance(optimizer, torch.optim.RMSprop) and [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0]
    with pytest.raises(LaunchError, match="returned list, not a torch.optim.Optimizer"):
        check_optimizer(OptimizerConfig(name="toymodels:not_an_optimizer"))
    with pytest.raises(LaunchError, match=r"failed when called as factory\(param_groups, lr=0.01\): TypeError"):
        check_optimizer(OptimizerConfig(name="torch:zeros_like"))
    with pytest.raises(LaunchError, match="cannot import 'no_such_module'"):
        check_optimizer(OptimizerConfig(name="no_such_module:make"))


def test_clipping_scales_to_the_budget_like_torch():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    norm = math.sqrt(squared_norm(grads))
    assert norm == pytest.approx(5.0)
    clip(grads, 1.0, norm)
    mine = torch.cat([g.reshape(-1) for g in grads])
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1, 1))]
    params[0].grad, params[1].grad = torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    torch.testing.assert_close(mine, torch.cat([p.grad.reshape(-1) for p in params]))


def test_a_bf16_profile_counts_messages_in_bf16_and_plans_carry_it(tmp_path):
    from pdtool.artifacts.cluster import parse_cluster
    from pdtool.artifacts.profile import ModelRef
    from pdtool.planner import make_plan
    from pdtool.planner.costmodel import Memory
    from pdtool.profiler import profile_model

    ref = ModelRef("pdtool.zoo:mlp", {"in_features": 12, "hidden": 8, "depth": 3, "classes": 3})
    fp32, bf16 = (profile_model(ref, batch_size=4, repeats=1, warmup=0, precision=p) for p in ("fp32", "bf16"))
    assert bf16.precision == "bf16" and "precision" not in fp32.to_json()
    assert [layer.act_bytes * 2 for layer in bf16.layers] == [layer.act_bytes for layer in fp32.layers]
    assert [layer.param_bytes for layer in bf16.layers] == [layer.param_bytes for layer in fp32.layers]  # fp32 masters
    plan = make_plan(bf16, parse_cluster("2x1GB/s"), straight=True, simulate=False)
    assert plan.profile.precision == "bf16"
    terms = Memory(limit=float("inf"), optimizer_slots=1, copies=0.5).terms(1000, 10, in_flight=2)
    assert terms["compute copies"] == 1000  # a half-size copy of the weights for each of 2 minibatches in flight


def test_fp16_where_stages_step_on_their_own_is_refused_before_any_worker(tmp_path):
    import dataclasses

    from pdtool.artifacts.cluster import parse_cluster
    from pdtool.artifacts.profile import ModelRef
    from pdtool.planner import make_plan
    from pdtool.profiler import profile_model
    from pdtool.runtime.launcher.job import prepare
    from pdtool.runtime.run import RunConfig

    profile = profile_model(ModelRef("pdtool.zoo:mlp", {"in_features": 12, "hidden": 8, "depth": 3, "classes": 3}),
                            batch_size=4, repeats=1, warmup=0)
    plan = dataclasses.replace(make_plan(profile, parse_cluster("2x1GB/s"), straight=True, simulate=False),
                               mode="pipedream")
    path = tmp_path / "p.plan.json"
    plan.save(path)
    with pytest.raises(LaunchError, match="--precision fp16 skips a step .* mode pipedream .* use --precision bf16"):
        prepare(plan, RunConfig(plan_path=str(path), steps=2, precision="fp16"))


def test_pd_train_says_its_recipe_in_one_line():
    from types import SimpleNamespace

    from pdtool.runtime.run import RunConfig
    from pdtool.views.summary import recipe_line

    recipe = OptimizerConfig(name="adamw", lr=0.003, weight_decay=0.05, schedule=LrSchedule("cosine", 2, 0.0003),
                             clip_grad_norm=1.0)
    config = RunConfig(plan_path="p.plan.json", steps=10, optimizer=recipe, precision="fp16")
    plan = SimpleNamespace(profile=SimpleNamespace(precision="fp32"))
    head = SimpleNamespace(stage=0, replica=0, step_log=[(0.0, 0.001, 5.0, True, True), (1.0, 0.002, 1.0, True, False)])
    assert recipe_line(config, plan, SimpleNamespace(reports={0: head})) == (
        "adamw lr 0.003, weight decay 0.05, cosine, 2 warm-up steps, to 0.0003 at step 10, gradients clipped to norm 1, "
        "fp16, 1 step(s) skipped on overflow (loss scaling)")


def test_a_warm_up_longer_than_the_run_is_one_line_before_any_worker():
    """Issue 35 item 13: `--warmup-steps 100 --steps 4` trained at 1-4% of --lr all run, without a word."""
    import pytest

    from pdtool.errors import LaunchError
    from pdtool.runtime.launcher.job import check_warmup
    from pdtool.runtime.recipe import LrSchedule, OptimizerConfig
    from pdtool.runtime.run import RunConfig

    def config(warmup, steps, total=None, first=0):
        return RunConfig(plan_path="p.json", steps=steps, first_step=first,
                         optimizer=OptimizerConfig(name="sgd", lr=0.1, schedule=LrSchedule("constant", warmup, 0.0, total)))

    with pytest.raises(LaunchError, match=r"--warmup-steps 100 is longer than the run's 4 step\(s\): the learning rate "
                                          r"would rise to only 4% of --lr") as info:
        check_warmup(config(100, 4))
    assert "\n" not in str(info.value)
    check_warmup(config(4, 4))            # the whole run warming up: the last step at --lr
    check_warmup(config(3, 2, total=5))   # a horizon given beyond the run (a run resumed later continues it)
    check_warmup(config(10, 4, first=8))  # a resumed run: its horizon counts the steps before it


def test_an_optimizer_factory_that_ignores_its_parameter_groups_is_refused():
    """Issue 35 item 13: such a factory trained nothing, rc 0."""
    import pytest

    from pdtool.errors import LaunchError
    from pdtool.runtime.recipe import OptimizerConfig
    from pdtool.runtime.optimizers import check_optimizer

    with pytest.raises(LaunchError, match="does not hold 1 of the 1 parameters it was given") as info:
        check_optimizer(OptimizerConfig(name="toymodels:ignores_its_groups"))
    assert "\n" not in str(info.value)
    check_optimizer(OptimizerConfig(name="torch.optim:RMSprop"))
