"""An oracle of the asynchronous modes written from the semantics docs/schedules.md states alone.

It shares no code with the runtime (no `StageWorker`, no schedule, no stage splitting): the
whole model runs in one process, and for every minibatch b each parameter is taken from the
version of its stage that docs/schedules.md says b sees:

- every stage s of a plan with r_s replicas steps once per round of its replicas, on the mean
  gradient of the round's minibatches (b in [t r_s, (t+1) r_s)), with the learning rate scaled
  by r_s / r_0 (`pipedream`, `vsync`); `2bw` steps once per batch of m microbatches, unscaled;
- `pipedream`: b sees the version its forward found; stage s starts with
  w_s = floor((W - 1 - sum_{i<s} r_i) / r_s) forwards per replica and then alternates, and a
  replica's step follows each of its backwards, so its k-th minibatch (b = i + k r_s) sees
  version max(0, k - w_s);
- `vsync`: stage 0's `pipedream` version v0 fixes b's staleness on every stage: stage s runs b
  on its newest version with no update from a minibatch >= v0 r_0, i.e. (v0 r_0) // r_s;
- `2bw`: batch t (microbatches t m .. t m + m - 1) runs on version t - 1 (0 for t = 0).

The gradient of minibatch b for stage s is the whole model's gradient with every stage at its
version for b (weight stashing: the backward uses the forward's version)."""
import torch
from torch.func import functional_call

from pdtool.model.data import synthetic_source
from pdtool.model.build import initial_model

STEP_ROUND = {"pipedream": "replicas", "vsync": "replicas", "2bw": "batch"}


def versions_seen(mode: str, replicas: list[int], b: int, group: int) -> list[int]:
    """The version of every stage that minibatch b runs on."""
    workers = sum(replicas)

    def pipedream(s: int) -> int:
        warmup = (workers - 1 - sum(replicas[:s])) // replicas[s]
        return max(0, b // replicas[s] - warmup)

    if mode == "pipedream":
        return [pipedream(s) for s in range(len(replicas))]
    if mode == "vsync":
        held = pipedream(0) * replicas[0]
        return [held // r for r in replicas]
    if mode == "2bw":
        return [max(0, b // group - 1)] * len(replicas)
    raise ValueError(mode)


def expected_run(plan, profile, ref, steps: int, seed: int, lr: float, momentum: float, group: int = 1):
    """(losses by minibatch, final weights by name) of `steps` steps of stage 0 of `plan` in its
    mode, SGD with `lr` and `momentum`, data and initial weights as `pd train --seed seed`.
    `profile` (the plan's) names the layers: a parameter belongs to the layer whose name prefixes it."""
    mode = plan.mode
    replicas = [len(s.ranks) for s in plan.stages]
    bundle = initial_model(ref, seed)
    model = bundle.module
    names = {layer.id: layer.name for layer in profile.layers}
    stage_of = {}
    for name, _ in model.named_parameters():
        owner = max((layer for stage in plan.stages for layer in stage.layers
                     if name.startswith(names[layer] + ".")), key=lambda layer: len(names[layer]))
        stage_of[name] = next(s for s, stage in enumerate(plan.stages) if owner in stage.layers)
    per_step = replicas[0] if mode != "2bw" else group
    total = steps * per_step
    size = [r if mode != "2bw" else group for r in replicas]  # minibatches per step of each stage
    scale = [r / replicas[0] if mode != "2bw" else 1.0 for r in replicas]
    live = [{n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters() if stage_of[n] == s}
            for s in range(len(replicas))]
    optimizers = [torch.optim.SGD(list(live[s].values()), lr=lr * scale[s], momentum=momentum)
                  for s in range(len(replicas))]
    history = [[{n: p.detach().clone() for n, p in live[s].items()}] for s in range(len(replicas))]
    sums = [{n: torch.zeros_like(p) for n, p in live[s].items()} for s in range(len(replicas))]
    batch = synthetic_source(bundle, plan.profile.batch_size, seed).batch
    losses = {}
    for b in range(total):
        seen = versions_seen(mode, replicas, b, group)
        params = {n: history[s][seen[s]][n].clone().requires_grad_(True) for s in range(len(replicas))
                  for n in history[s][seen[s]]}
        inputs, target = batch(b)
        loss = bundle.loss_fn(functional_call(model, params, tuple(inputs)), target)
        losses[b] = float(loss.detach())
        grads = torch.autograd.grad(loss, list(params.values()))
        for (n, _), g in zip(params.items(), grads):
            sums[stage_of[n]][n] += g
        for s in range(len(replicas)):
            round_end = min((b // size[s] + 1) * size[s], total)
            if b + 1 == round_end:  # the last minibatch of the stage's round: its step
                count = b + 1 - (b // size[s]) * size[s]
                for n, p in live[s].items():
                    p.grad = sums[s][n] / count
                    sums[s][n] = torch.zeros_like(p)
                optimizers[s].step()
                history[s].append({n: p.detach().clone() for n, p in live[s].items()})
    weights = {n: p.detach().clone() for s in range(len(replicas)) for n, p in live[s].items()}
    return losses, weights
