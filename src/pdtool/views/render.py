"""Graphviz pictures of a plan: the profile's layer graph cut into the plan's stages.

Two pictures, both graphviz source (pure text, deterministic: the same plan and profile give
the same `.dot` text), which `render_plan` writes as SVG, PNG, PDF or the `.dot` source itself,
choosing by the file name's extension, atomically:

- `blocks_graph` (the default): each stage a coloured box of its layers grouped by the model's
  own hierarchy (`views.blocks`: runs of identical blocks one node, "model.layers.4-7: 4 x
  LlamaDecoderLayer", at most 12 nodes a stage), each node with its layers' time and parameter
  bytes, and every edge that crosses a stage boundary labelled with the bytes it sends per
  minibatch: what a partition of a 163-layer model looks like at a glance;
- `plan_graph` (`layers=True`, `pd show --render ... --layers`): every layer a node.

This is the only module that imports the `graphviz` package; laying out needs graphviz's
`dot` program, and without it `render_plan` writes the `.dot` source and says how to render it
by hand.

Layout of the layer picture: one node per layer (name, kind, forward + backward ms), one coloured `cluster_stage_S`
box per stage holding the stage's layers (a set of layer ids: on a branchy graph not always a
contiguous range), read like newspaper columns: layers run top to bottom inside a column, and
stages stand side by side from left to right. A stage of more than `MAX_ROWS` layers wraps
into several columns inside its box, so a 100-layer model fits a landscape page instead of
a 100-node strip. Edges that cross a stage boundary (what the pipeline sends) are heavy and
labelled with the bytes of the source layer's output per minibatch; edges inside a stage are
thin and unlabelled. The bottleneck stage has a bold red border.

Edges between columns do not constrain the ranks, so every column starts at the top; their
labels (bytes, tied weights) are external labels (`xlabel`), placed after the layout. Labels
that take part in the layout, or a `newrank` row of column heads across the stage boxes, make
graphviz's `dot` fail ("trouble in init_rank") or crash on plans whose stages interleave (a
stage's layer ids between another's, as on a transformer cut inside an attention block).
`dot` runs quietly; when it fails, `render_plan` says so in one line with its first error.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import signal
from pathlib import Path

import graphviz

from ..errors import PdtoolError
from ..jsonio import check_writable, write_bytes_atomic, write_text_atomic
from ..artifacts.plan import Plan, PlanStage, check_against_profile, compact_ranges
from ..artifacts.profile import Layer, Profile
from ..units import format_bytes
from .blocks import block_sizes, stage_groups

FORMATS = ("svg", "png", "pdf", "dot")
"""Picture formats `render_plan` writes, by file extension; "dot" is graphviz's source text."""

MAX_ROWS = 30
"""Most layers in one column (more on graphs of over 450 layers: sqrt(2 x layers), to keep the
picture about twice as wide as tall); a longer stage wraps into equal columns."""

SHORT_LABELS_FROM = 200
"""From this many layers on, a node shows only its (shortened) name and total ms."""

SHORT_NAME_CHARS = 24
"""Longest layer name shown on a short label; longer names keep their start and end."""

STAGE_COLOURS = ("#dbe9f6", "#fde0c5", "#d5f0d5", "#ece0f4", "#fff4c2", "#d2efee", "#f9d9e6", "#e4e4e4")
"""Fill colours of the stage boxes (pastels, cycled); nodes are white on top of them."""

BOTTLENECK_COLOUR = "#d62728"
_BOTTLENECK_RE = re.compile(r"^stage (\d+)\b")


TIED_COLOUR = "#7b2cbf"
"""Colour of the dashed lines between layers that use one parameter (tied weights)."""


def plan_graph(plan: Plan, profile: Profile) -> graphviz.Digraph:
    """The picture of `plan` over the layer graph of `profile`, as graphviz source.

    Raises `ArtifactError` when the plan was not made from this profile (sha256 or layer
    count differ). Deterministic: nodes, clusters and edges appear in layer/stage order.
    """
    check_against_profile(plan, profile)
    stage_of = [0] * len(profile.layers)
    for index, stage in enumerate(plan.stages):
        for layer_id in stage.layers:
            stage_of[layer_id] = index
    column_of = _columns(plan, max(MAX_ROWS, math.ceil(math.sqrt(2 * len(profile.layers)))))
    bottleneck = _bottleneck_stage(plan)
    short = len(profile.layers) >= SHORT_LABELS_FROM

    graph = graphviz.Digraph(name="plan")
    graph.attr("graph", rankdir="TB", nodesep="0.2", ranksep="0.22",
               fontname="Helvetica", fontsize="16", labelloc="t", labeljust="l",
               label=_title(plan, profile))
    graph.attr("node", shape="box", style="rounded,filled", fillcolor="white", color="#555555",
               fontname="Helvetica", fontsize="10", margin="0.08,0.03", height="0.3")
    graph.attr("edge", color="#777777", arrowsize="0.6", fontname="Helvetica", fontsize="10")

    for index, stage in enumerate(plan.stages):
        is_bottleneck = index == bottleneck
        with graph.subgraph(name=f"cluster_stage_{index}") as box:
            box.attr(label=_stage_label(index, stage, plan, is_bottleneck), fontsize="13",
                     fontcolor=BOTTLENECK_COLOUR if is_bottleneck else "black",
                     style="filled,rounded,bold" if is_bottleneck else "filled,rounded",
                     fillcolor=_colour(plan, index),
                     color=BOTTLENECK_COLOUR if is_bottleneck else "#888888",
                     penwidth="4" if is_bottleneck else "1", margin="12")
            for layer in (profile.layers[i] for i in stage.layers):
                box.node(_node(layer.id), _node_label(layer, short), tooltip=_tooltip(layer))

    column = {layer_id: c for c, ids in enumerate(column_of) for layer_id in ids}
    for src, dst in profile.edges:
        same_column = column[src] == column[dst]
        attrs = {} if same_column else {"constraint": "false"}
        if stage_of[src] != stage_of[dst]:
            graph.edge(_node(src), _node(dst), xlabel=format_bytes(profile.layers[src].act_bytes),
                       penwidth="2.5", color="#222222", fontcolor="#222222", arrowsize="0.9", **attrs)
        else:
            graph.edge(_node(src), _node(dst), **attrs)
    for name, layers in profile.shared:  # tied weights: a dashed line between the layers that share one
        for other in layers[1:]:
            graph.edge(_node(layers[0]), _node(other), xlabel=f"tied: {_text(name)}", style="dashed", dir="none",
                       color=TIED_COLOUR, fontcolor=TIED_COLOUR, constraint="false", penwidth="1.5")
    return graph


def blocks_graph(plan: Plan, profile: Profile) -> graphviz.Digraph:
    """The picture of `plan` with each stage's layers grouped into blocks (`views.blocks`), as
    graphviz source. Raises `ArtifactError` when the plan was not made from this profile."""
    check_against_profile(plan, profile)
    names = [layer.name for layer in profile.layers]
    kinds = [layer.kind for layer in profile.layers]
    sizes = block_sizes(names)
    bottleneck = _bottleneck_stage(plan)
    graph = graphviz.Digraph(name="plan")
    graph.attr("graph", rankdir="TB", nodesep="0.25", ranksep="0.3", fontname="Helvetica", fontsize="16",
               labelloc="t", labeljust="l", label=_title(plan, profile), compound="true")
    graph.attr("node", shape="box", style="rounded,filled", fillcolor="white", color="#555555",
               fontname="Helvetica", fontsize="12", margin="0.1,0.05")
    graph.attr("edge", color="#777777", arrowsize="0.7", fontname="Helvetica", fontsize="13")
    group_of: dict[int, str] = {}
    nodes: list[list[str]] = []
    for index, stage in enumerate(plan.stages):
        is_bottleneck = index == bottleneck
        nodes.append([])
        with graph.subgraph(name=f"cluster_stage_{index}") as box:
            box.attr(label=_stage_label(index, stage, plan, is_bottleneck, wrap=True), fontsize="13",
                     fontcolor=BOTTLENECK_COLOUR if is_bottleneck else "black",
                     style="filled,rounded,bold" if is_bottleneck else "filled,rounded",
                     fillcolor=_colour(plan, index),
                     color=BOTTLENECK_COLOUR if is_bottleneck else "#888888",
                     penwidth="4" if is_bottleneck else "1", margin="12")
            for number, group in enumerate(stage_groups(stage.layers, names, kinds, profile.classes, sizes)):
                node = f"S{index}G{number}"
                layers = [profile.layers[i] for i in group.layers]
                figures = (f"{len(layers)} layer{'s' if len(layers) != 1 else ''} · "
                           f"{_ms(sum(layer.total_ms for layer in layers))} ms · "
                           f"{format_bytes(sum(layer.param_bytes for layer in layers))}")
                box.node(node, f"{_text(group.name)}\n{_text(group.what)}\n{figures}", tooltip=_text(group.label))
                if nodes[index]:
                    box.edge(nodes[index][-1], node)  # the stage's groups in order, top to bottom
                nodes[index].append(node)
                group_of.update((layer, index) for layer in group.layers)
    sent: dict[tuple[int, int], dict[int, int]] = {}
    for src, dst in profile.edges:  # each layer output counted once per receiving stage
        if group_of[src] != group_of[dst]:
            sent.setdefault((group_of[src], group_of[dst]), {})[src] = profile.layers[src].act_bytes
    for (a, b), outputs in sorted(sent.items()):
        graph.edge(nodes[a][-1], nodes[b][0], ltail=f"cluster_stage_{a}", lhead=f"cluster_stage_{b}",
                   xlabel=format_bytes(sum(outputs.values())), penwidth="2.5", color="#222222", fontcolor="#222222",
                   arrowsize="0.9", constraint="false")
    return graph


def render_plan(plan: Plan, profile: Profile, path: str | os.PathLike, layers: bool = False) -> tuple[Path, str | None]:
    """Write the picture of `plan` over `profile` to `path` (`blocks_graph`, or every layer with
    `layers`: `plan_graph`); the format is its extension.

    Returns the file actually written and a warning line or None. When graphviz's `dot`
    program is missing, the `.dot` source goes next to `path` (same stem) and the warning says
    how to install graphviz and render it by hand. Raises `PdtoolError` for an extension not in
    `FORMATS`, a folder that cannot be written, or a `dot` that fails (its first error line;
    nothing is written), `ArtifactError` when the plan was not made from `profile`.
    """
    target = Path(path)
    fmt = target.suffix[1:].lower()
    if fmt not in FORMATS:
        found = f"unknown picture format {target.suffix!r}" if target.suffix else "no extension to say the format"
        raise PdtoolError(f"cannot render {target}: {found}; "
                          f"end the file name with one of {', '.join('.' + f for f in FORMATS)}")
    check_writable(target)
    graph = plan_graph(plan, profile) if layers else blocks_graph(plan, profile)
    if fmt == "dot":
        write_text_atomic(target, graph.source)
        return target, None
    source_path = target.with_suffix(".dot")
    if shutil.which("dot") is None:
        return _fallback(graph, target, source_path, fmt, "graphviz's `dot` program is not installed")
    try:
        picture = graph.pipe(format=fmt, engine="dot", quiet=True)  # dot's warnings are not pd's talk
    except graphviz.ExecutableNotFound:
        return _fallback(graph, target, source_path, fmt, "graphviz's `dot` program is not installed")
    except graphviz.CalledProcessError as exc:
        raise PdtoolError(f"graphviz's `dot` could not draw {target} ({first_error(exc.stderr, exc.returncode)}); "
                          f"--render {source_path.name} writes the picture's source instead, to lay out with "
                          "another graphviz version or engine") from None
    write_bytes_atomic(target, picture)
    return target, None


def first_error(stderr: bytes | str | None, returncode: int) -> str:
    """The line of a failed graphviz run that says why: its first `Error` line, else its first
    line, else how the program ended (an exit status, or the signal that killed it)."""
    text = stderr.decode("utf-8", "replace") if isinstance(stderr, bytes) else stderr or ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower() or "assertion" in line.lower():
            return line
    if lines:
        return lines[0]
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


# ----- pieces ----------------------------------------------------------------------------------
def _columns(plan: Plan, rows: int) -> list[tuple[int, ...]]:
    """The layer ids of every column: each stage's layers split into equal runs of <= `rows`."""
    columns = []
    for stage in plan.stages:
        count = len(stage.layers)
        pieces = math.ceil(count / rows)
        size = math.ceil(count / pieces)
        for start in range(0, count, size):
            columns.append(stage.layers[start:start + size])
    return columns


def _bottleneck_stage(plan: Plan) -> int | None:
    """Index of the bottleneck stage, or None when the bottleneck is an outer-level group."""
    match = _BOTTLENECK_RE.match(plan.predicted.bottleneck)
    return int(match[1]) if match and int(match[1]) < len(plan.stages) else None


def _node(layer_id: int) -> str:
    return f"L{layer_id}"


def _ms(value: float) -> str:
    """Milliseconds with 3 significant digits, never in exponent notation."""
    if value == 0:
        return "0"
    digits = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:.{digits}f}"


def _colour(plan: Plan, index: int) -> str:
    """Stage `index`'s fill: one colour a stage, or (several stages a worker) one colour a worker,
    so that a worker's chunks are visibly its own."""
    key = plan.placement[index] if plan.placement else index
    return STAGE_COLOURS[key % len(STAGE_COLOURS)]


def _stage_label(index: int, stage: PlanStage, plan: Plan, is_bottleneck: bool, wrap: bool = False) -> str:
    """'stage S: layers a-b, R replicas (ranks ...), T ms', plus the recomputation and bottleneck
    marks; `wrap`: the layers and the rest on lines of their own (a narrow box)."""
    replicas = f"{stage.replicas} replica{'s' if stage.replicas != 1 else ''}"
    rank_word = "ranks" if stage.replicas != 1 else "rank"
    where = f"layers {compact_ranges(stage.layers)}", f"{replicas} ({rank_word} {compact_ranges(stage.ranks)})"
    if wrap:
        label = f"stage {index}: {_ms(stage.time_ms)} ms\\l{where[0]}\\l{where[1]}\\l"
    else:
        label = f"stage {index}: {where[0]}, {where[1]}, {_ms(stage.time_ms)} ms\\l"
    if plan.placement:
        label += f"chunk {plan.placement[:index].count(plan.placement[index]) + 1} of rank {stage.ranks[0]}\\l"
    if stage.recompute:
        label += "recomputes its activations (keeps only its input per minibatch in flight)\\l"
    if is_bottleneck:
        label += f"BOTTLENECK: {plan.predicted.bottleneck}\\l"
    for name, stages in plan.shared:
        if index in stages:
            label += f"tied: {_text(name)} (a copy on stages {', '.join(map(str, stages))})\\l"
    return label


def _text(text: str) -> str:
    """`text` shown literally in a label (a backslash in a name is not a graphviz escape)."""
    return text.replace("\\", "\\\\")


def _short_name(name: str) -> str:
    if len(name) <= SHORT_NAME_CHARS:
        return name
    keep = SHORT_NAME_CHARS - 1
    return name[:keep // 2] + "…" + name[-(keep - keep // 2):]


def _node_label(layer: Layer, short: bool) -> str:
    if short:
        return f"{_text(_short_name(layer.name))} {_ms(layer.total_ms)} ms"
    return f"{_text(layer.name)}\\n{_text(layer.kind)} · {_ms(layer.fwd_ms)}+{_ms(layer.bwd_ms)} ms"


def _tooltip(layer: Layer) -> str:
    """What hovering a node in an SVG shows: the layer's full figures."""
    return (f"layer {layer.id} {_text(layer.name)} ({_text(layer.kind)}): "
            f"fwd {layer.fwd_ms:g} ms, bwd {layer.bwd_ms:g} ms, "
            f"output {format_bytes(layer.act_bytes)}, parameters {format_bytes(layer.param_bytes)}")


def _title(plan: Plan, profile: Profile) -> str:
    """The picture's heading: model, plan shape and the prediction (the simulated one, as `pd show`
    and `pd plan` print it, with the cost model's beside it)."""
    pred = plan.predicted
    model = _text(profile.model.spec) if profile.model else "imported profile"
    lines = [
        f"{model}: {len(profile.layers)} layers, batch {profile.batch_size}, {len(plan.stages)} "
        f"stage{'s' if len(plan.stages) != 1 else ''} on "
        f"{plan.workers} workers ({plan.cluster.describe()}), mode {plan.mode}",
        f"predicted {_ms(pred.expected_ms)} ms per minibatch"
        + (f" (simulated; cost model {_ms(pred.time_ms)} ms)" if pred.simulated_ms is not None else "")
        + f", bottleneck: {pred.bottleneck}; edge labels: bytes sent per minibatch",
    ]
    lines += [f"level-{g.level} group: layers {compact_ranges(g.layers)} on {g.units} units, {_ms(g.time_ms)} ms"
              for g in plan.groups]
    return "".join(f"{line}\\l" for line in lines)


def _fallback(graph: graphviz.Digraph, target: Path, source_path: Path, fmt: str, why: str) -> tuple[Path, str]:
    """Write the `.dot` source instead of the picture, and the warning line that says so."""
    write_text_atomic(source_path, graph.source)
    return source_path, (f"{why}, so {source_path} holds the picture's graphviz source instead of {target}; "
                         f"install graphviz (apt-get install graphviz) and render it by hand with "
                         f"`dot -T{fmt} {source_path} -o {target}`")


