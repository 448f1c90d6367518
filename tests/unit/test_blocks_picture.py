"""The picture of a partition by blocks (`views.blocks`, `views.render.blocks_graph`, issue 35 item 17): one
cluster per stage, each run of identical blocks one node, at most 12 nodes a stage, every cut labelled."""
import re
import shutil
import struct

import pytest

from pdtool.artifacts.cluster import parse_cluster
from pdtool.artifacts.profile import Layer, Profile
from pdtool.planner import make_plan
from pdtool.units import format_bytes
from pdtool.views.blocks import MAX_GROUPS, block_of, block_sizes, stage_groups
from pdtool.views.render import blocks_graph, render_plan

BLOCK = [("input_layernorm", "LlamaRMSNorm"), ("self_attn.q_proj", "Linear"), ("self_attn.k_proj", "Linear"),
         ("self_attn.v_proj", "Linear"), ("self_attn.sdpa", "scaled_dot_product_attention"),
         ("self_attn.o_proj", "Linear"), ("post_attention_layernorm", "LlamaRMSNorm"), ("mlp.gate_proj", "Linear"),
         ("mlp.up_proj", "Linear"), ("mlp.down_proj", "Linear")]


def llama_like(blocks=16):
    """A decoder named as transformers' Llama is: embedding, `blocks` decoder layers of 10 layers, norm, head;
    every decoder layer also reads the embedding's output (a skip edge: rotary tables, masks)."""
    names = [("model.embed_tokens", "Embedding")]
    names += [(f"model.layers.{b}.{n}", k) for b in range(blocks) for n, k in BLOCK]
    names += [("model.norm", "LlamaRMSNorm"), ("lm_head", "Linear")]
    layers = tuple(Layer(id=i, name=n, kind=k, fwd_ms=1.0, bwd_ms=2.0, act_bytes=1024 * (i + 1), param_bytes=4096)
                   for i, (n, k) in enumerate(names))
    edges = {(i, i + 1) for i in range(len(layers) - 1)} | {(0, 1 + 10 * b) for b in range(1, blocks)}
    classes = {"model": "LlamaModel", "model.layers": "ModuleList"}
    classes.update({f"model.layers.{b}": "LlamaDecoderLayer" for b in range(blocks)})
    return Profile(model=None, batch_size=8, inputs=(), device="cpu", torch_version="", fingerprint="f" * 64,
                   method="export", granularity="module", depth=None, repeats=1, step_ms=0.0, step_ms_spread=0.0,
                   layers=layers, edges=tuple(sorted(edges)), classes=classes)


@pytest.fixture(scope="module")
def planned():
    profile = llama_like()
    plan = make_plan(profile, parse_cluster("4x1GB/s"), straight=True)
    assert len(plan.stages) == 4
    return plan, profile


def test_a_layers_block_is_the_prefix_to_its_first_numbered_part():
    assert block_of("model.layers.4.self_attn.q_proj") == ("model.layers.4", "model.layers", 4)
    assert block_of("encoder.block.1.layer.0.SelfAttention.q") == ("encoder.block.1", "encoder.block", 1)
    assert block_of("lm_head") == ("lm_head", None, None)
    assert block_of("3") == ("3", None, None)  # a layer of a root Sequential is a block of its own


def test_each_stage_folds_into_runs_of_identical_blocks(planned):
    plan, profile = planned
    names, kinds = [l.name for l in profile.layers], [l.kind for l in profile.layers]
    labels = []
    for stage in plan.stages:
        groups = stage_groups(stage.layers, names, kinds, profile.classes, block_sizes(names))
        assert 1 <= len(groups) <= MAX_GROUPS
        assert tuple(i for g in groups for i in g.layers) == tuple(stage.layers)  # every layer once, in order
        labels += [g.label for g in groups]
    runs = [label for label in labels if re.fullmatch(r"model\.layers\.\d+-\d+: \d+ x LlamaDecoderLayer", label)]
    assert len(runs) >= 3 and "model.embed_tokens: Embedding" in labels and "lm_head: Linear" in labels
    covered = sum(int(re.search(r": (\d+) x", label)[1]) for label in runs)
    assert covered >= 12  # most of the 16 decoder layers are drawn as runs, not one by one


def test_a_stage_of_many_distinct_layers_is_merged_down_to_the_cap():
    names = [f"part{i}" for i in range(40)]
    groups = stage_groups(tuple(range(40)), names, ["Linear"] * 40, {}, block_sizes(names))
    assert len(groups) == MAX_GROUPS and tuple(i for g in groups for i in g.layers) == tuple(range(40))
    assert any(re.fullmatch(r"part\d+ … part\d+: \d+ layers", g.label) for g in groups)


def test_the_picture_has_a_cluster_per_stage_and_labels_every_cut_with_its_bytes(planned):
    plan, profile = planned
    source = blocks_graph(plan, profile).source
    assert source.count("subgraph cluster_stage_") == 4
    stage_of = {i: s for s, stage in enumerate(plan.stages) for i in stage.layers}
    for s in range(4):
        block = re.search(rf"subgraph cluster_stage_{s} \{{(.*?)\n\t\}}", source, re.S)[1]
        assert 1 <= len(re.findall(r"^\s*S\d+G\d+ \[label=", block, re.M)) <= MAX_GROUPS
    cuts = {}
    for src, dst in profile.edges:
        if stage_of[src] != stage_of[dst]:
            cuts.setdefault((stage_of[src], stage_of[dst]), {})[src] = profile.layers[src].act_bytes
    drawn = re.findall(r"S(\d+)G\d+ -> S(\d+)G\d+ \[[^]]*lhead=cluster_stage_\d+[^]]*xlabel=\"([^\"]+)\"", source)
    assert {(int(a), int(b)): label for a, b, label in drawn} == {k: format_bytes(sum(v.values()))
                                                                   for k, v in cuts.items()}
    assert (0, 2) in cuts  # the skip edge from the embedding to later stages is a cut of its own


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_the_png_of_a_16_block_decoder_on_4_stages_fits_a_page_width(planned, tmp_path):
    plan, profile = planned
    written, warning = render_plan(plan, profile, tmp_path / "plan.png")
    width, height = struct.unpack(">II", written.read_bytes()[16:24])
    assert warning is None and width <= 1800 and height <= 900, (width, height)
    layers_picture, _ = render_plan(plan, profile, tmp_path / "layers.dot", layers=True)
    assert "L100 [label=" in layers_picture.read_text()  # the layer-level drawing, behind a flag
