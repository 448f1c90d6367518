"""A replicated stage's optimizer state sharded across its replicas (`--shard optimizer`: ZeRO
stage 1, Megatron-LM's distributed optimizer).

Every replica keeps the whole stage's weights and, after the replicas' all-reduce
(`Stepper.mean_gradients`), the whole mean gradient, so clipping and fp16's overflow check read the
same norm as without sharding. What it keeps of the optimizer is its shard. Each parameter group
(decay, no decay) is laid out flat in one buffer, in the stage's parameter order, padded to a
multiple of the replicas r; the live weights become views of that buffer, and replica i owns the
i-th of its r equal slices. The replica's optimizer steps the *pieces* of its slice (where the
slice crosses a parameter: a view of the buffer, its gradient a view of the mean gradient), so it
holds the state of 1/r of the stage (Adam's two moments, SGD's momentum) and its step makes
temporaries no larger than a parameter, as an unsharded step does. After the step the replicas
gather their slices into every replica's buffer in place: one broadcast per replica of its slice
(gloo's `all_gather_into_tensor` would hold a second buffer of the whole group for a moment; the
broadcasts move the same bytes, (r - 1) / r of the group to each replica, and hold nothing).

The optimizers this is exact for update each element from that element alone (SGD, Adam, AdamW:
a piece steps as the parameter it belongs to would), so a sharded run ends with the weights of an
unsharded one, bit for bit. A factory's optimizer may compute per-tensor quantities (LAMB's trust
ratio), which a piece would change: the launcher refuses it with `--shard optimizer`
(`runtime.run.check_shard`).

Checkpoints keep the unsharded layout: at a checkpoint every replica sends its state slices to
replica 0 (`param_state`, a collective), which writes them per parameter (holding the whole
state while it writes, as an unsharded replica always does; the others hold their slice and one
slice of scratch), so a sharded run resumes unsharded, under another plan or another number of
replicas; `load_param_state` takes a replica's pieces of such a state.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...errors import LaunchError
from .gradient_shard import GradientReducer

Gather = Callable[..., None]
"""gather(buffer, size, whole=True): every replica's slice of `buffer` (the i-th `size` elements:
replica i's) from the replica that holds it, in place, over the stage's replicas; with whole
False, `buffer` is this replica's slice alone, which it gives, and the others' are dropped."""


class _Group:
    """One parameter group laid out flat: its parameters (now views of `buffer`), each replica's
    slice length, this replica's slice [start, start + slice) and its pieces."""

    def __init__(self, params: list[torch.nn.Parameter], replicas: int, index: int):
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise LaunchError(f"--shard optimizer/gradients lays a parameter group out in one buffer, but its parameters have "
                              f"{len(kinds)} dtypes or devices ({sorted(str(d) for d, _ in kinds)}); use --shard none")
        self.params = params
        size = sum(p.numel() for p in params)
        self.slice = -(-size // replicas)
        self.start = index * self.slice
        like = params[0]
        self.buffer = torch.zeros(self.slice * replicas, dtype=like.dtype, device=like.device)
        # (parameter, where its piece starts in it, where in the buffer, the piece: a parameter viewing the buffer)
        self.pieces: list[tuple[torch.nn.Parameter, int, int, torch.nn.Parameter]] = []
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                self.buffer[offset:offset + n].copy_(p.reshape(-1))
                p.data = self.buffer[offset:offset + n].view_as(p)
                a, b = max(self.start, offset), min(self.start + self.slice, offset + n)
                if a < b:
                    self.pieces.append((p, a - offset, a, torch.nn.Parameter(self.buffer[a:b])))
                offset += n

    def fresh_storage(self) -> None:
        """The weights and pieces onto a copy of the buffer, the old one left to whatever views
        it (a kept weight version: `VersionStore.keep_current`)."""
        with torch.no_grad():
            self.buffer = self.buffer.clone()
            offset = 0
            for p in self.params:
                p.data = self.buffer[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            for _, _, start, piece in self.pieces:
                piece.data = self.buffer[start:start + piece.numel()]

    def gather(self, gather: Gather, source: torch.Tensor | None = None) -> torch.Tensor:
        """`source` (laid out as the buffer; default: the weights' buffer) with every replica's
        slice from that replica, in place."""
        source = self.buffer if source is None else source
        gather(source, self.slice)
        return source

    def views(self, whole: torch.Tensor) -> dict[torch.Tensor, torch.Tensor]:
        """Per parameter, its part of a tensor laid out as the buffer (views of it)."""
        found, offset = {}, 0
        for p in self.params:
            found[p] = whole[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        return found


class ShardedOptimizer:
    """The optimizer of one replica's shard (see the module docstring). `build` makes a torch
    optimizer over parameter groups (`runtime.optimizers.build_over`); `groups` are the stage's
    (dicts of `params` and their settings) in the unsharded optimizer's order. `gather` is set
    once the replicas' process group exists. `order`: each live parameter's position in the stage
    (given: the gradients are sharded too, `gradient_shard.GradientReducer`, whose slice the
    pieces' gradients view)."""

    def __init__(self, groups: list[dict], build: Callable[[list[dict]], torch.optim.Optimizer], replicas: int,
                 index: int, order: dict[torch.Tensor, int] | None = None):
        self.replicas, self.index = replicas, index
        self.layout = [_Group(list(g["params"]), replicas, index) for g in groups]
        self.reducer = GradientReducer(self.layout, order) if order is not None else None
        mine = [dict(g, params=[piece for *_, piece in flat.pieces]) for g, flat in zip(groups, self.layout)]
        mine = [g for g in mine if g["params"]]
        self.optimizer = build(mine) if mine else None  # a replica whose slices are all padding steps nothing
        self.param_groups = self.optimizer.param_groups if self.optimizer is not None else []
        # the per-element state keys (the same on every replica, also one without pieces): a probe's after a step
        probe = torch.nn.Parameter(torch.zeros(1, dtype=self.layout[0].buffer.dtype))
        probe.grad = torch.zeros_like(probe)
        stepped = build([dict(groups[0], params=[probe])])
        stepped.step()
        self.keys = sorted(k for k, v in stepped.state[probe].items() if _per_element(v))
        self.gather: Gather | None = None
        # whether the shard holds state (a step ran, or a checkpoint's state was loaded): the same on every
        # replica, also on one without pieces, so they all take part in the same collectives of `param_state`
        self.holds_state = False

    @property
    def state(self):
        """The shard's optimizer state (what this replica holds), by piece."""
        return self.optimizer.state if self.optimizer is not None else {}

    def step(self) -> None:
        """Step this replica's pieces from the live weights' `.grad` (views, no copy), then
        all-gather every replica's slices into the live weights."""
        with torch.no_grad():
            if self.reducer is not None:  # the pieces' gradients: their parts of the reduced slice
                for piece, grad in self.reducer.views().items():
                    piece.grad = grad
            for group in self.layout if self.reducer is None else ():
                for p, start, _, piece in group.pieces:
                    piece.grad = None if p.grad is None else p.grad.reshape(-1)[start:start + piece.numel()]
            if self.optimizer is not None:
                self.optimizer.step()
            self.holds_state = True
            for group in self.layout:
                group.gather(self._gather)

    def fresh_storage(self) -> None:
        """Every group's weights onto a copy of their buffer (`_Group.fresh_storage`)."""
        for group in self.layout:
            group.fresh_storage()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Let every gradient go: the pieces' views and the live weights' own (a sharded
        gradient's slice is zeroed; it stays for the next step)."""
        if self.reducer is not None:
            self.reducer.zero()
        for group in self.layout:
            for *_, piece in group.pieces:
                piece.grad = None
            for p in group.params:
                p.grad = None

    def param_state(self, keep: bool = True) -> dict[torch.Tensor, dict]:
        """Per live parameter, its optimizer state as an unsharded optimizer would hold it (every
        replica's slices gathered: a collective that every replica calls at once); `keep` False:
        this replica only gives its slices (to the one that keeps them) and gets nothing."""
        found: dict[torch.Tensor, dict] = {}
        if not self.holds_state:  # no step yet (or every one skipped on overflow): no state, as unsharded
            return found
        for group in self.layout:
            held = [(at, self.state.get(piece, {})) for _, _, at, piece in group.pieces]
            for key in self.keys:
                flat = torch.zeros_like(group.buffer) if keep else torch.zeros(group.slice, dtype=group.buffer.dtype,
                                                                                  device=group.buffer.device)
                shift = 0 if keep else group.start
                for at, state in held:
                    if key in state:
                        flat[at - shift:at - shift + state[key].numel()].copy_(state[key])
                self._gather(flat, group.slice, keep)
                if keep:
                    for p, value in group.views(flat).items():
                        found.setdefault(p, {})[key] = value
            if not keep:
                continue
            shared = next((state for _, state in held if state), {})  # every piece's: Adam's step count
            for key, value in shared.items():
                if not _per_element(value):
                    for p in group.params:
                        found.setdefault(p, {})[key] = value.clone() if isinstance(value, torch.Tensor) else value
        return found

    def load_param_state(self, param_state: dict[torch.Tensor, dict]) -> None:
        """Take this replica's pieces of an unsharded state (per live parameter, as `param_state`
        gives it; parameters without state are left out)."""
        self.holds_state = any(param_state.values())  # every replica restores the same checkpoint
        for group in self.layout:
            for p, start, _, piece in group.pieces:
                state = param_state.get(p)
                if state:  # a per-element value has the parameter's shape (0-dim for a scalar parameter)
                    self.optimizer.state[piece] = {
                        key: (value.reshape(-1)[start:start + piece.numel()].clone() if key in self.keys else value)
                        for key, value in state.items()}

    def _gather(self, buffer: torch.Tensor, size: int, whole: bool = True) -> None:
        if self.gather is None:
            raise RuntimeError("the replicas' process group of a sharded optimizer was not set")
        self.gather(buffer, size, whole)


def _per_element(value) -> bool:
    """Whether an optimizer state value has one entry per element (a moment, a momentum), not one
    for the whole tensor (a step count)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0
