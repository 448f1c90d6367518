"""An independent reference for the ORIGINAL PipeDream optimizer's state space and DP.

This re-implements, from the description in ../shared/pipedream-reference.md section 2
(`optimizer_graph_hierarchical.py` and its `graph.py`), the quantity the original prints as
"Time per stage in pipeline" (Tp, seconds per minibatch) for

    activation_compression_ratio = 1 (configurable), no memory constraint,
    no --straight_pipeline, no --use_fewer_machines,

including the hierarchical (multi-level) procedure. It is written for tests: pdtool's planner
only cuts one fixed topological order of the layers into contiguous ranges, while the original
plans over every reachable *down-set* ("antichain" state) of the layer DAG, a superset; this
module gives the original's optimum to compare pdtool's answer with.

Nothing here imports pdtool's planner; only the `Profile` data class is read (its layers and
edges, as `pdtool.artifacts.pipedream.load_pipedream_graph` builds them from a graph.txt).
Pure Python + numpy, deterministic.

Reading guide (section numbers are those of pipedream-reference.md):

* `build_states` - preprocessing (s2 "Preprocessing" 1-2), the antichain DAG (s2 "Preprocessing"
  3) and the per-state sums (s2 "Preprocessing" 4).
* `solve` - range tables (s2 "Preprocessing" 5), one level's DP (s2 "DP for one level"),
  and the hierarchy (s2 "Hierarchy").
* `reference_tp` - both together.

How a state is represented. The original names a state by an antichain A (nodes no one of which
is an ancestor of another) and works with Pred(A) = A and all its ancestors. Pred(A) is a
*down-set* D (closed under taking ancestors) and A is exactly the set of maximal elements of
D, so the two determine each other; here a state is its down-set, stored as a bitmask over the
kept nodes (bit v = node v of `StateSpace.nodes`).

The original's successor rule (swap a member x of the augmented antichain for an out-neighbour
n of x that has no descendant in the augmented antichain, then drop members that are ancestors
of other members) gives exactly: from D, for every node n not in D that has at least one
predecessor in D, the state D | {n} | ancestors(n).  (Every out-neighbour n outside D of a node
x of D qualifies: x is a member or an ancestor p of a member a with n outside Pred(a), so x is
in the augmented antichain; n's descendants are outside D, so the "no descendant" check
passes. Out-neighbours inside D are members, skipped, or ancestors of a member, rejected.)
The BFS starts from {s0}, s0 = the first remaining source in file order.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

INF = float("inf")


# ----- the state space -----------------------------------------------------------------------------
@dataclass(frozen=True)
class StateSpace:
    """The original's DP states, in one topological order of its antichain DAG.

    `nodes[v]` names the graph node of bit v. For state s (0..S-1): `downsets[s]` is the node
    set Pred(A_s) (frozenset of names), `compute[s]` = sum over it of (F+B)/1000 [s],
    `activation[s]` / `params[s]` the sums of activation / parameter bytes over it, `out[s]` the
    activation bytes of the *augmented* antichain, and `ancestors[j, k]` is True when state k is
    a (transitive) ancestor of state j in the antichain DAG. `masks[s]` is the down-set's bitmask.
    """

    nodes: tuple[str, ...]
    masks: tuple[int, ...]
    downsets: tuple[frozenset, ...]
    compute: np.ndarray
    activation: np.ndarray
    params: np.ndarray
    out: np.ndarray
    ancestors: np.ndarray
    dag_edges: tuple[tuple[int, int], ...]

    def __len__(self) -> int:
        return len(self.masks)


def first_source_in_file(path: str | Path) -> str:
    """The node id the original's antichain BFS starts from (s2 "Preprocessing" 3): the first
    source in *file order* once `Input*` sources are gone (`Graph.sources()[0]`; the node dict
    keeps file order)."""
    ids, descs, fed_by = [], {}, {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        if line.startswith("\t"):
            src, dst = (p.strip() for p in line.strip().split(" -- "))
            fed_by.setdefault(dst, []).append(src)
        else:
            node_id, desc = (p.strip() for p in line.split(" -- ")[:2])
            ids.append(node_id)
            descs[node_id] = desc
    inputs = {v for v in ids if descs[v].startswith("Input") and not fed_by.get(v)}
    for node_id in ids:
        if node_id not in inputs and all(u in inputs for u in fed_by.get(node_id, [])):
            return node_id
    raise ValueError(f"{path}: no source besides Input nodes")


def build_states(profile, start: str | None = None, order_seed: int | None = None) -> StateSpace:
    """The original's states for a pdtool `Profile` imported from a graph.txt.

    Preprocessing (s2 "Preprocessing" 1-2): `Input*` sources are already dropped by pdtool's
    import (the original zeroes and removes them); sinks whose desc starts with `__getitem__`
    are removed here (one pass, as the original does; pdtool keeps them as layers).
    `start`: the node id the BFS starts from (default: the first source in the profile's layer
    order; pass `first_source_in_file(path)` to be literal about "file order").
    `order_seed`: None gives a deterministic topological order of the states (Kahn's algorithm,
    ready states taken in BFS discovery order); an int gives a random topological order, to
    check that the result does not depend on it.
    """
    layers = profile.layers
    succ: dict[int, list[int]] = {l.id: [] for l in layers}
    for src, dst in profile.edges:
        succ[src].append(dst)

    def desc(layer) -> str:
        return layer.ops[0] if layer.ops else layer.kind

    # s2 "Preprocessing" 2: sinks whose desc starts with __getitem__ are removed (not re-added).
    dropped = {l.id for l in layers if not succ[l.id] and desc(l).startswith("__getitem__")}
    kept = [l for l in layers if l.id not in dropped]
    bit = {l.id: v for v, l in enumerate(kept)}
    n = len(kept)
    preds = [[] for _ in range(n)]
    outs = [[] for _ in range(n)]
    for src, dst in profile.edges:
        if src in bit and dst in bit:
            preds[bit[dst]].append(bit[src])
            outs[bit[src]].append(bit[dst])
    pred_mask = [sum(1 << u for u in preds[v]) for v in range(n)]
    # anc_mask[v] = all transitive ancestors of v (not v); layers are topologically ordered.
    anc_mask = [0] * n
    for v in range(n):
        for u in preds[v]:
            anc_mask[v] |= anc_mask[u] | (1 << u)
    names = tuple(l.name for l in kept)

    # s2 "Preprocessing" 3: BFS over reachable antichains from [s0], as down-sets.
    if start is None:
        start = next(names[v] for v in range(n) if not preds[v])
    s0 = names.index(start)
    if preds[s0]:
        raise ValueError(f"{start} is not a source once Input nodes are removed")
    first = 1 << s0
    index = {first: 0}
    masks = [first]
    edges: list[tuple[int, int]] = []
    queue = deque([first])
    while queue:
        down = queue.popleft()
        for v in range(n):
            if not (down >> v) & 1 and pred_mask[v] & down:   # v is outside D, fed from D
                nxt = down | anc_mask[v] | (1 << v)
                if nxt not in index:
                    index[nxt] = len(masks)
                    masks.append(nxt)
                    queue.append(nxt)
                edges.append((index[down], index[nxt]))
    edges = sorted(set(edges))

    # A topological order of the antichain DAG (the original takes a DFS one; any will do for
    # the row-0 DP, see `solve`).
    count = len(masks)
    children = [[] for _ in range(count)]
    indegree = [0] * count
    for a, b in edges:
        children[a].append(b)
        indegree[b] += 1
    rng = None if order_seed is None else random.Random(order_seed)
    ready = [s for s in range(count) if indegree[s] == 0]
    order = []
    while ready:
        pick = ready.pop(rng.randrange(len(ready))) if rng else ready.pop(ready.index(min(ready)))
        order.append(pick)
        for c in children[pick]:
            indegree[c] -= 1
            if indegree[c] == 0:
                ready.append(c)
    assert len(order) == count, "the antichain DAG has a cycle"
    position = {old: new for new, old in enumerate(order)}
    masks = [masks[old] for old in order]
    edges = tuple(sorted((position[a], position[b]) for a, b in edges))

    # Transitive ancestors in the antichain DAG (the original's `all_predecessor_ids`).
    ancestors = np.zeros((count, count), dtype=bool)
    parents = [[] for _ in range(count)]
    for a, b in edges:
        parents[b].append(a)
    for j in range(count):  # topological order: parents are done
        for p in parents[j]:
            ancestors[j, p] = True
            ancestors[j] |= ancestors[p]

    # s2 "Preprocessing" 4: per-state sums over Pred(A) = the down-set.
    def members(mask: int) -> list[int]:
        return [v for v in range(n) if (mask >> v) & 1]

    compute = np.zeros(count)
    activation = np.zeros(count)
    params = np.zeros(count)
    out = np.zeros(count)
    for s, mask in enumerate(masks):
        inside = members(mask)
        compute[s] = sum((kept[v].fwd_ms + kept[v].bwd_ms) / 1000.0 for v in inside)
        activation[s] = sum(float(kept[v].act_bytes) for v in inside)
        params[s] = sum(float(kept[v].param_bytes) for v in inside)
        out[s] = sum(float(kept[v].act_bytes) for v in augmented_antichain(mask, inside, outs, anc_mask))
    return StateSpace(
        nodes=names, masks=tuple(masks),
        downsets=tuple(frozenset(names[v] for v in members(m)) for m in masks),
        compute=compute, activation=activation, params=params, out=out,
        ancestors=ancestors, dag_edges=edges,
    )


def augmented_antichain(mask: int, inside: Sequence[int], outs, anc_mask) -> list[int]:
    """The original's augmented antichain of the down-set `mask` (s2 "Preprocessing" 3, and
    `Graph.augment_antichain`): the antichain A (maximal nodes of D) plus every ancestor p of a
    member a that has an out-neighbour outside Pred(a) = ancestors(a), other than a itself.

    Note the test is made per member a, against a's own ancestors, not against the whole
    down-set: an ancestor of a whose output also feeds another member b (or b's ancestors) is
    added although that output stays inside D, and its bytes count in `out` (an over-charge
    compared with the true cut). The members themselves always count, consumers or not.
    """
    antichain = [v for v in inside if not any((mask >> w) & 1 for w in outs[v])]
    extra = set()
    for a in antichain:
        own = anc_mask[a]
        for p in (u for u in inside if (own >> u) & 1):
            if any(not (own >> w) & 1 and w != a for w in outs[p]):
                extra.add(p)
    return sorted(extra) + antichain


# ----- the DP ----------------------------------------------------------------------------------------
def range_table(x: np.ndarray) -> np.ndarray:
    """s2 "Preprocessing" 5: X[0][j] = x[j]; X[i][j] = x[j] - x[i-1] for j >= i, else None
    (here NaN). Shape (S+1, S): row i means "states i..j" in the chosen topological order."""
    count = len(x)
    table = np.full((count + 1, count), np.nan)
    table[0] = x
    for i in range(1, count + 1):
        table[i, i:] = x[i:] - x[i - 1]
    return table


def solve_level(C: np.ndarray, Par: np.ndarray, out: np.ndarray, ancestors: np.ndarray,
                machines: int, bandwidth: float, within: int, final: bool,
                ratio: float | None = 1.0, faithful_rows: bool = True) -> np.ndarray:
    """One level's DP (s2 "DP for one level", `compute_partitioning`), returning the times of
    A as an array (S+1, S, machines); inf stands for None. Only the time is kept: Tp does not
    depend on how ties between equal optima are broken.

    `C`, `Par`: range tables (NaN/inf = None); `within` is W (1 at the first level, the
    previous level's count above); `final`: only row 0 is solved (the top level), else every row.
    `faithful_rows=False` additionally skips, at rows i > 0, splits k whose down-set does not
    contain state i-1 (ranges i..k that are not a difference of nested down-sets); the original
    does not skip them (see the test module's notes).
    """
    rows_total, count = C.shape
    A = np.full((rows_total, count, machines), INF)
    valid = np.isfinite(C)
    # Base case, all i and j >= i: one stage replicated m+1 ways, sync / W (quirk 2: only here).
    for m in range(machines):
        sync = 4.0 * m * np.where(valid, Par, 0.0) / (bandwidth * (m + 1)) / within
        A[:, :, m] = np.where(valid, (np.where(valid, C, 0.0) + sync) / (m + 1), INF)

    max_row = 1 if final else rows_total
    # skip[i, k]: at row i > 0 the original skips k in anc[i-1].
    skip = np.zeros((rows_total, count), dtype=bool)
    skip[1:count + 1] = ancestors[:count]
    if not faithful_rows:
        contains_prev = np.ones((rows_total, count), dtype=bool)
        contains_prev[1:count + 1] = ancestors.T[:count] | np.eye(count, dtype=bool)
        skip |= ~contains_prev
    for m in range(1, machines):
        for j in range(1, count):
            rows = np.arange(min(max_row, j))          # rows i with j >= i + 1
            if rows.size == 0:
                continue
            ks = np.flatnonzero(ancestors[j])
            if ks.size == 0:
                continue
            best = A[rows, j, m].copy()
            blocked = skip[np.ix_(rows, ks)]
            for mp in range(1, m + 1):
                # Last stage = states k+1..j replicated m' ways; no /W here (quirk 2).
                last = (C[ks + 1, j] + 4.0 * (mp - 1) * Par[ks + 1, j] / (bandwidth * mp)) / mp
                t = np.maximum(A[np.ix_(rows, ks, [m - mp])][:, :, 0], last[None, :])
                if ratio is not None:
                    # Transfers on the consuming stage's m' replicas only (quirk 3); the output
                    # transfer is charged unless j is the global last state.
                    t = np.maximum(t, (2.0 * out[ks] / (bandwidth * mp) / ratio)[None, :])
                    if j < count - 1:
                        t = np.maximum(t, 2.0 * out[j] / (bandwidth * mp) / ratio)
                t = np.where(blocked, INF, t)
                best = np.minimum(best, t.min(axis=1))
            A[rows, j, m] = best
    return A


def solve(states: StateSpace, counts: Sequence[int], bandwidths: Sequence[float],
          ratio: float | None = 1.0, faithful_rows: bool = True) -> float:
    """Tp for a cluster (counts innermost first, bandwidths bytes/s), s2 "Hierarchy": each
    level's DP runs on the previous level's answers, `C[i][j] <- A[i][j][M-1].time`; the
    activation and parameter tables stay; W becomes the previous level's count (as the
    original's `num_machines_in_machine = num_machines`; for two levels that is M1)."""
    if len(counts) != len(bandwidths) or not counts:
        raise ValueError("give one bandwidth per level")
    C = range_table(states.compute)
    Par = range_table(states.params)
    within = 1
    A = None
    for level, (machines, bandwidth) in enumerate(zip(counts, bandwidths)):
        final = level == len(counts) - 1
        A = solve_level(C, Par, states.out, states.ancestors, machines, bandwidth, within, final,
                        ratio, faithful_rows)
        C = A[:, :, machines - 1]
        within = machines
    return float(A[0, len(states) - 1, counts[-1] - 1])


def reference_tp(profile, counts: Sequence[int], bandwidths: Sequence[float], *, start: str | None = None,
                 ratio: float | None = 1.0, order_seed: int | None = None, faithful_rows: bool = True) -> float:
    """The original optimizer's "Time per stage in pipeline" (s/minibatch) for `profile`."""
    return solve(build_states(profile, start, order_seed), counts, bandwidths, ratio, faithful_rows)
