"""`pd export-plan --to torchtitan|megatron|pipelining` (issue 39 item 1): a plan's partition and schedule as
the settings other runtimes read; what they cannot express is refused or approximated in one line, and the
time of what they run is pd simulate's."""
import dataclasses
import json
import re
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from pdtool.artifacts.cluster import parse_cluster
from pdtool.artifacts.profile import Layer, ModelRef, Profile
from pdtool.cli import cli
from pdtool.errors import PlanError
from pdtool.planner import make_plan
from pdtool.planner.chunks import make_chunked_plan
from pdtool.schedule.torch_csv import read_csv
from pdtool.sim.simulate import simulate
from pdtool.targets import formats
from pdtool.targets.export import exported
from pdtool.targets.units import module_unit, module_units

BLOCK = [("attention_norm", "RMSNorm"), ("attention.wq", "Linear"), ("attention.wk", "Linear"),
         ("attention.wv", "Linear"), ("attention.scaled_dot_product_attention", "scaled_dot_product_attention"),
         ("attention.wo", "Linear"), ("ffn_norm", "RMSNorm"), ("feed_forward.w1", "Linear"),
         ("feed_forward.w3", "Linear"), ("feed_forward.w2", "Linear")]


def titan(blocks=8, whole=True, hf=False):
    """A profile named as torchtitan's Llama is (tok_embeddings, layers.N of a ModuleDict, norm, output);
    `whole`: every block one layer (pd profile --depth 2); `hf`: transformers' names instead
    (model.embed_tokens, model.layers.N, model.norm, lm_head)."""
    if hf:
        names = [("model.embed_tokens", "Embedding")] + [
            (f"model.layers.{b}.{n}", k) for b in range(blocks) for n, k in BLOCK] + [
            ("model.norm", "LlamaRMSNorm"), ("lm_head", "Linear")]
        classes = {"model": "LlamaModel", "model.layers": "ModuleList"}
    else:
        names = [("tok_embeddings", "Embedding")] + [
            item for b in range(blocks)
            for item in ([(f"layers.{b}", "TransformerBlock")] if whole else
                         [(f"layers.{b}.{n}", k) for n, k in BLOCK])] + [("norm", "RMSNorm"), ("output", "Linear")]
        classes = {"layers": "ModuleDict"}
    scale = 1 if whole and not hf else 10
    layers = tuple(Layer(id=i, name=n, kind=k, fwd_ms=(10.0 if "layers" in n else 4.0) / scale,
                         bwd_ms=(20.0 if "layers" in n else 8.0) / scale, act_bytes=65536,
                         param_bytes=1 << 20 if k != "scaled_dot_product_attention" else 0)
                   for i, (n, k) in enumerate(names))
    edges = tuple((i, i + 1) for i in range(len(layers) - 1))
    return Profile(model=ModelRef("pdtool.zoo:llama", {"layers": blocks}), batch_size=4, inputs=(),
                   device="cpu", torch_version="", fingerprint="f" * 64, method="fx", granularity="module",
                   depth=2 if whole else None, repeats=1, step_ms=1.0, step_ms_spread=0.0, layers=layers, edges=edges,
                   classes=classes)


PROFILE = titan()


def plan_of(mode, workers=4, profile=PROFILE, **options):
    if mode in ("interleaved", "zbv", "dualpipev"):
        return make_chunked_plan(profile, parse_cluster(f"{workers}x10GB/s"), chunks=2, mode=mode, group=8, **options)
    return make_plan(profile, parse_cluster(f"{workers}x10GB/s"), straight=True, mode=mode, every_worker=True,
                     **options)


def test_units_are_top_level_modules_and_entries_of_top_level_containers():
    assert module_unit("layers.3.attention.wq", "Linear", {"layers": "ModuleDict"}) == "layers.3"
    assert module_unit("layers.3", "TransformerBlock", {}) == "layers.3"
    assert module_unit("blocks.0.ln1", "LayerNorm", {}) == "blocks.0"          # a Sequential without classes
    assert module_unit("encoder.attn.q", "Linear", {"encoder": "Encoder"}) == "encoder"
    assert module_unit("tok_embeddings", "Embedding", {}) == "tok_embeddings"
    assert module_unit("add_3", "add", {}) is None                            # an op of the root's forward
    assert [u.name for u in module_units(titan(2, whole=False))] == ["tok_embeddings", "layers.0", "layers.1",
                                                                      "norm", "output"]


def _modules(export):
    return [name for names in export.modules for name in names]


@pytest.mark.parametrize("mode, schedule", [("flush", "1F1B"), ("gpipe", "GPipe"), ("interleaved", "Interleaved1F1B"),
                                            ("zbv", "ZBVZeroBubble"), ("dualpipev", "DualPipeV"),
                                            ("zb", "PipelineScheduleMulti")])
def test_torchtitan_gets_every_module_once_in_order_and_the_schedule_of_the_mode(mode, schedule):
    plan = plan_of(mode)
    export = exported(plan, PROFILE, "torchtitan")
    assert export.schedule == schedule and not export.notes and export.csv == (mode == "zb")
    assert _modules(export) == [u.name for u in module_units(PROFILE)]
    assert len(export.modules) == len(plan.stages)
    for names, stage in zip(export.modules, plan.stages):  # each stage's names are exactly its layers
        assert list(names) == [PROFILE.layers[i].name for i in stage.layers]
    toml = tomllib.loads(formats.torchtitan(export, "pd export-plan p --to torchtitan -o f", "f.csv" if export.csv
                                            else None))
    parallelism = toml["parallelism"]
    assert parallelism["pipeline_parallel_schedule"] == schedule
    assert parallelism["module_fqns_per_model_part"] == [list(m) for m in export.modules]
    assert parallelism["pipeline_parallel_degree"] == 4 == export.pipeline == len(plan.used_ranks)
    assert parallelism["pipeline_parallel_microbatch_size"] == 4
    assert toml["training"]["local_batch_size"] == 4 * plan.run().group
    assert ("pipeline_parallel_schedule_csv" in parallelism) == (mode == "zb")
    assert export.target_ms == pytest.approx(plan.predicted.simulated_ms, rel=1e-3)


def test_torchtitan_0_3s_overrides_carry_the_same_settings(monkeypatch):
    export = exported(plan_of("zbv"), PROFILE, "torchtitan")
    words = formats.torchtitan_overrides(export, None)
    at = words.index("--parallelism.module_fqns_per_model_part")
    parts = words[at + 1:words.index("--parallelism.data_parallel_replicate_degree")]
    assert [p.split(",") for p in parts] == [list(m) for m in export.modules]
    assert words[words.index("--parallelism.pipeline_parallel_schedule") + 1] == "ZBVZeroBubble"
    assert " ".join(words) in formats.torchtitan(export, "c", None)
    manager = pytest.importorskip("torchtitan.config.manager")  # 0.3.0 installs with --no-deps (+ tyro) on CPU
    import tyro
    from torchtitan.config.configs import ParallelismConfig

    manager.ConfigManager()  # registers its parsing rules
    prefix = "--parallelism."
    args = ["--" + w[len(prefix):] if w.startswith(prefix) else w
            for w in words[:words.index("--training.local_batch_size")]]
    parsed = tyro.cli(ParallelismConfig, args=args, registry=manager.custom_registry)
    assert parsed.module_fqns_per_model_part == [list(m) for m in export.modules]
    assert parsed.pipeline_parallel_degree == 4 and parsed.pipeline_parallel_schedule == "ZBVZeroBubble"


def test_v_and_looped_chunks_keep_their_pipeline_ranks():
    zbv = exported(plan_of("zbv"), PROFILE, "pipelining")
    assert zbv.stage_ranks == (0, 1, 2, 3, 3, 2, 1, 0)
    looped = exported(plan_of("interleaved"), PROFILE, "pipelining")
    assert looped.stage_ranks == (0, 1, 2, 3, 0, 1, 2, 3)
    record = json.loads(formats.pipelining(zbv, "cmd", "p.json", None, None))
    assert [s["rank"] for s in record["stages"]] == [0, 1, 2, 3, 3, 2, 1, 0] and record["schedule"] == "ZBVZeroBubble"
    assert record["n_microbatches"] == 8 and record["microbatch_size"] == 4


def parse_layout(layout: str) -> list[str]:
    """Megatron-Core's documented layout grammar: stages split by |, x*N repeats a symbol, (pattern)*N a piece of
    the layout, commas cosmetic (docs.nvidia.com/megatron: Custom Pipeline Model Parallel Layout)."""
    text = layout.replace(",", "")
    while "(" in text:
        text = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"([EtmL])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    assert re.fullmatch(r"[EtmL|]*", text), layout
    return text.split("|")


def _layout_of(text):
    return re.search(r"--pipeline-model-parallel-layout '?([^'\n]*)'?", text).group(1)


@pytest.mark.parametrize("mode, workers", [("flush", 4), ("flush", 6), ("interleaved", 4), ("zbv", 4), ("zb", 4),
                                           ("pipedream", 4)])
def test_megatrons_layout_assigns_every_transformer_layer_once_in_order(mode, workers):
    profile = titan(12)
    plan = plan_of(mode, workers, profile)
    export = exported(plan, profile, "megatron")
    text = formats.megatron(export, "cmd")
    stages = parse_layout(_layout_of(text))
    assert len(stages) == len(plan.stages)
    assert "".join(stages) == "E" + "t" * 12 + "L" and stages[0].startswith("E") and stages[-1].endswith("L")
    for stage, layout in zip(plan.stages, stages):  # the stage's own blocks, as many as it holds
        assert layout.count("t") == sum(PROFILE_NAME.match(profile.layers[i].name) is not None for i in stage.layers)
    assert f"--pipeline-model-parallel-size {export.pipeline}" in text and "--num-layers 12" in text
    assert (export.chunks > 1) == ("virtual pipeline size 2" in text)
    if mode in ("zb", "zbv", "pipedream"):  # Megatron has none of these: approximated, priced as what it runs
        assert export.notes and "approximated:" in text
        assert export.target_ms == pytest.approx(simulate(_as(plan, export.mode), mode=export.mode,
                                                          group=export.microbatches).time_per_minibatch_ms, rel=1e-6)
    else:
        assert not export.notes


PROFILE_NAME = re.compile(r"layers\.\d+$")


def _as(plan, mode):
    from pdtool.targets.export import _placed
    return _placed(plan, mode)


def test_megatrons_own_parser_reads_the_layout_where_megatron_core_is_installed(monkeypatch):
    """Megatron-Core 0.16.1 installs on this machine with --no-deps into a throwaway environment (not a test
    dependency: its own dependencies are the CUDA stack); where it is importable this runs."""
    layout = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType

    for mode, workers in (("flush", 4), ("interleaved", 4)):
        profile = titan(12)
        export = exported(plan_of(mode, workers, profile), profile, "megatron")
        monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size",
                            lambda: export.chunks if export.chunks > 1 else None)
        parsed = layout.PipelineParallelLayerLayout(_layout_of(formats.megatron(export, "cmd")), export.pipeline)
        parsed.validate_layer_layout(12, 0)
        ids = [i for v in range(export.chunks) for r in range(export.pipeline)
               for i in parsed.get_layer_id_list(LayerType.decoder, vp_stage=v, pp_rank=r)]
        assert ids == list(range(12))


def test_megatrons_uneven_first_and_last_stages_are_offered_where_the_layout_is_that_simple():
    from pdtool.targets.formats import _first_last
    from pdtool.targets.units import MegatronStage

    stages = [MegatronStage(True, (0, 1), False), MegatronStage(False, (2, 3, 4), False),
              MegatronStage(False, (5, 6, 7), False), MegatronStage(False, (8,), True)]
    assert _first_last(stages, 1) == (2, 1)
    assert _first_last(stages[:2] + [MegatronStage(False, (5, 6), False), stages[3]], 1) is None
    assert formats._layout([s.layout() for s in stages]) == "E,t*2|t*3|t*3|t,L"
    many = [MegatronStage(True, (0,), False)] + [MegatronStage(False, (1, 2), False)] * 4 + \
        [MegatronStage(False, (9,), True)]
    assert formats._layout([s.layout() for s in many]) == "E,t|(t*2|)*4t,L"
    assert parse_layout("E,t|(t*2|)*4t,L") == ["Et", "tt", "tt", "tt", "tt", "tL"]


@pytest.mark.parametrize("profile, target, words", [
    (titan(4, whole=False), "torchtitan", "cut layers."),
    (titan(4, whole=False), "torchtitan", "profile with --depth 2"),
    (titan(4, whole=False), "megatron", "profile with --depth 2"),
    (titan(4, hf=True), "pipelining", "profile the model class torch.distributed.pipelining runs"),
])
def test_a_cut_inside_a_module_the_target_keeps_whole_is_one_line_saying_how_to_profile(profile, target, words):
    plan = make_plan(profile, parse_cluster("3x10GB/s"), straight=True, mode="flush", every_worker=True)
    with pytest.raises(PlanError, match=re.escape(words)) as caught:
        exported(plan, profile, target)
    assert "\n" not in str(caught.value)


def test_replicas_of_unequal_degrees_tied_weights_and_models_without_blocks_are_refused():
    uneven = make_plan(PROFILE, parse_cluster("3x10GB/s"), mode="flush", every_worker=True)
    counts = {s.replicas for s in uneven.stages}
    if len(counts) > 1:
        with pytest.raises(PlanError, match="replicates every pipeline stage alike"):
            exported(uneven, PROFILE, "torchtitan")
    plan = plan_of("flush", 2)
    tied = dataclasses.replace(plan, shared=(("output.weight", (0, 1)),))
    with pytest.raises(PlanError, match="would train two copies"):
        exported(tied, PROFILE, "pipelining")
    assert "--untie-embeddings-and-output-weights" not in formats.megatron(exported(tied, PROFILE, "megatron"), "c")
    mlp = Profile.load(str(Path(__file__).resolve().parents[2] / "profiles" / "mlp.profile.json"))
    with pytest.raises(PlanError, match="no repeated blocks"):
        exported(make_plan(mlp, parse_cluster("2x10GB/s"), straight=True, mode="flush"), mlp, "megatron")


def test_replicated_sharded_and_partly_recomputing_plans_map_to_each_targets_switches():
    straight = make_plan(PROFILE, parse_cluster("2x10GB/s"), straight=True, mode="flush")
    plan = dataclasses.replace(straight, cluster=parse_cluster("4x10GB/s"), stages=tuple(
        dataclasses.replace(s, ranks=(2 * i, 2 * i + 1), recompute=i == 0) for i, s in enumerate(straight.stages)))
    sharded = plan.with_shard("optimizer")
    titan_export = exported(sharded, PROFILE, "torchtitan")
    toml = tomllib.loads(formats.torchtitan(titan_export, "c", None))
    assert toml["parallelism"]["data_parallel_shard_degree"] == 2
    assert toml["parallelism"]["data_parallel_replicate_degree"] == 1
    assert toml["activation_checkpoint"]["mode"] == "full"  # torchtitan recomputes all or none
    assert any("FSDP" in n for n in titan_export.notes) and any("recomputes every stage" in n
                                                                  for n in titan_export.notes)
    group = plan.run().group  # every replica's microbatches together (pdtool: microbatch b on replica b mod r)
    assert toml["training"]["local_batch_size"] == 4 * group // 2  # per data-parallel rank
    megatron = formats.megatron(exported(sharded, PROFILE, "megatron"), "c")
    assert "--use-distributed-optimizer" in megatron and f"--global-batch-size {4 * group}" in megatron
    assert "--recompute-granularity full" in megatron
    record = json.loads(formats.pipelining(exported(sharded, PROFILE, "pipelining"), "c", "p", None, None))
    assert record["data_parallel"] == {"degree": 2, "optimizer": "ZeroRedundancyOptimizer"}
    assert [s["recompute"] for s in record["stages"]] == [True, False] and not record["approximated"]
    assert not exported(plan, PROFILE, "pipelining").notes
    # sharded gradients: the targets' optimizer sharding, said as an approximation
    gradients = exported(plan.with_shard("gradients"), PROFILE, "megatron")
    assert "--use-distributed-optimizer" in formats.megatron(gradients, "c")
    assert any("per-backward gradient or parameter sharding" in n for n in gradients.notes)


def test_asynchronous_modes_are_approximated_by_1f1b_and_priced_as_such():
    plan = plan_of("pipedream")
    export = exported(plan, PROFILE, "pipelining")
    assert export.mode == "flush" and export.schedule == "1F1B"
    assert "no asynchronous schedule" in export.notes[0]
    assert export.target_ms == pytest.approx(simulate(plan, mode="flush", group=export.microbatches)
                                             .time_per_minibatch_ms, rel=1e-6)
    assert export.plan_ms == plan.predicted.simulated_ms


def test_the_cli_writes_each_target_and_a_schedule_csv_beside_for_zb(tmp_path):
    profile_path = tmp_path / "t.profile.json"
    PROFILE.save(profile_path)
    runner = CliRunner()
    result = runner.invoke(cli, ["plan", str(profile_path), "--cluster", "4x10GB/s", "--straight", "--mode", "zb",
                                 "-o", str(tmp_path / "t.plan.json")])
    assert result.exit_code == 0, result.output
    out = tmp_path / "t.toml"
    result = runner.invoke(cli, ["export-plan", str(tmp_path / "t.plan.json"), "--to", "torchtitan", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "pd simulate: what torchtitan runs takes" in result.output
    toml = tomllib.loads(out.read_text())
    csv = tmp_path / toml["parallelism"]["pipeline_parallel_schedule_csv"]
    assert csv.name == "t.schedule.csv" and len(read_csv(csv.read_text())) == 4
    result = runner.invoke(cli, ["export-plan", str(tmp_path / "t.plan.json"), "--to", "megatron", "-o", "-"])
    assert result.exit_code == 0 and "PIPELINE_ARGS=(" in result.output and "approximated: " in result.output
    result = runner.invoke(cli, ["export-plan", str(tmp_path / "t.plan.json"), "--to", "pipelining", "-o", "-"])
    assert result.exit_code == 2 and "give -o FILE" in result.output
    (tmp_path / "other").mkdir()
    lone = tmp_path / "other" / "t.plan.json"
    lone.write_text((tmp_path / "t.plan.json").read_text())
    result = runner.invoke(cli, ["export-plan", str(lone), "--to", "torchtitan", "-o", str(tmp_path / "x.toml")])
    assert result.exit_code == 2 and "--profile" in result.output and not (tmp_path / "x.toml").exists()


def test_names_that_are_no_modules_and_paths_with_newlines_cannot_break_out_of_a_file():
    profile = titan(2)
    layers = list(profile.layers)
    layers[1] = dataclasses.replace(layers[1], name="layers.0\n[parallelism]")
    bad = dataclasses.replace(profile, layers=tuple(layers))
    with pytest.raises(PlanError, match="no module's qualified name"):
        module_units(bad)
    export = exported(plan_of("flush", 2, profile), profile, "megatron")
    text = formats.megatron(export, "pd export-plan 'a\nrm -rf x' --to megatron -o f")
    assert all(line.startswith(("#", "PIPELINE_ARGS=(", "    --", ")")) for line in text.splitlines())


def test_data_parallel_plans_give_each_replica_its_share_of_the_group_and_are_priced_as_the_plan():
    plan = make_plan(PROFILE, parse_cluster("4x10GB/s"), data_parallel=True, mode="flush", group=8)
    assert [s.replicas for s in plan.stages] == [4]
    group = plan.run().group
    export = exported(plan, PROFILE, "torchtitan")
    assert export.microbatches * 4 == group and export.pipeline == 1 and not export.notes
    assert export.target_ms == pytest.approx(simulate(plan, mode="flush", group=group).time_per_minibatch_ms)
    assert f"--global-batch-size {4 * group}" in formats.megatron(exported(plan, PROFILE, "megatron"), "c")


def test_what_the_targets_cannot_cut_is_refused_in_one_line():
    mlp = Profile.load(str(Path(__file__).resolve().parents[2] / "profiles" / "mlp.profile.json"))
    plan = make_plan(mlp, parse_cluster("2x10GB/s"), straight=True, mode="flush")
    with pytest.raises(PlanError, match="top level is a sequence of numbered modules"):
        exported(plan, mlp, "torchtitan")
    resnet = Profile.load(str(Path(__file__).resolve().parents[2] / "profiles" / "resnet50-small.profile.json"))
    plan = make_plan(resnet, parse_cluster("2x10GB/s"), straight=True, mode="flush")
    with pytest.raises(PlanError, match="besides the transformer layers"):
        exported(plan, resnet, "megatron")
    assert module_unit("features.3", "Conv2d", {"features": "Sequential"}) == "features"  # torchtitan keeps it whole


def test_a_tie_inside_one_stage_keeps_megatrons_embedding_tied_and_uneven_counts_need_a_layer_at_each_end():
    profile = dataclasses.replace(titan(4), shared=(("output.weight", (0, 5)),))
    plan = plan_of("flush", 2, profile)
    if not plan.shared:  # the tie lies inside one stage: not the plan's, but the model's
        assert "--untie" not in formats.megatron(exported(plan, profile, "megatron"), "c")
    from pdtool.targets.formats import _first_last
    from pdtool.targets.units import MegatronStage
    only_e = [MegatronStage(True, (), False), MegatronStage(False, (0, 1), False), MegatronStage(False, (2, 3), False),
              MegatronStage(False, (4,), True)]
    assert _first_last(only_e, 1) is None


def test_a_v_plan_whose_group_megatron_cannot_run_is_rounded_up_and_said():
    plan = make_chunked_plan(PROFILE, parse_cluster("4x10GB/s"), chunks=2, mode="zbv", group=6)
    export = exported(plan, PROFILE, "megatron")
    assert export.microbatches == 8 and any("multiples of the 4 pipeline ranks" in n for n in export.notes)
