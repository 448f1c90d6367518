"""Import the original PipeDream profiler's `graph.txt` as a pdtool `Profile`.

The format (see pipedream-reference.md, section 1): node lines

    <id> -- <desc> -- forward_compute_time=<F>, backward_compute_time=<B>, activation_size=<A>,
    parameter_size=<P>[ -- stage_id=<S>]      (one line)

with F and B in milliseconds per minibatch, A the bytes of the node's output for the whole
minibatch (a list `[a; b; c]` for several outputs, summed) and P its parameter bytes; and
tab-indented edge lines `\\t<src id> -- <dst id>` (src's output feeds dst). A node must be
declared before an edge uses it. The profiling batch size is not in the file.

`Input*` sources (data loading) are dropped with their edges, as the original optimizer
does; every other node becomes one layer. Pure: no torch.
"""
from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

from ..errors import ArtifactError
from .profile import Layer, Profile

DEVICE = "unknown (imported from PipeDream graph.txt)"
IMAGE_INPUT_BYTES = 3 * 224 * 224 * 4
"""Bytes of one ImageNet sample as the profiler fed it (3x224x224 float32)."""

_SEPARATOR = " -- "
_KEYS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_FORMAT = ("'ID -- DESC -- forward_compute_time=F, backward_compute_time=B, activation_size=A, "
           "parameter_size=P' or a tab then 'SRC -- DST'")


@dataclass(frozen=True, kw_only=True)
class _Node:
    """One node line: costs in ms per minibatch and bytes, and where it was declared."""

    id: str
    desc: str
    fwd_ms: float
    bwd_ms: float
    act_bytes: float
    param_bytes: float
    line: int


def load_pipedream_graph(path: str | os.PathLike, batch_size: int | None = None) -> Profile:
    """The `Profile` (method "pipedream") of the PipeDream `graph.txt` at `path`.

    `batch_size` is the minibatch size the file was profiled at; graph.txt does not store
    it. When None it is inferred for image models as the Input node's activation bytes /
    (3*224*224*4) if that divides exactly, else an `ArtifactError` asks for `--batch-size`.

    Layers: every node except the `Input*` sources, named by their node id (`node5`), kind
    = the desc up to its first "(" (`Conv2d`, `Add`, `__getitem__`), `ops` = (full desc,).
    The fingerprint is the sha256 of the file's bytes. Layer order: see `layer_order`.
    Every problem is an `ArtifactError` naming the file (and line) and the fix.
    """
    source = str(path)
    data = _read(path)
    nodes, edges = _parse(data, source)
    inputs = [n for n in nodes.values() if n.desc.startswith("Input")
              and not any(dst == n.id for _, dst, _ in edges)]
    dropped = {n.id for n in inputs}
    graph = nx.DiGraph()
    for node in nodes.values():
        if node.id not in dropped:
            graph.add_node(node.id)
    edge_lines: dict[tuple[str, str], int] = {}
    for src, dst, line in edges:
        if src not in dropped:
            graph.add_edge(src, dst)
            edge_lines.setdefault((src, dst), line)
    if graph.number_of_nodes() == 0:
        raise ArtifactError(f"{source}: has no nodes besides Input nodes; give a profile with layers")
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle:
        first = min(edge_lines[(u, v)] for u, v, *_ in cycle)
        path_text = " -> ".join([u for u, *_ in cycle] + [cycle[0][0]])
        raise ArtifactError(f"{source}:{first}: the edges form a cycle ({path_text}); "
                            "a profile graph must be acyclic, remove the edge that closes it")
    if batch_size is None:
        batch_size = _infer_batch_size(inputs, source)
    elif isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ArtifactError(f"{source}: batch size must be a whole number >= 1, not {batch_size!r}; "
                            "fix --batch-size")

    order = layer_order(graph)
    index = {node_id: i for i, node_id in enumerate(order)}
    layers = tuple(
        Layer(id=i, name=node_id, kind=_kind(nodes[node_id].desc), fwd_ms=nodes[node_id].fwd_ms,
              bwd_ms=nodes[node_id].bwd_ms, act_bytes=int(round(nodes[node_id].act_bytes)),
              param_bytes=int(round(nodes[node_id].param_bytes)), ops=(nodes[node_id].desc,))
        for i, node_id in enumerate(order)
    )
    profile_edges = tuple(sorted((index[u], index[v]) for u, v in graph.edges))
    return Profile(model=None, batch_size=batch_size, inputs=(), device=DEVICE, torch_version="",
                   fingerprint=hashlib.sha256(data).hexdigest(), method="pipedream", granularity="module",
                   depth=None, repeats=0, step_ms=0.0, step_ms_spread=0.0, layers=layers, edges=profile_edges,
                   source=source)


def layer_order(graph: nx.DiGraph) -> list[str]:
    """A deterministic topological order of the node ids of `graph` (a DAG).

    A stage is a contiguous range of this order, so the order decides which cuts exist, and
    every output that is produced before a cut and consumed after it is sent across it.

    Rule: the *main* source is the one with the most descendants (ties: lowest node number);
    the main part is that source and all its descendants, ordered by a stable topological
    sort that always takes the ready node with the lowest node number (node numbers follow
    the profiler's forward execution). Every other node (a *source branch*: a second
    input's Embedding, gnmt's `hidden` state and the `__getitem__`s that read it) is placed
    as late as possible: right before the earliest node of the main part that consumes it,
    directly or through other such nodes (at the end if it feeds none); several nodes due
    before the same node keep the lowest-number-first topological order among themselves.
    A source branch's output then stays off every cut before its first consumer; placed
    first, it would be sent across each of them, stage after stage.
    """
    sources = [n for n in graph if graph.in_degree(n) == 0]
    main_source = min(sources, key=lambda n: (-len(nx.descendants(graph, n)), _node_key(n)))
    main = {main_source} | nx.descendants(graph, main_source)
    order = list(nx.lexicographical_topological_sort(graph.subgraph(main), key=_node_key))
    position = {node: i for i, node in enumerate(order)}
    # slot[v] = the position in `order` before which v goes: the earliest slot of its consumers.
    slot: dict[str, int] = {}
    rest = graph.subgraph(set(graph) - main)
    for node in reversed(list(nx.lexicographical_topological_sort(rest, key=_node_key))):
        slot[node] = min((position[s] if s in main else slot[s] for s in graph.successors(node)),
                         default=len(order))
    placed: list[str] = []
    groups: dict[int, list[str]] = {}
    for node, at in slot.items():
        groups.setdefault(at, []).append(node)
    for i in range(len(order) + 1):
        if i in groups:
            placed.extend(nx.lexicographical_topological_sort(rest.subgraph(groups[i]), key=_node_key))
        if i < len(order):
            placed.append(order[i])
    return placed


def _node_key(node_id: str) -> tuple:
    """Sort key of a node id: its trailing number first (`node12` -> 12), then the id."""
    match = re.search(r"(\d+)$", node_id)
    return (int(match.group(1)) if match else math.inf, node_id)


def _read(path: str | os.PathLike) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such file; check the path to the PipeDream graph.txt") from None
    except IsADirectoryError:
        raise ArtifactError(f"{path}: is a folder, not a graph.txt; give the graph.txt inside it") from None
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot read it ({exc.strerror}); check the file and its permissions") from None


def _parse(data: bytes, source: str) -> tuple[dict[str, _Node], list[tuple[str, str, int]]]:
    """Node lines (in file order, by id) and edge lines (src, dst, line number); duplicate
    edge lines are kept here and merged by the graph."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ArtifactError(f"{source}: not a text file (byte {exc.start} is not UTF-8); "
                            "give a PipeDream graph.txt") from None
    nodes: dict[str, _Node] = {}
    edges: list[tuple[str, str, int]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        where = f"{source}:{number}"
        if not raw.strip():
            continue
        if raw.startswith("\t"):
            parts = raw.strip().split(_SEPARATOR)
            if len(parts) != 2 or not all(p.strip() for p in parts):
                raise ArtifactError(f"{where}: edge line {raw.strip()!r:.80} is malformed; "
                                    "write a tab then 'SRC -- DST'")
            src, dst = (p.strip() for p in parts)
            for end in (src, dst):
                if end not in nodes:
                    raise ArtifactError(f"{where}: edge {src} -- {dst} names node {end!r}, which is not declared "
                                        "above; declare every node on its own line before the edges that use it")
            edges.append((src, dst, number))
        else:
            node = _parse_node(raw.strip(), where, number)
            if node.id in nodes:
                raise ArtifactError(f"{where}: node {node.id!r} is declared twice (first on line "
                                    f"{nodes[node.id].line}); give every node its own id")
            nodes[node.id] = node
    if not nodes:
        raise ArtifactError(f"{source}: no node lines; give a PipeDream graph.txt ({_FORMAT})")
    return nodes, edges


def _parse_node(line: str, where: str, number: int) -> _Node:
    parts = line.split(_SEPARATOR)
    if len(parts) < 3:
        raise ArtifactError(f"{where}: line {line!r:.80} is neither a node nor an edge; "
                            f"write {_FORMAT} (edge lines start with a tab)")
    if len(parts) > 4 or (len(parts) == 4 and not re.fullmatch(r"stage_id=\d+", parts[3].strip())):
        raise ArtifactError(f"{where}: node line has unexpected part {_SEPARATOR.join(parts[3:])!r:.60} after "
                            "the metadata; only ' -- stage_id=N' may follow it")
    node_id, desc, metadata = parts[0].strip(), parts[1].strip(), parts[2].strip()
    if not node_id or any(c.isspace() for c in node_id):
        raise ArtifactError(f"{where}: node id {node_id!r} is not a single word; use ids like node5")
    items = metadata.split(", ")
    keys = [item.partition("=")[0].strip() for item in items]
    if tuple(keys) != _KEYS or not all("=" in item for item in items):
        raise ArtifactError(f"{where}: the metadata of {node_id} has keys {', '.join(keys)!s:.120}; write exactly "
                            f"{'=..., '.join(_KEYS)}=... in this order")
    values = []
    for key, item in zip(_KEYS, items):
        text = item.partition("=")[2].strip()
        if key == "activation_size" and text.startswith("["):
            if not text.endswith("]"):
                raise ArtifactError(f"{where}: activation_size of {node_id} {text!r:.60} opens a list it does not "
                                    "close; write [a; b; c]")
            parts_ = [p.strip() for p in text[1:-1].split(";")]
        else:
            parts_ = [text]
        total = 0.0
        for part in parts_:
            try:
                value = float(part)
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and value >= 0):
                raise ArtifactError(f"{where}: {key} of {node_id} ({text!r:.60}) is not a non-negative number; "
                                    "fix the value (ms for times, bytes for sizes)")
            total += value
        values.append(total)
    return _Node(id=node_id, desc=desc, fwd_ms=values[0], bwd_ms=values[1], act_bytes=values[2],
                 param_bytes=values[3], line=number)


def _kind(desc: str) -> str:
    """The desc up to its first "(": `Conv2d(3, 64, ...)` -> `Conv2d`."""
    return desc.split("(", 1)[0].strip() or "unknown"


def _infer_batch_size(inputs: list[_Node], source: str) -> int:
    fix = ("graph.txt does not store it; give it with --batch-size N "
           "(the original's translation profiles, e.g. gnmt, used 64)")
    if len(inputs) != 1:
        found = "no Input node" if not inputs else f"{len(inputs)} Input nodes"
        raise ArtifactError(f"{source}: cannot infer the batch size ({found}; inference needs one image "
                            f"input of 3x224x224 float32); {fix}")
    size = inputs[0].act_bytes
    batch = size / IMAGE_INPUT_BYTES
    if size <= 0 or batch != int(batch):
        raise ArtifactError(f"{source}:{inputs[0].line}: cannot infer the batch size (Input is {size:.0f} bytes, "
                            f"not a multiple of one 3x224x224 float32 image, {IMAGE_INPUT_BYTES} bytes); {fix}")
    return int(batch)
