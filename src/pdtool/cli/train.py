"""`pd train`: a plan on torch.distributed workers (or one worker under torchrun/srun)."""
from __future__ import annotations

import os

import click

from ..artifacts.plan import SHARDS
from ..artifacts.profile import PRECISIONS
from ..errors import PdtoolError
from ..jsonio import check_writable
from ..runtime.launcher.cluster_env import LAUNCHERS, detect, place
from ..runtime.recipe import LR_SCHEDULES, OPTIMIZERS
from ..runtime.run import DEVICES, INITS, TRANSPORTS
from ..schedule.modes import MODES
from .settings import GroupedCommand, settings
from .group import MAX_STEPS, MAX_THREADS, PER_GROUP, PER_ROUND, Count, Finite, _examples, cli


GROUPS = {
    "run": ("steps", "epochs", "model_spec", "data", "mode", "group", "shard", "seed", "init", "init_from", "evaluate",
            "eval_every"),
    "recipe": ("optimizer", "lr", "momentum", "betas", "eps", "weight_decay", "lr_schedule", "warmup_steps", "min_lr",
               "lr_decay_steps", "precision", "clip_grad_norm"),
    "checkpoints": ("checkpoint_dir", "checkpoint_every", "resume", "max_restarts"),
    "launch": ("launcher", "nnodes", "node_rank", "nproc_per_node", "master_addr", "master_port", "rdzv_endpoint",
               "rdzv_id", "iface", "timeout_s", "startup_timeout_s"),
    "devices": ("device", "transport", "threads"),
    "outputs": ("metrics_path", "tensorboard_dir", "trace_path", "verbose", "quiet"),
}
"""pd train's options by group: the headings of its --help and the tables of a --config file."""


@cli.command(cls=GroupedCommand, groups=GROUPS, short_help="run a plan on torch.distributed workers",
             epilog=_examples("pd train mlp.plan.json --data digits --epochs 10 --lr 0.1 --momentum 0.5 --evaluate",
                                "pd train gpt.plan.json --optimizer adamw --lr 3e-4 --weight-decay 0.1 --lr-schedule cosine "
                                "--warmup-steps 100 --clip-grad-norm 1.0 --precision bf16 --metrics m.csv",
                                "pd train resnet.plan.json --steps 200 --checkpoint-dir ckpt --checkpoint-every 50 --metrics m.csv --trace t.json",
                                "pd train resnet.plan.json --steps 400 --checkpoint-dir ckpt --resume",
                                "pd train gpt.plan.json --config run.toml --steps 50"))
@click.argument("plan_path", metavar="PLAN.json", type=click.Path(dir_okay=False))
@click.option("--steps", type=Count(1, MAX_STEPS), default=20, show_default=True,
              help=f"Train until stage 0 has taken this many optimizer steps ({PER_ROUND}: one per round of its "
                   f"replicas' minibatches; {PER_GROUP}: one per group of microbatches).")
@click.option("--epochs", type=Count(1, 10**6), help="Instead of --steps: passes over the data set.")
@click.option("--model", "-m", "model_spec", metavar="PKG.MODULE:FACTORY",
              help="Build the model with this factory instead of the one the plan names (called with the plan's "
                   "kwargs; it must build the same model). Naming it here trusts it: see docs/security.md.")
@click.option("--data", default="synthetic", show_default=True, metavar="SOURCE",
              help="synthetic (the model factory's batches), digits (the UCI handwritten digits shipped with "
                   "pdtool), or PKG.MODULE:FACTORY returning a torch Dataset of (input, target) items.")
@click.option("--mode", type=click.Choice(MODES),
              help="Schedule mode [default: the plan's].")
@click.option("--group", "-g", type=Count(1, 65536),
              help=f"{PER_GROUP}: microbatches per optimizer step [default: the plan's group (pd plan --group or "
                   "--batch), else the number of stages, or more].")
@click.option("--shard", type=click.Choice(SHARDS),
              help="What the replicas of each replicated stage shard among themselves: none, optimizer (each "
                   "keeps the optimizer state of 1/replicas of the stage and all-gathers the updated weights: ZeRO "
                   "stage 1), gradients (also 1/replicas of the summed gradients, reduced after every backward: "
                   "ZeRO stage 2), or parameters (also 1/replicas of the weights, gathered layer by layer for each "
                   "forward and backward: ZeRO stage 3, FSDP2; modes that keep one weight version) [default: the "
                   "plan's, per stage (pd plan --shard)].")
@click.option("--seed", type=Count(0, 2**63 - 1), default=0, show_default=True, help="Seed of the initial weights and the data order.")
@click.option("--optimizer", default="sgd", show_default=True, metavar="|".join(OPTIMIZERS) + "|PKG.MODULE:FACTORY",
              help="sgd (with momentum), adam, adamw (decoupled weight decay), or a factory called as "
                   "factory(param_groups, lr=LR) that returns a torch optimizer (naming it here trusts it).")
@click.option("--lr", type=Finite(0, 1e6, min_open=True), default=0.01, show_default=True,
              help=f"Peak learning rate (a replicated stage in {PER_ROUND} uses lr * r_s / r_0, see docs/train.md).")
@click.option("--momentum", type=Finite(0, 1, max_open=True), help="SGD momentum [default: 0.9].")
@click.option("--betas", type=(Finite(0, 1, max_open=True), Finite(0, 1, max_open=True)), default=None,
              metavar="B1 B2", help="adam, adamw: the moments' decay rates [default: 0.9 0.999].")
@click.option("--eps", type=Finite(0, 1, min_open=True), help="adam, adamw: added to the denominator [default: 1e-8].")
@click.option("--weight-decay", type=Finite(0, 1e6), default=0.0, show_default=True,
              help="Weight decay of every parameter but biases, norms and embeddings (see docs/train.md).")
@click.option("--lr-schedule", type=click.Choice(LR_SCHEDULES), default="constant", show_default=True,
              help="After the warm-up: keep --lr, or decay it linearly or along a cosine to --min-lr.")
@click.option("--warmup-steps", type=Count(0, MAX_STEPS), default=0, show_default=True,
              help="Steps whose learning rate rises linearly to --lr.")
@click.option("--min-lr", type=Finite(0, 1e6), default=0.0, show_default=True,
              help="Where linear and cosine decay end.")
@click.option("--lr-decay-steps", type=Count(1, MAX_STEPS),
              help="The step where the decay reaches --min-lr [default: --steps, the whole run's].")
@click.option("--precision", type=click.Choice(PRECISIONS),
              help="Compute under autocast in bf16 or fp16 with fp32 master weights and optimizer state; messages "
                   "between stages travel in it (fp16 also scales the loss) [default: the profile's].")
@click.option("--clip-grad-norm", type=Finite(0, 1e9, min_open=True), metavar="MAX",
              help="Clip the gradients to this global norm before each step (the whole model's where stages step "
                   f"together; in {PER_ROUND} each stage its share: see docs/train.md).")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), help="Write checkpoints under this folder.")
@click.option("--checkpoint-every", type=Count(0, MAX_STEPS), default=0, show_default=True,
              help="Steps between checkpoints (0: only at the end).")
@click.option("--resume", is_flag=True, help="Continue from the newest complete checkpoint in --checkpoint-dir "
              "(also under a different plan).")
@click.option("--init-from", "init_from", type=click.Path(exists=True), metavar="PATH",
              help="Start from pretrained weights: a .safetensors file or a Hugging Face model folder "
                   "(model.safetensors, or shards with their index); each worker reads only its stage's tensors. "
                   "With --resume (a requeued fine-tune): the newest complete checkpoint if there is one, else these "
                   "weights.")
@click.option("--max-restarts", type=Count(0, 1000), default=0, show_default=True,
              help="When a worker fails, start the job again from the newest complete checkpoint, up to this many "
                   "times (needs --checkpoint-dir; one machine).")
@click.option("--metrics", "metrics_path", type=click.Path(dir_okay=False),
              help="CSV, one row per step, written as the run goes (tail -f works): step, loss, samples/s, lr, "
                   "gradient norm, each worker's busy share and memory (pandas reads it as is).")
@click.option("--tensorboard", "tensorboard_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="Also write loss, lr, gradient norm and samples/s as TensorBoard scalars into DIR as the run goes "
                   "(needs the tensorboard package).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False),
              help="Chrome trace of the measured run, one track per worker (compare with pd simulate --trace).")
@click.option("--timeout", "timeout_s", type=Finite(1, 86400), default=60.0, show_default=True,
              help="Seconds a worker waits on a silent peer (a message, or a sign of life during start-up) before "
                   "the job is declared failed.")
@click.option("--startup-timeout", "startup_timeout_s", type=Finite(1, 86400), default=600.0, show_default=True,
              help="Seconds start-up may take in all: every worker imports and builds the model, cuts its stage "
                   "and joins the process groups.")
@click.option("--threads", type=Count(1, MAX_THREADS),
              help="Torch threads per CPU worker [default: this machine's cores / its workers, at least 1]; "
                   "profile with the same pd profile --threads.")
@click.option("--nnodes", type=Count(1, 16384), default=1, show_default=True,
              help="Machines in the job (each runs this same command).")
@click.option("--node-rank", type=Count(0, 16383), default=0, show_default=True, help="This machine's index.")
@click.option("--nproc-per-node", type=Count(1, 16384),
              help="Workers on this machine [default: the plan's workers / --nnodes].")
@click.option("--master-addr", default="127.0.0.1", show_default=True, help="Address of the node-rank-0 machine.")
@click.option("--master-port", type=Count(1, 65535),
              help="Its rendezvous port [default: a free one; required with --nnodes > 1].")
@click.option("--rdzv-endpoint", metavar="HOST:PORT",
              help="A c10d rendezvous instead of --master-addr/--master-port/--node-rank: every machine names "
                   "the same endpoint and the rendezvous numbers the machines.")
@click.option("--rdzv-id", default="pdtool", show_default=True,
              help="The job's name at the rendezvous (the same on every machine of one job).")
@click.option("--iface", metavar="NAME",
              help="Network interface of the workers' traffic (gloo and NCCL) [default: lo on one machine; the one "
                   "that routes to the rendezvous host across machines, or GLOO_SOCKET_IFNAME if set].")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="Where workers run: cuda gives each worker the GPU of its local rank and NCCL; cpu uses gloo; "
                   "auto takes the GPUs when torch sees one for every worker of this machine, else the CPU.")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="auto",
              show_default=True,
              help="How messages between workers of this machine travel: shared-memory rings (CPU, x86) or the "
                   "process group (gloo/NCCL); auto takes shared memory when this machine has a core per worker. "
                   "Links to other machines always use the process group.")
@click.option("--launcher", type=click.Choice(LAUNCHERS), default="auto",
              show_default=True,
              help="Who starts the workers: local (pd train starts them), or torchrun/slurm (this process is one "
                   "worker that torchrun or srun started; see docs/launchers.md); auto: torchrun or "
                   "slurm when their variables are set (TORCHELASTIC_RUN_ID; SLURM_PROCID in an srun step of "
                   "several tasks), else local.")
@click.option("--init", "init", type=click.Choice(INITS), default="rule", show_default=True,
              help="Initial weights: rule (each worker gives only its stage's parameters their values, each from a "
                   "generator seeded by --seed and the parameter's name, with its modules' own init methods: the same "
                   "under any plan) or factory (every process builds the whole model with the factory's own values).")
@click.option("--verbose", "-v", is_flag=True, help="Show the launcher's log and a failing worker's traceback.")
@click.option("--evaluate", is_flag=True,
              help="After training, run the data set's held-out split (digits' test split, or a factory's dataset for "
                   "train=False) through the pipeline and report its mean loss and top-1 accuracy.")
@click.option("--eval-every", type=click.IntRange(min=1), default=None, metavar="N",
              help="Every N steps, drain the pipeline and run the held-out split through it (forward only, eval mode): "
                   "its loss and accuracy go to the progress output, --metrics and --tensorboard.")
@click.option("--quiet", "-q", is_flag=True, help="No progress line on stderr.")
def train(plan_path, steps, epochs, model_spec, data, mode, group, shard, seed, optimizer, lr, momentum, betas, eps, weight_decay,
          lr_schedule, warmup_steps, min_lr, lr_decay_steps, precision, clip_grad_norm, checkpoint_dir,
          checkpoint_every, resume, init_from, max_restarts, metrics_path, tensorboard_dir, trace_path, timeout_s, startup_timeout_s, threads, nnodes, node_rank, nproc_per_node,
          master_addr, master_port, rdzv_endpoint, rdzv_id, iface, device, transport, launcher, init, verbose, evaluate,
          eval_every, quiet):
    """Train a plan on torch.distributed workers (gloo on CPU, NCCL on GPUs), one process per rank.

    Every worker builds its stage from the model the plan names, checks the plan against the
    world size and the model's fingerprint, then runs its schedule in the plan's mode or --mode
    (1F1B with weight stashing by default). A failing worker stops the whole job.
    Under torchrun or srun (--launcher), this process is one of the workers.
    """
    from ..artifacts.plan import Plan
    from ..runtime.run import Nodes
    from ..runtime.recipe import LrSchedule, OptimizerConfig
    from ..runtime.run import RunConfig

    where = place(detect(launcher))  # None: pd train starts the workers itself
    if where is not None:
        _refuse_local_options(where.launcher, transport)
    reporter = where is None or where.rank == 0  # the process that writes the outputs and prints the summary
    if max_restarts and not checkpoint_dir:
        raise click.UsageError("--max-restarts needs --checkpoint-dir: a restart continues from the newest checkpoint")
    if max_restarts and (nnodes > 1 or rdzv_endpoint):
        raise click.UsageError("--max-restarts restarts the workers of one machine; across machines, restart the "
                               "job with --resume")
    recipe = OptimizerConfig(name=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay, betas=betas,
                             eps=eps, schedule=LrSchedule(lr_schedule, warmup_steps, min_lr, lr_decay_steps),
                             clip_grad_norm=clip_grad_norm)
    if recipe.problem():
        raise click.UsageError(recipe.problem())
    plan = Plan.load(plan_path)
    if nnodes > 1 and master_port is None and not rdzv_endpoint:
        raise click.UsageError("--nnodes > 1 needs --master-port (the same on every machine) or --rdzv-endpoint")
    if rdzv_endpoint and (node_rank or master_port is not None):
        raise click.UsageError("--rdzv-endpoint numbers the machines itself: drop --node-rank and --master-port")
    for path in (metrics_path, trace_path):
        if path and reporter:
            check_writable(path, (plan_path,) + tuple(p for p in (metrics_path, trace_path) if p and p != path))
    config = RunConfig(plan_path=os.path.abspath(plan_path), steps=steps, mode=mode, group=group, shard=shard, seed=seed,
                       optimizer=recipe, precision=precision, timeout_s=timeout_s,
                       startup_timeout_s=startup_timeout_s,
                       threads=threads, data=data, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                       progress=not quiet, evaluate=evaluate, eval_every=eval_every, device=device, transport=transport,
                       model=model_spec, init=init, init_from=os.path.abspath(init_from) if init_from else None,
                       metrics=os.path.abspath(metrics_path) if metrics_path and where is None else None,
                       tensorboard=os.path.abspath(tensorboard_dir) if tensorboard_dir else None,
                       settings={**settings(click.get_current_context()), "plan": os.path.abspath(plan_path)})
    if tensorboard_dir:
        import importlib.util

        _check_folder_writable(tensorboard_dir, "--tensorboard")
        if importlib.util.find_spec("tensorboard") is None:  # torch.utils.tensorboard writes with it
            raise click.UsageError("--tensorboard needs the tensorboard package: pip install tensorboard")
    from ..model.spec import local_origin
    from ..runtime.launcher.train import train as run_training

    origin = local_origin(plan.profile.model["spec"]) if plan.profile.model and not model_spec else None
    if origin and reporter:  # the plan names code of the experiment folder: say which file runs before it does
        click.echo(f"pd: importing the plan's model factory {plan.profile.model['spec']} from {origin} "
                   "(experiment folder)", err=True)
    talk = (lambda message: None) if quiet else (lambda message: click.echo(f"pd: {message}", err=True))  # noqa: E731
    warn = lambda message: click.echo(f"pd: warning: {message}", err=True)  # noqa: E731
    say = lambda message: click.echo(f"pd: {message}", err=True)  # noqa: E731
    nodes = Nodes(nnodes=nnodes, node_rank=node_rank, nproc_per_node=nproc_per_node, master_addr=master_addr,
                  master_port=master_port, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, interface=iface)
    ran = run_training(plan, config, where=where, nodes=nodes, epochs=epochs, resume=resume, restarts=max_restarts,
                       verbose=verbose, warn=warn, say=say, talk=talk)  # every check before any worker starts
    if ran is None:
        return  # a worker of torchrun or srun that is not rank 0: rank 0 reports
    _report(*ran, metrics_path=metrics_path, trace_path=trace_path, checkpoint_dir=checkpoint_dir)


def _report(result, job, *, metrics_path: str | None, trace_path: str | None, checkpoint_dir: str | None) -> None:
    """What pd train writes and prints when its workers are done (`result`: the job's
    `TrainResult`, `job`: the resolved run): the metrics CSV and its settings JSON, the trace,
    the summary lines, the held-out figures and where the outputs are. A metrics file a full
    disk kept from being written is said last, as the one error, after everything else."""
    from ..runtime.run import recorded_settings
    from ..views.summary import train_summary

    lost = None
    if metrics_path:
        from ..views.metrics import write_metrics, write_settings

        try:
            write_metrics(metrics_path, result)
            write_settings(metrics_path, recorded_settings(job.config, job.run))
        except PdtoolError as exc:  # a full disk: the training's own figures still follow
            lost = f"--metrics {metrics_path} was not written ({exc}); the training itself finished"
    if trace_path:
        from ..views.trace import write_measured_trace

        write_measured_trace(trace_path, result)
    for line in train_summary(result, job):
        click.echo(line)
    if job.config.evaluate:
        evals = result.evals
        if evals:
            held_loss, accuracy, samples = evals[max(evals)][:3]
            click.echo((f"held-out accuracy: {accuracy:.1%} of {samples} samples, " if accuracy is not None else
                        f"held-out: {samples} samples, ") + f"loss {held_loss:.4f}")
        else:
            click.echo("held-out: not measured here (the last stage runs on another machine)")
    for label, path in (("checkpoints", checkpoint_dir), ("metrics", None if lost else metrics_path),
                        ("trace", trace_path)):
        if path:
            click.echo(f"{label}: {path}", err=True)
    if lost:
        raise PdtoolError(lost)


def _check_folder_writable(folder: str, option: str) -> None:
    """One line, before any worker starts, when `folder` cannot be made or written (a file written
    and removed there: a read-only mount says so, whoever runs pd)."""
    import tempfile

    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".pd-probe-"):
            pass
    except OSError as exc:
        raise click.UsageError(f"{option} {folder}: cannot write there ({exc.strerror or exc}); give a folder you can "
                               "write to") from None


_LOCAL_LAUNCHER = ("nnodes", "node_rank", "nproc_per_node", "master_addr", "master_port", "rdzv_endpoint", "rdzv_id",
                   "max_restarts", "tensorboard_dir")
"""pd train's options that only its own launcher uses (a cluster's launcher places the workers itself)."""


def _refuse_local_options(launcher: str, transport: str) -> None:
    """Usage errors for what a worker started by torchrun or srun cannot do."""
    ctx = click.get_current_context()
    given = [name for name in _LOCAL_LAUNCHER
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    if given:
        raise click.UsageError(f"--{given[0].replace('_', '-')} is for pd train's own launcher; under {launcher}, "
                               f"drop it and give {launcher} its own option for it")
    if transport == "shared-memory":
        raise click.UsageError(f"--transport shared-memory needs pd train's own launcher (it removes the rings of "
                               f"workers that die); under {launcher} the workers talk through the process group")
