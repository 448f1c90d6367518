"""The planner's states: down-sets of the layer DAG (Narayanan et al., SOSP 2019, section 3.1).

A state is a *down-set* D of the layer graph: a set of layers closed under predecessors (every
input of a layer of D comes from D). The empty set and the set of all layers are states. A
pipeline stage is the difference `D_j \\ D_k` of two states with `D_k` a strict subset of
`D_j`, and a pipeline is a chain of states from the empty set to all layers, one stage per
step. PipeDream's optimizer names the same states by their antichains of maximal layers
(../shared/pipedream-reference.md, section 2); a chain of layers has exactly its n + 1 prefixes
as down-sets, a branchy graph (a residual block's main branch beside its downsample branch)
has more, and stages such as "the main branch up to its second conv, the whole downsample
branch" become possible.

**Enumeration** (`build_states`). Breadth first from the empty set: a state's successors add
one layer all of whose predecessors are already in. A layer with zero forward + backward time
and no parameters that has no consumers (a sink such as gnmt's `__getitem__` nodes) or an empty
output does not multiply the states where that is safe (no memory limit, idle workers allowed):
it belongs to a non-empty state exactly when all its predecessors do, so it joins the stage of
its (latest) producer.
When the profile's order holds an edge `i -> i + 1` for every i, the down-sets are the prefixes
of that order and they are taken directly (a chain, GPT, chains with skip connections).
Beyond `MAX_STATES` states the planner falls back to the prefixes of the profile's order and
says so (`States.space`, recorded in the plan as `state_space`).

**Order.** States are sorted by (total compute, size, member bitmask): topological for strict
inclusion (totals are summed in layer order over all layers, non-members counting 0, so a
superset never totals less) and non-decreasing in compute, which the banded search's lower
bounds need (partition.py, `Solver._band`). The empty set is state 0, all layers the last.

**Per-state totals.** compute, params and activation bytes of the members, and `cut`: the bytes
of every output of a member read by some layer outside the state, each output once however many
consumers it has. A stage `D_j \\ D_k` then has compute `compute[j] - compute[k]` (likewise params
and activations), receives `cut[k]` bytes and sends `cut[j]` (costmodel.py); on prefixes these are
exactly the range sums and boundary cuts of the layer order.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from ..artifacts.plan import DOWN_SETS, PREFIXES
from .costmodel import ChainCosts

MAX_STATES = 2000
"""Most down-sets the planner takes. Its tables are dense (states x states) float64 matrices,
32 MB each at 2000 states, and a level above the innermost solves one row per start state;
a graph with more down-sets is planned over the prefixes of the profile's order instead."""



@dataclass(frozen=True, eq=False, kw_only=True)
class States:
    """The DP states of one profile, in the order described in the module doc.

    `masks[s]` is state s as a bitmask over layer ids; `compute`, `params`, `acts` and `cut`
    are per-state totals (seconds, bytes); `subset[k, j]` says that state k is a strict subset
    of state j (then k < j). `space` is "down-sets", or "prefixes" when the enumeration gave
    up (more than `MAX_STATES`) and the prefixes of the profile's order are used instead.
    """

    space: str
    n: int
    masks: tuple[int, ...]
    compute: np.ndarray
    params: np.ndarray
    acts: np.ndarray
    cut: np.ndarray
    subset: np.ndarray
    forward: np.ndarray | None = None  # per-state totals of the layers' forward seconds (recomputation's cost)
    stash: np.ndarray | None = None    # per-state totals of what the layers save for the backward (None: `acts`)
    layer_params: np.ndarray | None = None  # per layer (not state): parameter bytes, for `stage_maxima`

    def __len__(self) -> int:
        return len(self.masks)

    @property
    def params_sorted(self) -> bool:
        """Whether the params totals are non-decreasing in the state order too (the planner
        prunes with a params lower bound only then)."""
        return bool(np.all(np.diff(self.params) >= 0))

    def layers(self, start: int, end: int) -> tuple[int, ...]:
        """The layer ids of the stage `D_end \\ D_start`, ascending."""
        return _bits(self.masks[end] & ~self.masks[start])

    def restricted(self, keep) -> "States":
        """The same states less those whose mask `keep(mask)` refuses (the empty set and all
        layers always stay): the cuts a model allows (e.g. only between the children of an
        nn.Sequential, or none at all). Order and totals are unchanged, so every invariant holds."""
        last = len(self.masks) - 1
        rows = [s for s, mask in enumerate(self.masks) if s in (0, last) or keep(mask)]
        return States(space=self.space, n=self.n, masks=tuple(self.masks[s] for s in rows),
                      compute=self.compute[rows], params=self.params[rows], acts=self.acts[rows],
                      cut=self.cut[rows], subset=self.subset[np.ix_(rows, rows)],
                      forward=None if self.forward is None else self.forward[rows],
                      stash=None if self.stash is None else self.stash[rows], layer_params=self.layer_params)

    def stage_maxima(self, values: np.ndarray, levels: int = 16) -> np.ndarray:
        """Matrix `M[k, j]` = the largest of the per-layer `values` over the stage `D_j \\ D_k`
        where state k is a strict subset of state j, 0 elsewhere. Exact for the `levels` largest
        distinct values; a smaller value counts as the smallest of those (never less than it is).
        A stage holds a value at least v when D_j counts more layers of at least v than D_k."""
        values = np.asarray(values, dtype=float)
        found = np.zeros(self.subset.shape)
        if self.n == 0 or not values.any():
            return found
        bits = _membership(list(self.masks), self.n)
        tops = np.unique(values[values > 0])[-levels:]
        for i, level in enumerate(tops):  # ascending: a larger level overwrites a smaller one
            count = bits[:, (values > 0) if i == 0 else (values >= level)].sum(axis=1)
            found = np.where(count[None, :] > count[:, None], level, found)
        return np.where(self.subset, found, 0.0)

    def stage_sums(self, totals: np.ndarray, empty: float = 0.0) -> np.ndarray:
        """Matrix `S[k, j]` = totals[j] - totals[k] where state k is a strict subset of state j
        (the stage `D_j \\ D_k`), `empty` elsewhere."""
        return np.where(self.subset, totals[None, :] - totals[:, None], empty)


def build_states(costs: ChainCosts, max_states: int = MAX_STATES, followers: bool = True) -> States:
    """The down-sets of `costs`' layer graph (`costs.edges`; None: a chain in layer order),
    or the prefixes of the layer order when there are more than `max_states` of them.
    `followers` False keeps zero-time layers as layers of their own (see `_followers`: the
    pruning is safe only where a plan may leave workers idle)."""
    n = costs.n
    if costs.edges is None or set(zip(range(n - 1), range(1, n))) <= set(costs.edges):
        return prefix_states(costs, DOWN_SETS)
    masks = _enumerate(n, costs.edges, costs, max_states, followers)
    if masks is None:
        return prefix_states(costs, PREFIXES)
    bits = _membership(masks, n)
    compute = _totals(bits, costs.compute)
    order = sorted(range(len(masks)), key=lambda s: (compute[s], masks[s].bit_count(), masks[s]))
    masks = [masks[s] for s in order]
    bits = bits[order]
    consumed_outside = np.zeros_like(bits)
    successors: dict[int, list[int]] = {}
    for src, dst in costs.edges:
        successors.setdefault(src, []).append(dst)
    for src, dsts in successors.items():
        consumed_outside[:, src] = bits[:, src] & ~bits[:, dsts].all(axis=1)
    return States(space=DOWN_SETS, n=n, masks=tuple(masks), compute=compute[order],
                  params=_totals(bits, costs.params), acts=_totals(bits, costs.acts),
                  cut=_totals(consumed_outside, costs.acts), subset=_strict_subsets(masks, n),
                  forward=_totals(bits, costs.forwards), stash=_totals(bits, costs.stashes), layer_params=costs.params)


def prefix_states(costs: ChainCosts, space: str = PREFIXES) -> States:
    """The n + 1 prefixes of the layer order as states, with `costs.cut` as their cut bytes
    (exactly the range sums of the layer order)."""
    n = costs.n

    def prefix(values: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(values)])

    return States(space=space, n=n, masks=tuple((1 << k) - 1 for k in range(n + 1)), compute=prefix(costs.compute),
                  params=prefix(costs.params), acts=prefix(costs.acts), cut=np.concatenate([[0.0], costs.cut]),
                  subset=np.triu(np.ones((n + 1, n + 1), dtype=bool), 1), forward=prefix(costs.forwards),
                  stash=prefix(costs.stashes), layer_params=costs.params)


# ----- pieces ----------------------------------------------------------------------------------
def _enumerate(n: int, edges, costs: ChainCosts, max_states: int, followers: bool = True) -> list[int] | None:
    """Every state as a bitmask, breadth first from the empty set (deterministic); None when
    there are more than `max_states`. Followers (`_followers`) join a state as soon as all
    their predecessors are in it (those without any: as soon as it is not empty)."""
    preds = [0] * n
    succ: list[list[int]] = [[] for _ in range(n)]
    for src, dst in sorted(set(edges)):
        preds[dst] |= 1 << src
        succ[src].append(dst)
    follows = _followers(succ, costs) if followers else [False] * n
    if all(follows):
        return [0, (1 << n) - 1]
    followers_of = [[w for w in succ[v] if follows[w]] for v in range(n)]
    units_of = [[w for w in succ[v] if not follows[w]] for v in range(n)]
    rootless = [v for v in range(n) if follows[v] and not preds[v]]

    def step(mask: int, v: int) -> tuple[int, list[int]]:
        """Add layer v and the followers it lets in: the new mask and every layer added."""
        added = [v] + (rootless if mask == 0 else [])
        mask |= sum(1 << u for u in added)
        todo = list(added)
        while todo:
            for w in followers_of[todo.pop()]:
                if not mask >> w & 1 and preds[w] & ~mask == 0:
                    mask |= 1 << w
                    added.append(w)
                    todo.append(w)
        return mask, added

    seen = {0}
    masks = [0]
    queue = deque([(0, tuple(v for v in range(n) if not preds[v] and not follows[v]))])
    while queue:
        mask, ready = queue.popleft()
        for v in ready:
            new, added = step(mask, v)
            if new in seen:
                continue
            seen.add(new)
            masks.append(new)
            if len(masks) > max_states:
                return None
            now_ready = sorted({w for u in added for w in units_of[u] if preds[w] & ~new == 0})
            queue.append((new, tuple(u for u in ready if u != v) + tuple(now_ready)))
    return masks


def _followers(succ: list[list[int]], costs: ChainCosts) -> list[bool]:
    """Layers that do not multiply the states: zero forward + backward time, no parameters, and
    either no consumers (a sink such as `__getitem__(1)` of an LSTM) or an output of 0 bytes
    (e.g. gnmt's `hidden` and its `__getitem__`s). Such a layer joins a state as soon as its
    producers are all in: the latest producer's stage. This loses no plan where a plan may use
    fewer workers and memory is unlimited: a stage of its own would add only a transfer and take
    a worker, while in its producer's stage it adds no compute, all-reduce or transfer. Where
    every worker must be used (the pipedream cost model) such a stage can be the best use of a
    worker, and under a memory limit it can be what makes its producer's stage fit, so the
    planner keeps every down-set then (`build_states(followers=False)`)."""
    return [bool(costs.compute[v] == 0 and costs.params[v] == 0 and (not succ[v] or costs.acts[v] == 0))
            for v in range(len(succ))]


def _membership(masks: list[int], n: int) -> np.ndarray:
    """Boolean matrix: bits[s, v] says layer v is in state s."""
    width = (n + 7) // 8
    raw = np.frombuffer(b"".join(m.to_bytes(width, "little") for m in masks), dtype=np.uint8)
    return np.unpackbits(raw.reshape(len(masks), width), axis=1, bitorder="little")[:, :n].astype(bool)


def _totals(bits: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per-state sums of `values`, added in layer order over every layer (non-members count 0):
    the same additions for every state, so a superset never totals less, and a prefix totals
    exactly its cumulative sum."""
    if bits.shape[1] == 0:
        return np.zeros(len(bits))
    return np.cumsum(np.where(bits, values[None, :], 0.0), axis=1)[:, -1]


def _strict_subsets(masks: list[int], n: int) -> np.ndarray:
    """subset[k, j]: state k is a strict subset of state j (masks are distinct)."""
    words = (n + 63) // 64
    packed = np.frombuffer(b"".join(m.to_bytes(8 * words, "little") for m in masks), dtype=np.uint64)
    packed = packed.reshape(len(masks), words)
    subset = np.zeros((len(masks), len(masks)), dtype=bool)
    for k in range(len(masks)):  # only later states can contain state k
        subset[k, k + 1:] = ~(packed[k] & ~packed[k + 1:]).any(axis=1)
    return subset


def _bits(mask: int) -> tuple[int, ...]:
    """The positions of the set bits of `mask`, ascending."""
    text = bin(mask)[:1:-1]
    return tuple(i for i, bit in enumerate(text) if bit == "1")
