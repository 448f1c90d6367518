"""A plan's steady state, computed from one period of its schedule instead of simulated.

The simulator (`simulate`) runs every op of a long schedule; planning a cluster of thousands of
workers needs its figure for many candidates in seconds. Every rule of the simulator is a
maximum of sums: an op ends at the latest of its inputs (its worker free, its message arrived,
its link free, every member of its collective arrived) plus a duration. Once a schedule repeats
(after its warm-up, pipedream and vsync run, on every worker, the backward of its m-th minibatch,
the step, the forward of its (m + k)-th: `B(m) U F(m + k)` with k its minibatches in flight), the
simulation is a timed event graph: one node per op of one period, one arc per input, carrying
the input's duration and how many periods back the input lies (its tokens). Its time per period
is the graph's largest cycle ratio, a cycle's durations over its tokens (Baccelli, Cohen, Olsder
and Quadrat, "Synchronization and Linearity", 1992), which Howard's policy iteration finds in a
few passes over the arcs (Cochet-Terrasson, Cohen, Gaubert, McGettrick and Quadrat, 1998). The
graph's nodes follow `_Run` rule for rule (`simulate`'s module doc): receives pay their copy
unless the message came later, sends pay theirs and occupy their link in the order sent, a
replicated stage's step starts when its last replica arrives and lasts `allreduce_ms`, and a
step is longer by the weight copies it makes on average (`copies_per_step`), which the
simulator charges one by one.

One period covers L minibatches, L the least common multiple of the stages' replicas (each
worker of stage s runs L / r_s of them). Replicas that share a factor g (g divides every stage's
replicas) split the pipeline into g identical sub-pipelines, each taking every g-th minibatch on
its own workers and links, which meet only in the all-reduces, which they reach together: the
period is computed on one of them (stage s's ranks `ranks[::g]`, its all-reduce as long as the
whole stage's) and stands for g times as many minibatches.

Modes that flush before every step (flush, gpipe, zb, zb2) repeat one batch exactly: the
lowered schedule of one batch is the period (`_build_batch`), every op a node, one token from
each worker's last op, each link's last message and each collective's last round to the next
batch. 2bw runs pipedream's order with a step after every m minibatches of the pipeline (m / r_s
of a replica's own), so its period is also m. A flushing batch too large for one graph (over `MAX_NODES`)
is extrapolated from the two largest that fit, its time affine in the group past the warm-up
(`_extrapolated`). `steady_state` returns None where none of this
applies (2bw with a stage whose replicas do not divide m: it steps inside a replica's own
minibatches; periods over `MAX_NODES` nodes; a period whose arcs would point forward in time);
`pd plan` then simulates.
tests/unit/test_steady.py checks the figure against the event simulation on every shipped
profile and cluster. Pure: numpy and pdtool's own modules.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce
from typing import Sequence

import numpy as np

from ..artifacts.plan import MS_PER_S, Plan
from ..schedule.lower import ACTIVATION, COLLECTIVES, collective_key, message
from ..schedule.modes import ONE_F_ONE_B, copies_per_step, rules, warmup_forwards
from .simulate import MIB, allreduce_ms, backward_reduce_ms, link_bandwidth, link_latency, lowered, worker_rank

MAX_NODES = 400_000
"""Largest period graph computed (about 2 s here); beyond, the planner simulates instead."""
_EPS = 1e-9


@dataclass(frozen=True)
class SteadyState:
    """Time per minibatch (ms) in the steady state, its bubble (the share of worker time idle),
    and the period it was computed from (minibatches, graph nodes)."""

    time_per_minibatch_ms: float
    bubble_fraction: float
    period_minibatches: int
    nodes: int


def applies(plan: Plan, mode: str | None = None) -> bool:
    """Whether `steady_state` computes the steady state of `plan` under `mode` (default: the
    plan's) from one period: the 1F1B modes that do not flush (pipedream and vsync, a step per
    round of replicas; 2bw, a step every m minibatches: their steady order is written out,
    `_build`), and the modes that flush before every step (flush, gpipe, zb, zb2: one batch is the
    period, `_build_batch`)."""
    row = rules(mode or plan.mode)
    return row.flushes or (not row.split and row.order == ONE_F_ONE_B)


def steady_state(plan: Plan, mode: str | None = None, group: int | None = None,
                 placement: Sequence[int] = ()) -> SteadyState | None:
    """The steady state of `plan` under `mode` (default: the plan's) and `group` (default: the
    mode's); None where it cannot be computed from one period (see the module doc). `placement`:
    the worker of each stage, for a mode of several stages per worker (as `simulate` takes it).
    A flushing mode's batch too large for one period graph is extrapolated (`_extrapolated`)."""
    if not applies(plan, mode):
        return None
    found = _one_period(plan, mode, group, placement)
    if found is None and plan.run(mode, group).mode.flushes:
        return _extrapolated(plan, mode, group, placement)
    return found


def _extrapolated(plan: Plan, mode: str | None, group: int | None, placement: Sequence[int]) -> SteadyState | None:
    """A flushing mode's steady state at a group m whose batch is over `MAX_NODES` nodes: from the
    batches of the two largest groups m1 < m2 that fit and hold at least twice the stages'
    microbatches on every sub-pipeline (its warm-up and cool-down whole), assuming a batch's time
    is affine in m from there: every further microbatch adds one steady cycle of the pipeline
    (1F1B's and the zero-bubble orders' steady phase; GPipe's all-forward and all-backward
    phases). None where no two such groups fit."""
    run = plan.run(mode, group)
    replicas = [s.replicas for s in plan.stages]
    placement = tuple(placement or plan.placement)
    g = 1 if placement else reduce(math.gcd, replicas)
    unit = g * (max(placement) + 1 if placement and run.mode.group_multiple else 1)
    per_microbatch = len(replicas) * 10 / g  # nodes a microbatch adds to the batch graph
    m2 = int(MAX_NODES // per_microbatch) // unit * unit
    m1 = m2 // 2 // unit * unit
    if m1 < 2 * len(replicas) * g or m2 >= run.group:
        return None
    one, two = (_one_period(plan, mode, m, placement) for m in (m1, m2))
    if one is None or two is None:
        return None
    batch1, batch2 = one.time_per_minibatch_ms * m1, two.time_per_minibatch_ms * m2
    batch = batch2 + (run.group - m2) * (batch2 - batch1) / (m2 - m1)
    acting = (1 - two.bubble_fraction) * batch2 / m2 * run.group  # compute grows with m, as the batch's time
    return SteadyState(time_per_minibatch_ms=batch / run.group, bubble_fraction=max(0.0, 1 - acting / batch),
                       period_minibatches=run.group, nodes=one.nodes + two.nodes)


def _one_period(plan: Plan, mode: str | None, group: int | None, placement: Sequence[int]) -> SteadyState | None:
    """`steady_state` from one period graph, or None (too large, or none applies)."""
    replicas = [s.replicas for s in plan.stages]
    run = plan.run(mode, group)
    g = reduce(math.gcd, replicas)
    graph = _Graph()
    placement = placement or plan.placement
    if placement:  # one replica a stage: one batch of the group is the period, on the placement's workers
        if len(replicas) * run.group * 10 > MAX_NODES:
            return None
        reduced, period = [1] * len(replicas), run.group
        acting = _build_batch(plan, run.name, 1, reduced, period, graph, tuple(placement))
    elif run.mode.flushes:
        g = math.gcd(g, run.group)  # the sub-pipelines must split the batch too
        reduced = [r // g for r in replicas]
        period = run.group // g
        if len(reduced) * period * 10 > MAX_NODES:  # every stage runs the batch's minibatches: ~10 nodes each
            return None
        acting = _build_batch(plan, run.name, g, reduced, period, graph)
    else:
        group = 1 if run.mode.per_round else run.group  # 2bw: a replica steps after m / r_s of its minibatches
        if not run.mode.per_round:
            if any(group % r for r in replicas):
                return None  # a replica that steps within its own minibatches (several steps per minibatch)
            g = math.gcd(g, group)
        reduced = [r // g for r in replicas]
        steps = group // g if not run.mode.per_round else 1
        period = reduce(lambda a, b: a * b // math.gcd(a, b), reduced + [steps])
        if len(replicas) * period * 12 > MAX_NODES:
            return None
        copies = [(copies_per_step(run.name, replicas, s), stage.param_bytes / MIB * plan.profile.copy_ms_per_mib)
                  for s, stage in enumerate(plan.stages)]
        acting = _build(plan, g, reduced, period, graph, steps, run.mode.per_round, copies=copies)
    if acting is None:
        return None
    ratio = graph.max_cycle_ratio()
    if ratio is None or ratio <= 0:
        return None
    workers = max(placement) + 1 if placement else sum(reduced)
    return SteadyState(time_per_minibatch_ms=ratio / (period * g),
                       bubble_fraction=max(0.0, 1 - acting / (workers * ratio)),
                       period_minibatches=period * g, nodes=graph.count)


class _Graph:
    """A timed event graph: nodes, and arcs (source, target, duration ms, tokens)."""

    def __init__(self):
        self.count = 0
        self.src: list[int] = []
        self.dst: list[int] = []
        self.weight: list[float] = []
        self.tokens: list[int] = []

    def node(self) -> int:
        self.count += 1
        return self.count - 1

    def arc(self, src: int, dst: int, weight: float, tokens: int = 0) -> None:
        self.src.append(src)
        self.dst.append(dst)
        self.weight.append(weight)
        self.tokens.append(tokens)

    def max_cycle_ratio(self) -> float | None:
        """The largest durations / tokens over the graph's cycles, by Howard's policy iteration:
        every node keeps one incoming arc (its policy), the policy's cycles give each node a
        ratio and a value, and a node switches to an input of a larger ratio, or of the same
        ratio and a larger value, until none does. None when the policy meets a cycle without
        a token (the schedule would deadlock) or a node has no input."""
        n = self.count
        order = np.argsort(np.asarray(self.dst), kind="stable")
        src, dst = np.asarray(self.src)[order], np.asarray(self.dst)[order]
        weight = np.asarray(self.weight, dtype=float)[order]
        tokens = np.asarray(self.tokens, dtype=float)[order]
        if np.any(np.bincount(dst, minlength=n) == 0):
            return None
        policy = np.searchsorted(dst, np.arange(n))  # each node's first input
        for _ in range(n + 2):
            ratio, value = _evaluate(src[policy], weight[policy], tokens[policy])
            if ratio is None:
                return None
            scale = np.maximum(1.0, np.abs(ratio))
            offered = ratio[src]
            best = np.full(n, -np.inf)
            np.maximum.at(best, dst, offered)
            raise_ratio = best > ratio + _EPS * scale
            same = np.abs(offered - ratio[dst]) <= _EPS * scale[dst]
            gain = np.where(same, value[src] + weight - ratio[dst] * tokens, -np.inf)
            top = np.full(n, -np.inf)
            np.maximum.at(top, dst, gain)
            raise_value = ~raise_ratio & (top > value + _EPS * np.maximum(1.0, np.abs(value)))
            if not (raise_ratio.any() or raise_value.any()):
                return float(ratio.max())
            wanted = np.where(raise_ratio[dst], offered >= best[dst], raise_value[dst] & (gain >= top[dst]))
            hits = np.nonzero(wanted)[0]
            nodes, first = np.unique(dst[hits], return_index=True)
            policy = policy.copy()
            policy[nodes] = hits[first]
        return None


def _evaluate(parent: np.ndarray, weight: np.ndarray, tokens: np.ndarray):
    """Each node's ratio and value under a policy: node v's input comes from `parent[v]` over an
    arc of `weight` and `tokens`. Following parents leads every node to one cycle; its ratio is
    the cycle's durations over its tokens, and value(v) = value(parent) + weight - ratio * tokens,
    0 at one node of each cycle. (None, None) for a cycle without a token.

    Vectorised by pointer doubling: parent^(2^K), 2^K >= n, lands every node on a cycle; the
    cycles themselves are walked once; every other node's value is the sum of its path's arcs
    to the cycle it enters, again by doubling."""
    n = len(parent)
    steps = max(1, int(n).bit_length())
    ahead = parent
    for _ in range(steps):
        ahead = ahead[ahead]
    ratio = np.zeros(n)
    value = np.zeros(n)
    on_cycle = np.zeros(n, dtype=bool)
    parent_list, weight_list, token_list = parent.tolist(), weight.tolist(), tokens.tolist()
    for start in np.unique(ahead).tolist():
        if on_cycle[start]:
            continue
        cycle = [start]
        v = parent_list[start]
        while v != start:
            cycle.append(v)
            v = parent_list[v]
        total = sum(token_list[u] for u in cycle)
        if total <= 0:
            return None, None
        eta = sum(weight_list[u] for u in cycle) / total
        # value(u) = value(parent(u)) + w(u) - eta t(u), 0 at `start`: the cycle runs start, parent(start), ...,
        # so each node's parent comes after it; go backwards from the node whose parent is `start`
        for u in reversed(cycle[1:]):
            value[u] = value[parent_list[u]] + weight_list[u] - eta * token_list[u]
        on_cycle[cycle] = True
        ratio[cycle] = eta
    entry = np.where(on_cycle, np.arange(n), parent)  # cycle nodes absorb
    eta = ratio[ahead]
    cost = np.where(on_cycle, 0.0, weight - eta * tokens)
    for _ in range(steps):
        cost = cost + cost[entry]
        entry = entry[entry]
    tree = ~on_cycle
    value[tree] = cost[tree] + value[entry[tree]]
    ratio[tree] = eta[tree]
    return ratio, value


def _build(plan: Plan, g: int, reduced: list[int], period: int, graph: _Graph, group: int = 1,
           per_round: bool = True, copies: Sequence[tuple[float, float]] = ()) -> float | None:
    """The period graph of a 1F1B schedule without flushes on sub-pipeline 0: every worker steps
    after each round of its stage's replicas (`per_round`: pipedream, vsync) or after every
    `group` minibatches of the pipeline, `group / r_s` of its own (2bw), a weight copy of `copies[s]`
    = (copies per step: `copies_per_step`, ms) added to that share of its steps, spread evenly as
    the schedule spreads them (steps 0, 4, 8, ... at 0.25); the acting time
    (compute and steps) of its workers per period; None where an arc would point forward."""
    period_graph = _OneFOneB(plan, g, reduced, period, graph, copies)
    acting = period_graph.units(group, per_round)
    for s in range(len(plan.stages)):
        for i in range(reduced[s]):
            if not period_graph.messages(s, i):
                return None
            period_graph.link_order(s, i)
    return acting


class _OneFOneB:
    """`_build`'s steps: the ops of each worker's units in its order (`units`), the arcs of the
    messages between them (`messages`), and each link carrying one message at a time in the
    order sent (`link_order`)."""

    def __init__(self, plan: Plan, g: int, reduced: list[int], period: int, graph: _Graph,
                 copies: Sequence[tuple[float, float]] = ()):
        self.plan, self.graph, self.reduced = plan, graph, reduced
        self.stages = plan.stages
        self.copies = list(copies) or [(0.0, 0.0)] * len(self.stages)
        self.last = len(self.stages) - 1
        self.per_mib = plan.profile.message_ms_per_mib
        self.ranks = [s.ranks[::g] for s in self.stages]
        self.k = [warmup_forwards(reduced, s) + 1 for s in range(len(self.stages))]
        self.unit_count = [period // r for r in reduced]
        self.took = [allreduce_ms(plan, s) for s in range(len(self.stages))]
        self.reduce = [backward_reduce_ms(plan, s) for s in range(len(self.stages))]  # after each backward
        self._links: dict[tuple[int, int], tuple[float, float]] = {}
        self.nodes: dict[tuple[int, int, int], dict[str, int]] = {}  # (stage, replica, unit): its ops' nodes

    def link(self, x: int, y: int) -> tuple[float, float]:
        """(ms per byte, latency ms) between plan ranks x and y."""
        if (x, y) not in self._links:
            self._links[(x, y)] = _link_ms(self.plan, x, y)
        return self._links[(x, y)]

    def units(self, group: int, per_round: bool) -> float:
        """Per (stage, replica, unit) the ops of one unit, in the worker's order, the next period's
        first op after this one's last; the acting time of the workers per period."""
        graph, acting = self.graph, 0.0
        for s, stage in enumerate(self.stages):
            fwd = stage.fwd_ms + stage.data_ms
            bwd = stage.bwd_ms + (stage.fwd_ms if stage.recompute else 0.0)
            every = 1 if per_round else group // self.reduced[s]  # own minibatches between two steps
            collective = [graph.node() if (u + 1) % every == 0 else None for u in range(self.unit_count[s])]
            reducing = [graph.node() for _ in range(self.unit_count[s])] if self.reduce[s] else None
            share, copy_ms = self.copies[s]
            # its k-th step in the period, with a copy where the schedule has one (at k = 0, 1, 2, 4, 5, 6, ... at 0.75)
            step_ms = [stage.step_ms + copy_ms * (math.ceil((k + 1) * share - 1e-9) - math.ceil(k * share - 1e-9))
                       for k in range(self.unit_count[s])]
            for i in range(self.reduced[s]):
                previous = None
                first = None
                steps_done = 0
                for u in range(self.unit_count[s]):
                    ops = {}

                    def chain(name: str, weight: float) -> int:
                        nonlocal previous, first
                        node = graph.node()
                        if previous is not None:
                            graph.arc(previous, node, weight)
                        else:
                            first = (node, weight)
                        ops[name] = node
                        previous = node
                        return node

                    if s < self.last:
                        chain("rg", stage.out_bytes / MIB * self.per_mib)
                    before_send = chain("B", bwd)
                    if reducing is not None:  # the replicas' u-th backwards reduced together, before the send
                        graph.arc(previous, reducing[u], 0.0)
                        previous = node = graph.node()
                        graph.arc(reducing[u], node, self.reduce[s])
                        before_send = node
                    if s > 0:
                        chain("sg", stage.in_bytes / MIB * self.per_mib)
                        ops["sg_from"] = before_send
                    if collective[u] is not None:
                        graph.arc(previous, collective[u], 0.0)
                        ops["AR"] = node = graph.node()
                        graph.arc(collective[u], node, self.took[s])
                        previous = node
                        chain("U", step_ms[steps_done])
                    if s > 0:
                        chain("ra", stage.in_bytes / MIB * self.per_mib)
                    before_send = chain("F", fwd)
                    if s < self.last:
                        chain("sa", stage.out_bytes / MIB * self.per_mib)
                        ops["sa_from"] = before_send
                    self.nodes[(s, i, u)] = ops
                    if collective[u] is not None:
                        acting += self.took[s] + step_ms[steps_done]
                        steps_done += 1
                    acting += fwd + bwd + self.reduce[s]
                node, weight = first
                graph.arc(previous, node, weight, 1)  # the next period's first op follows this one's last
        return acting

    def _place(self, s: int, b: int, shift: int) -> tuple[int, int, int]:
        """(replica, unit, period) of stage s's unit holding minibatch b's op (its own index minus
        `shift`: k for a forward, 0 for a backward)."""
        i = b % self.reduced[s]
        own = (b - i) // self.reduced[s] - shift
        return i, own % self.unit_count[s], own // self.unit_count[s]

    def _message(self, s: int, i: int, u: int, kind: str, *, to: int, b: int, shift: int, size: int) -> bool:
        """Arcs of one message: the sender's link (after its op, FIFO on the link), then the receiver."""
        j, v, p = self._place(to, b, shift)
        if p < 0:
            return False
        sender = self.nodes[(s, i, u)]
        ms_per_byte, latency = self.link(self.ranks[s][i], self.ranks[to][j])
        wire = self.graph.node()
        sender[f"{kind}_wire"] = wire
        self.graph.arc(sender[f"{kind}_from"], wire, size * ms_per_byte)
        self.graph.arc(sender[f"{kind}_from"], wire, size / MIB * self.per_mib)
        self.graph.arc(wire, self.nodes[(to, j, v)]["ra" if kind == "sa" else "rg"], latency, p)
        sender[f"{kind}_peer"] = (to, j)
        return True

    def messages(self, s: int, i: int) -> bool:
        """The messages replica i of stage s sends in a period; False where one would arrive in an
        earlier period than it was sent (an arc pointing forward)."""
        stage, k = self.stages[s], self.k
        for u in range(self.unit_count[s]):
            b_f = i + (u + k[s]) * self.reduced[s]
            b_b = i + u * self.reduced[s]
            if s < self.last and not self._message(s, i, u, "sa", to=s + 1, b=b_f, shift=k[s + 1],
                                                   size=stage.out_bytes):
                return False
            if s > 0 and not self._message(s, i, u, "sg", to=s - 1, b=b_b, shift=0, size=stage.in_bytes):
                return False
        return True

    def link_order(self, s: int, i: int) -> None:
        """A link carries one message at a time, in the order sent (the previous one may be a period back)."""
        for kind in ("sa", "sg"):
            by_peer: dict[tuple[int, int], list[int]] = {}
            for u in range(self.unit_count[s]):
                ops = self.nodes[(s, i, u)]
                if f"{kind}_wire" in ops:
                    by_peer.setdefault(ops[f"{kind}_peer"], []).append(u)
            size = self.stages[s].out_bytes if kind == "sa" else self.stages[s].in_bytes
            for (to, j), sent in by_peer.items():
                ms_per_byte = self.link(self.ranks[s][i], self.ranks[to][j])[0]
                for n, u in enumerate(sent):
                    before = sent[n - 1]
                    self.graph.arc(self.nodes[(s, i, before)][f"{kind}_wire"], self.nodes[(s, i, u)][f"{kind}_wire"],
                                   size * ms_per_byte, 1 if n == 0 else 0)


def _build_batch(plan: Plan, mode: str, g: int, reduced: list[int], group: int, graph: _Graph,
                 placement: tuple[int, ...] = ()) -> float | None:
    """The period graph of a mode that flushes before every step: one batch of `group`
    minibatches on sub-pipeline 0, every op of the lowered schedule a node (as `simulate._Run`
    runs it), its messages inside the batch, and one token from each worker's last op, each
    link's last message and each collective's last round to the next batch's first. The acting
    time (compute and steps) of its workers per batch; None where a message has no sender."""
    batch = _FlushBatch(plan, mode, g, reduced, group, graph, placement)
    for w, ops in enumerate(batch.workers):
        batch.worker(w, ops)
    if not batch.messages():
        return None
    batch.link_order()
    batch.collective_rounds()
    return batch.acting


class _FlushBatch:
    """`_build_batch`'s steps: each worker's ops in its order (`worker`), the arcs of the messages
    between them (`messages`), each link carrying one message at a time in the order sent
    (`link_order`), and each collective's round joined by its members (`collective_rounds`)."""

    def __init__(self, plan: Plan, mode: str, g: int, reduced: list[int], group: int, graph: _Graph,
                 placement: tuple[int, ...] = ()):
        self.plan, self.graph = plan, graph
        self.stages = plan.stages
        self.per_mib = plan.profile.message_ms_per_mib
        ranks = [s.ranks[::g] for s in self.stages]
        self.took = [allreduce_ms(plan, s, mode) for s in range(len(self.stages))]
        self.reduce = [backward_reduce_ms(plan, s, mode) for s in range(len(self.stages))]
        schedule, self.workers = lowered(mode, tuple(reduced), group, group, tuple(placement), plan.reduces_each(mode))
        if placement:
            self.plan_rank = [worker_rank(plan, schedule, w) for w in range(len(self.workers))]
        else:
            self.plan_rank = [ranks[s][i] for s, i in (schedule.position(w) for w in range(len(self.workers)))]
        self.sent: dict[tuple, tuple[int, float]] = {}  # message key -> (the wire node of its send, latency)
        self.received: dict[tuple, int] = {}  # message key -> its recv node
        self.on_link: dict[tuple[int, int], list[tuple[int, float]]] = {}  # (sender, receiver) -> (wire, transfer)
        self.rounds: dict[tuple, list[tuple[int, int]]] = {}  # (collective key, count) -> members' (node, tokens)
        self.collectives: dict[tuple, int] = {}
        self.acting = 0.0  # the workers' compute and steps per batch

    def worker(self, w: int, ops) -> None:
        """Worker w's ops as a chain of nodes, its first op after its last (the next batch's)."""
        first = previous = None
        met: dict[tuple, int] = {}
        for op in ops:
            if op.kind in COLLECTIVES:
                node, instance = self._collective(op, met)
                if previous is None:  # the batch's first op: the worker arrives from the last batch's end
                    first = (instance, None)
                else:
                    self.rounds.setdefault(instance, []).append((previous, 0))
                previous = node
                continue
            weight, size = self._weight(op)
            node = self.graph.node()
            if previous is not None:
                self.graph.arc(previous, node, weight)
            else:
                first = (node, weight)
            if op.kind == "send":
                self._send(op, w, previous, weight, size)
            elif op.kind == "recv":
                self.received[message(op, w)] = node
            previous = node
        if first is None:
            return
        node, weight = first
        if weight is None:  # a collective first: the worker joins it from the previous batch's last op
            self.rounds.setdefault(node, []).append((previous, 1))
        else:
            self.graph.arc(previous, node, weight, 1)

    def _collective(self, op, met: dict[tuple, int]) -> tuple[int, tuple]:
        """An all-reduce or tie: the worker's node after it and the collective's instance (its
        key and how often the worker met it before)."""
        key = collective_key(op)
        count = met.get(key, 0)
        met[key] = count + 1
        instance = (key, count)
        if instance not in self.collectives:
            self.collectives[instance] = self.graph.node()
        node = self.graph.node()
        took = {"allreduce": self.took, "reduce": self.reduce}.get(op.kind, ())
        took = took[op.stage] if took else 0.0
        self.graph.arc(self.collectives[instance], node, took)
        self.acting += took
        return node, instance

    def _weight(self, op) -> tuple[float, float]:
        """(the time of a compute, step or message op, the message's bytes: 0 for the others); a
        compute or step's time counts as acting."""
        s = self.stages[op.stage]
        if op.kind in ("send", "recv"):
            size = s.out_bytes if (op.direction == ACTIVATION) == (op.kind == "send") else s.in_bytes
            return size / MIB * self.per_mib, size
        if op.kind == "step":
            weight = s.step_ms
        elif op.kind == "F":
            weight = s.fwd_ms + s.data_ms
        elif op.kind == "W":
            weight = s.wgrad_ms
        else:  # B: the input gradients only where a W follows; a recomputing stage's forward first
            weight = (s.fwd_ms if s.recompute else 0.0) + s.bwd_ms - (0.0 if op.weights else s.wgrad_ms)
        self.acting += weight
        return weight, 0.0

    def _send(self, op, w: int, previous: int | None, weight: float, size: float) -> None:
        """A send's wire node: the transfer starts after the worker's previous op and the send's own time."""
        ms_per_byte, latency = _link_ms(self.plan, self.plan_rank[w], self.plan_rank[op.peer])
        wire = self.graph.node()
        if previous is not None:
            self.graph.arc(previous, wire, size * ms_per_byte)
            self.graph.arc(previous, wire, weight)
        self.sent[message(op, w)] = (wire, latency)
        self.on_link.setdefault((w, op.peer), []).append((wire, size * ms_per_byte))

    def messages(self) -> bool:
        """Each receive after its send's transfer and latency; False where a receive has no send."""
        for key, node in self.received.items():
            if key not in self.sent:
                return False
            wire, latency = self.sent[key]
            self.graph.arc(wire, node, latency)
        return True

    def link_order(self) -> None:
        """A link carries one message at a time, in the order sent (the first after the last of the batch before)."""
        for wires in self.on_link.values():
            for n, (wire, transfer) in enumerate(wires):
                self.graph.arc(wires[n - 1][0], wire, transfer, 1 if n == 0 else 0)

    def collective_rounds(self) -> None:
        """A collective's round starts when its last member reaches it."""
        for instance, members in self.rounds.items():
            for member, tokens in members:
                self.graph.arc(member, self.collectives[instance], 0.0, tokens)


def _link_ms(plan: Plan, x: int, y: int) -> tuple[float, float]:
    """(ms per byte, latency ms) between plan ranks x and y."""
    return MS_PER_S / link_bandwidth(plan, x, y), link_latency(plan, x, y) * MS_PER_S
