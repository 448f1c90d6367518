import hashlib
import json
from pathlib import Path

import networkx as nx
import pytest

from pdtool.errors import ArtifactError
from pdtool.jsonio import canonical_json
from pdtool.artifacts.pipedream import DEVICE, layer_order, load_pipedream_graph
from pdtool.artifacts.profile import Profile

PROFILES = Path(__file__).resolve().parents[2] / "profiles" / "pipedream"  # the original's published profiles

# model: (nodes, edges, inputs, edges from inputs, batch, sum F+B ms, sum params MB) per the reference table
REFERENCE = {
    "alexnet": (23, 23, 1, 1, 256, 85.3, 244.4),
    "vgg16": (41, 41, 1, 1, 128, 672.5, 553.4),
    "resnet18": (71, 79, 1, 1, 256, 259.7, 46.8),
    "gnmt": (48, 58, 3, 4, 64, 89.4, 775.1),
}


def graph_file(model: str) -> Path:
    return PROFILES / f"{model}.graph.txt"


def load(model: str) -> Profile:
    return load_pipedream_graph(graph_file(model), 64 if model == "gnmt" else None)


# ----- the four shipped profiles ---------------------------------------------------------------------
@pytest.mark.parametrize("model", sorted(REFERENCE))
def test_shipped_profiles_match_the_reference_table(model):
    nodes, edges, inputs, input_edges, batch, total_ms, params_mb = REFERENCE[model]
    profile = load(model)
    assert len(profile.layers) == nodes - inputs
    assert len(profile.edges) == edges - input_edges
    assert profile.batch_size == batch
    assert profile.layer_sum_ms == pytest.approx(total_ms, abs=0.05)
    assert profile.param_bytes / 1e6 == pytest.approx(params_mb, abs=0.05)
    assert all(src < dst for src, dst in profile.edges)
    assert nx.is_directed_acyclic_graph(nx.DiGraph(profile.edges))


@pytest.mark.parametrize("model", sorted(REFERENCE))
def test_shipped_profile_metadata(model):
    profile = load(model)
    assert profile.method == "pipedream" and profile.model is None and profile.granularity == "module"
    assert profile.depth is None and profile.repeats == 0 and profile.step_ms == 0.0
    assert profile.step_ms_spread == 0.0 and profile.inputs == () and profile.torch_version == ""
    assert profile.device == DEVICE
    assert profile.fingerprint == hashlib.sha256(graph_file(model).read_bytes()).hexdigest()
    assert not any(layer.kind.startswith("Input") for layer in profile.layers)


@pytest.mark.parametrize("model", ["alexnet", "vgg16", "resnet18"])
def test_image_batch_size_is_inferred(model):
    assert load_pipedream_graph(graph_file(model)).batch_size == REFERENCE[model][4]


def test_given_batch_size_wins():
    assert load_pipedream_graph(graph_file("alexnet"), batch_size=32).batch_size == 32


def test_gnmt_needs_a_batch_size():
    with pytest.raises(ArtifactError) as info:
        load_pipedream_graph(graph_file("gnmt"))
    message = str(info.value)
    assert "\n" not in message and "--batch-size" in message and "gnmt" in message


@pytest.mark.parametrize("model", sorted(REFERENCE))
def test_round_trip_through_json(model, tmp_path):
    profile = load(model)
    assert Profile.from_json(profile.to_json()) == profile
    assert Profile.from_json(json.loads(canonical_json(profile.to_json()))) == profile
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile


@pytest.mark.parametrize("model", sorted(REFERENCE))
def test_import_is_deterministic(model):
    first, second = load(model), load(model)
    assert first == second
    assert canonical_json(first.to_json()) == canonical_json(second.to_json())


def test_layer_fields_come_from_the_node_line():
    profile = load("alexnet")
    by_name = {layer.name: layer for layer in profile.layers}
    conv = by_name["node2"]
    assert conv.id == 0 and conv.kind == "Conv2d"
    assert conv.ops == ("Conv2d(3, 64, kernel_size=(11, 11), stride=(4, 4), padding=(2, 2))",)
    assert (conv.fwd_ms, conv.bwd_ms, conv.act_bytes, conv.param_bytes) == (22.316, 6.405, 198246400, 93184)
    assert by_name["node3"].kind == "ReLU" and by_name["node15"].kind == "Size"
    assert [layer.name for layer in profile.layers] == [f"node{i}" for i in range(2, 24)]


def test_gnmt_lists_are_summed_and_sources_go_late():
    profile = load("gnmt")
    by_name = {layer.name: layer for layer in profile.layers}
    assert by_name["node7"].act_bytes == 6291456 + 131072 + 131072
    assert by_name["node23"].act_bytes == 6160384 + 131072 + 131072 + 6160384 + 288768
    assert by_name["node5"].kind == "EmuBidirLSTM" and by_name["node20"].kind == "hidden"
    assert by_name["node8"].kind == "__getitem__"
    names = [layer.name for layer in profile.layers]
    # the second Embedding (on Input2) and the hidden source sit right before RecurrentAttention
    assert names[0] == "node4"
    assert names.index("node21") > names.index("node19") and names.index("node20") > names.index("node19")
    assert names.index("node23") == names.index("node19") + 4
    # hidden's other __getitem__ consumers each sit right before their LSTM
    for getter, lstm in (("node30", "node31"), ("node36", "node37"), ("node43", "node44")):
        assert names.index(lstm) == names.index(getter) + 1


# ----- the order rule on small graphs ----------------------------------------------------------------
def test_layer_order_is_topological_by_node_number():
    graph = nx.DiGraph([("node10", "node3"), ("node3", "node7"), ("node10", "node7")])
    assert layer_order(graph) == ["node10", "node3", "node7"]
    graph = nx.DiGraph([("node1", "node5"), ("node1", "node3"), ("node3", "node9"), ("node5", "node9")])
    assert layer_order(graph) == ["node1", "node3", "node5", "node9"]


def test_layer_order_places_side_sources_right_before_their_consumer():
    # main chain 1 -> 2 -> 3 -> 4 -> 5; side source 0 (lowest number) feeds 4 only; side chain 6 -> 7 -> 5
    graph = nx.DiGraph([("node1", "node2"), ("node2", "node3"), ("node3", "node4"), ("node4", "node5"),
                        ("node0", "node4"), ("node6", "node7"), ("node7", "node5")])
    assert layer_order(graph) == ["node1", "node2", "node3", "node0", "node4", "node6", "node7", "node5"]


def test_layer_order_puts_unconnected_side_parts_last():
    graph = nx.DiGraph([("node1", "node2"), ("node2", "node3"), ("node5", "node6")])
    assert layer_order(graph) == ["node1", "node2", "node3", "node5", "node6"]


# ----- errors on hand-written files ----------------------------------------------------------------
META = "forward_compute_time=1.000, backward_compute_time=2.000, activation_size=8.000, parameter_size=4.000"
INPUT = "node1 -- Input -- forward_compute_time=600.0, backward_compute_time=0.000, activation_size=1204224.0, " \
        "parameter_size=0.000"


def write(tmp_path, *lines: str) -> Path:
    path = tmp_path / "graph.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_small_file_with_list_stage_id_blank_line_and_duplicate_edge(tmp_path):
    path = write(tmp_path, INPUT,
                 "node3 -- ReLU(inplace) -- forward_compute_time=1.0, backward_compute_time=2.0, "
                 "activation_size=[1.0; 2.5; 3.5], parameter_size=0.000 -- stage_id=1",
                 "node2 -- Conv2d(3, 8) -- " + META + " -- stage_id=0",
                 "",
                 "\tnode1 -- node2", "\tnode2 -- node3", "\tnode2 -- node3")
    profile = load_pipedream_graph(path)
    assert profile.batch_size == 2  # 1204224 bytes = two 3x224x224 float32 images
    assert [layer.name for layer in profile.layers] == ["node2", "node3"]
    assert profile.layers[1].act_bytes == 7 and profile.layers[0].param_bytes == 4
    assert profile.edges == ((0, 1),)


def test_input_with_a_producer_is_kept_as_a_layer(tmp_path):
    path = write(tmp_path, "node1 -- Conv -- " + META, "node2 -- Input_ish -- " + META, "\tnode1 -- node2")
    profile = load_pipedream_graph(path, batch_size=4)
    assert [layer.name for layer in profile.layers] == ["node1", "node2"]


@pytest.mark.parametrize("lines, fragment", [
    (["node1 -- A -- " + META, "hello world"], ":2: line 'hello world' is neither a node nor an edge"),
    (["node1 -- A -- " + META, "\tnode1 -- node2"],
     ":2: edge node1 -- node2 names node 'node2', which is not declared"),
    (["\tnode1 -- node2", "node1 -- A -- " + META, "node2 -- B -- " + META], ":1: edge node1 -- node2 names node"),
    (["node1 -- A -- " + META, "\tnode1"], ":2: edge line 'node1' is malformed"),
    (["node1 -- A -- " + META, "node1 -- B -- " + META], ":2: node 'node1' is declared twice (first on line 1)"),
    (["node1 -- A -- " + META, "node2 -- B -- " + META, "\tnode1 -- node2", "\tnode2 -- node1"],
     ":3: the edges form a cycle"),
    (["node1 -- A -- " + META, "\tnode1 -- node1"], ":2: the edges form a cycle"),
    (["node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1"], ":1: the metadata of node1"),
    (["node1 -- A -- backward_compute_time=1, forward_compute_time=1, activation_size=1, parameter_size=1"],
     ":1: the metadata of node1"),
    (["node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=1, x=2"],
     ":1: the metadata of node1"),
    (["node1 -- A -- forward_compute_time=1,backward_compute_time=1,activation_size=1,parameter_size=1"],
     ":1: the metadata of node1"),
    (["node1 -- A -- forward_compute_time=fast, backward_compute_time=1, activation_size=1, parameter_size=1"],
     ":1: forward_compute_time of node1 ('fast') is not a non-negative number"),
    (["node1 -- A -- forward_compute_time=1, backward_compute_time=-1, activation_size=1, parameter_size=1"],
     ":1: backward_compute_time of node1 ('-1') is not a non-negative number"),
    (["node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=[1; x], parameter_size=1"],
     ":1: activation_size of node1"),
    (["node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=[1; 2, parameter_size=1"],
     ":1: activation_size of node1"),
    (["node1 -- A -- " + META + " -- color=red"], ":1: node line has unexpected part 'color=red'"),
    (["node1 -- A"], ":1: line 'node1 -- A' is neither a node nor an edge"),
    ([INPUT], "has no nodes besides Input nodes"),
    ([], "no node lines"),
])
def test_errors_name_file_line_and_fix(tmp_path, lines, fragment):
    path = write(tmp_path, *lines)
    with pytest.raises(ArtifactError) as info:
        load_pipedream_graph(path, batch_size=1)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path)) and fragment in message
    assert ";" in message  # what, then how to fix it


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(ArtifactError, match="no such file"):
        load_pipedream_graph(tmp_path / "nope.txt")
    with pytest.raises(ArtifactError, match="is a folder"):
        load_pipedream_graph(tmp_path)


def test_not_text(tmp_path):
    path = tmp_path / "graph.txt"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ArtifactError, match="not a text file"):
        load_pipedream_graph(path, batch_size=1)


@pytest.mark.parametrize("lines, fragment", [
    (["node1 -- A -- " + META], "no Input node"),
    ([INPUT.replace("1204224.0", "1000.0"), "node2 -- A -- " + META, "\tnode1 -- node2"], "not a multiple"),
    ([INPUT.replace("1204224.0", "0.0"), "node2 -- A -- " + META, "\tnode1 -- node2"], "not a multiple"),
])
def test_batch_size_that_cannot_be_inferred(tmp_path, lines, fragment):
    with pytest.raises(ArtifactError) as info:
        load_pipedream_graph(write(tmp_path, *lines))
    assert fragment in str(info.value) and "--batch-size" in str(info.value)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_batch_size(tmp_path, bad):
    with pytest.raises(ArtifactError, match="batch size must be a whole number"):
        load_pipedream_graph(write(tmp_path, "node1 -- A -- " + META), batch_size=bad)
