"""The plan artifact and the planner, including the original optimizer's published figures."""
import copy
import json
from pathlib import Path

import pytest

from pdtool.artifacts.cluster import parse_cluster
from pdtool.errors import ArtifactError, PlanError
from pdtool.jsonio import canonical_json
from pdtool.artifacts.pipedream import load_pipedream_graph
from pdtool.artifacts.plan import Plan, compact_ranges
from pdtool.planner import make_plan
from pdtool.artifacts.profile import Layer, Profile

PIPEDREAM = Path(__file__).resolve().parents[2] / "profiles" / "pipedream"


def imported(model):
    return load_pipedream_graph(PIPEDREAM / f"{model}.graph.txt", 64 if model == "gnmt" else None)


def chain_profile(times, params, acts, skips=()):
    layers = tuple(Layer(id=i, name=f"l{i}", kind="Linear", fwd_ms=t / 3, bwd_ms=2 * t / 3, act_bytes=a, param_bytes=p)
                   for i, (t, p, a) in enumerate(zip(times, params, acts)))
    edges = tuple(sorted({(i, i + 1) for i in range(len(layers) - 1)} | set(skips)))
    return Profile(model=None, batch_size=32, inputs=(), device="cpu", torch_version="", fingerprint="f" * 64,
                   method="pipedream", granularity="module", depth=None, repeats=1, step_ms=0.0, step_ms_spread=0.0,
                   layers=layers, edges=edges)


# ----- the original optimizer's figures (issue 3, acceptance) ------------------------------------
def test_vgg16_on_4_workers_matches_the_original_optimizer():
    plan = make_plan(imported("vgg16"), parse_cluster("4x1.25e9B/s"), cost_model="pipedream")
    assert [s.replicas for s in plan.stages] == [3, 1]
    assert plan.predicted.time_ms / 1000 == pytest.approx(0.176349, rel=5e-5)
    assert plan.predicted.cost_model_speedups == pytest.approx((3.81, 2.84), abs=0.005)


def test_gnmt_on_4_workers_is_a_straight_pipeline_as_in_the_original():
    plan = make_plan(imported("gnmt"), parse_cluster("4x1.25e9B/s"), cost_model="pipedream")
    assert [s.replicas for s in plan.stages] == [1, 1, 1, 1]
    assert plan.predicted.time_ms / 1000 == pytest.approx(0.025868, rel=5e-5)
    assert plan.predicted.cost_model_speedups[0] == pytest.approx(3.46, abs=0.005)


# ----- the plan file --------------------------------------------------------------------------------
def test_plans_round_trip_and_are_byte_identical_for_identical_inputs():
    profile = imported("resnet18")
    texts = {canonical_json(make_plan(profile, parse_cluster("4x12GB/s,2x10Gbit/s")).to_json()) for _ in range(2)}
    assert len(texts) == 1
    text = texts.pop()
    again = Plan.from_json(json.loads(text), "p.json")
    assert canonical_json(again.to_json()) == text


def test_the_plan_keeps_the_profiles_host_cost_of_a_message_and_old_files_read_as_none():
    import dataclasses

    profile = chain_profile([3.0, 3.0], [0, 0], [2 ** 20, 10])
    plan = make_plan(dataclasses.replace(profile, message_ms_per_mib=0.3), parse_cluster("2x100GB/s"), straight=True)
    text = plan.to_json()
    assert text["profile"]["message_ms_per_mib"] == 0.3
    assert Plan.from_json(json.loads(canonical_json(text)), "p.json").profile.message_ms_per_mib == 0.3
    assert Profile.from_json(json.loads(canonical_json(dataclasses.replace(profile, message_ms_per_mib=0.3).to_json())),
                             "x.profile.json").message_ms_per_mib == 0.3
    old = make_plan(profile, parse_cluster("2x100GB/s"), straight=True)  # a profile that did not measure it
    assert "message_ms_per_mib" not in old.to_json()["profile"] and "message_ms_per_mib" not in profile.to_json()
    assert old.profile.message_ms_per_mib == 0.0
    assert plan.predicted.simulated_ms > old.predicted.simulated_ms  # the simulator charges it


@pytest.mark.parametrize("cost_model, spec", [("pdtool", "4x12GB/s,4x10Gbit/s"), ("pipedream", "4x1e10B/s,2x1.25e9B/s")])
def test_a_plan_covers_every_layer_once_and_uses_distinct_ranks(cost_model, spec):
    profile = imported("resnet18")
    plan = make_plan(profile, parse_cluster(spec), cost_model=cost_model)
    stage_of = {layer: s for s, stage in enumerate(plan.stages) for layer in stage.layers}
    assert sorted(stage_of) == list(range(len(profile.layers)))
    assert all(stage_of[src] <= stage_of[dst] for src, dst in profile.edges)  # data only flows forward
    ranks = plan.used_ranks
    assert len(ranks) == len(set(ranks)) and set(ranks) <= set(range(16))
    assert plan.predicted.time_ms == pytest.approx(max([s.time_ms for s in plan.stages] + [g.time_ms for g in plan.groups]))


def test_a_stage_can_be_a_set_of_layers_and_the_plan_says_which_states_it_used():
    """resnet18 with the original's model on 4x2: the best split ends between the two branches
    of a residual block (the original's optimizer finds it too), so a stage is not a range."""
    profile = imported("resnet18")
    plan = make_plan(profile, parse_cluster("4x1e10B/s,2x1.25e9B/s"), cost_model="pipedream", simulate=False)
    data = plan.to_json()
    assert data["state_space"] == "down-sets"
    assert plan.predicted.time_ms / 1000 == pytest.approx(0.0423106, rel=5e-6)  # the original's figure
    stages = data["stages"]
    assert any(s["layers"] != list(range(s["layers"][0], s["layers"][-1] + 1)) for s in stages)
    for stage in stages:
        assert stage["layers"] == sorted(stage["layers"])
        assert (stage["first_layer"], stage["last_layer"]) == (profile.layers[stage["layers"][0]].name,
                                                               profile.layers[stage["layers"][-1]].name)
    assert canonical_json(Plan.from_json(json.loads(canonical_json(data)), "p.json").to_json()) == canonical_json(data)
    from pdtool.views.show import plan_table

    table = plan_table(plan)
    assert all(f" {compact_ranges(s.layers)} " in table for s in plan.stages)


def test_layer_sets_are_shown_as_ranges():
    assert compact_ranges(range(17)) == "0-16"
    assert compact_ranges([12, 0, 1, 2, 3, 4, 5, 8, 10, 11]) == "0-5,8,10-12"
    assert compact_ranges([7]) == "7" and compact_ranges([]) == ""


def test_too_many_down_sets_plan_over_prefixes_and_say_so(monkeypatch):
    import pdtool.planner.make as plan_module
    from pdtool.planner.states import build_states

    monkeypatch.setattr(plan_module, "build_states", lambda costs, **kw: build_states(costs, max_states=10, **kw))
    plan = make_plan(imported("resnet18"), parse_cluster("4x1e10B/s,2x1.25e9B/s"), cost_model="pipedream",
                     simulate=False)
    assert plan.state_space == "prefixes" and plan.to_json()["state_space"] == "prefixes"
    assert all(s.layers == tuple(range(s.first, s.last + 1)) for s in plan.stages)
    assert plan.predicted.time_ms / 1000 == pytest.approx(0.0425623, rel=5e-6)  # one order's ranges only


def test_in_flight_counts_follow_1f1b():
    # a compute-bound chain on a slow network: a straight pipeline, stage s holds d - s minibatches
    profile = chain_profile([10.0] * 8, [4e8] * 8, [1e3] * 8)
    plan = make_plan(profile, parse_cluster("4x1GB/s"))
    assert [s.replicas for s in plan.stages] == [1, 1, 1, 1]
    assert [s.in_flight for s in plan.stages] == [4, 3, 2, 1]


def test_memory_limit_rules_out_plans_and_says_by_how_much():
    profile = chain_profile([10.0] * 4, [2.5e9, 1e7, 1e7, 1e7], [1e6] * 4)
    roomy = make_plan(profile, parse_cluster("2x10GB/s", memory="64GiB"))
    assert [(s.first, s.last, s.replicas) for s in roomy.stages] == [(0, 1, 1), (2, 3, 1)]
    assert roomy.stages[0].memory_bytes > 9 * 2**30  # 4 copies of 2.51 GB: 2 versions, gradient, momentum
    # data parallelism holds one version (1 in flight) but its replicas keep the flat buffer they all-reduce in beside
    # the gradient: 4 copies of all 4 layers, more than the pipeline's stage 0, which 9.4 GiB leaves alone
    data_parallel = make_plan(profile, parse_cluster("2x10GB/s"), data_parallel=True)
    assert data_parallel.stages[0].memory_bytes > 9.4 * 2**30
    tight = make_plan(profile, parse_cluster("2x10GB/s", memory="9.4GiB"))
    assert [(s.first, s.last, s.replicas) for s in tight.stages] == [(0, 1, 1), (2, 3, 1)]
    assert all(s.memory_bytes <= 9.4 * 2**30 for s in tight.stages)
    with pytest.raises(PlanError, match=r"no plan fits in 9 GiB per worker: .*stage 0 \(layers 0-1, l0..l1\) "
                                        r"needs 9.35\d GiB per worker, 0.35\d GiB over"):
        make_plan(profile, parse_cluster("2x10GB/s", memory="9GiB"))
    with pytest.raises(PlanError, match=r"no plan fits in 1 GiB per worker: .*stage 0 \(layers 0-1, l0..l1\) "
                                        r"needs 9.35\d GiB per worker, 8.35\d GiB over"):
        make_plan(profile, parse_cluster("2x10GB/s", memory="1GiB"))


def test_straight_plans_never_replicate():
    plan = make_plan(imported("vgg16"), parse_cluster("4x1.25e9B/s"), straight=True)
    assert all(s.replicas == 1 for s in plan.stages)


def test_exact_worker_counts_that_cannot_be_met_are_one_clear_error():
    with pytest.raises(PlanError, match="uses exactly every worker"):
        make_plan(chain_profile([1.0, 1.0], [1.0, 1.0], [1, 1]), parse_cluster("4x1GB/s"),
                  cost_model="pipedream", straight=True)


def _plan_json():
    return json.loads(canonical_json(make_plan(imported("vgg16"), parse_cluster("4x1.25e9B/s"),
                                               cost_model="pipedream").to_json()))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["stages"][0].update(ranks=[0, 1]), r"stages\[0\].ranks: replicas is \d but 2 ranks"),
    (lambda d: d["stages"][-1].update(ranks=[0], replicas=1), r"rank 0 is also in stages\[0\]"),
    (lambda d: d["stages"][-1].update(ranks=[9], replicas=1), "rank 9 does not exist in a cluster of 4 workers"),
    (lambda d: d["stages"][0].update(layers=[]), r"stages\[0\]: layers \[\] is an empty stage"),
    (lambda d: d["stages"][1]["layers"].append(d["stages"][0]["layers"][-1]), r"stages\[1\]: layer \d+ is already in stages\[0\]"),
    (lambda d: d["stages"][1]["layers"].append(d["stages"][1]["layers"][0]), r"stages\[1\]: layer \d+ is listed twice"),
    (lambda d: d["stages"][1].update(layers=d["stages"][1]["layers"][2:-1]), r"stages: layers \d+-\d+,39 are in no stage"),
    (lambda d: d["stages"][1].update(layers=d["stages"][1]["layers"][:-1]), r"stages: layer 39 is in no stage"),
    (lambda d: d["stages"][1]["layers"].append(40), r"stages\[1\]: layer 40 does not exist in a profile of 40 layers"),
    (lambda d: d["stages"][1].update(layers=[1, "x"]), r"stages\[1\].layers: expected a list of layer ids"),
    (lambda d: d.update(state_space="antichains"), "unknown state space 'antichains'"),
    (lambda d: d.update(stages=[]), "at least one stage"),
    (lambda d: d.update(mode="fast"), "unknown mode 'fast'"),
    (lambda d: d.update(schema="pdtool.profile/1"), r"this is a profile \(pdtool.profile/1\), not a plan"),
    (lambda d: d.update(schema="pdtool.plan/9"), "expected 'pdtool.plan/2'"),
    (lambda d: d["stages"][0].pop("ranks"), r"stages\[0\].ranks: missing field"),
    (lambda d: d["stages"][1].update(receives=[1, 1]), r"stages\[1\].receives: layer 1 is listed twice"),
    (lambda d: d["stages"][1].update(receives=[99]), r"stages\[1\]: receives layer 99, which does not exist"),
    (lambda d: d["stages"][1].update(sends=[0, "x"]), r"stages\[1\].sends: expected a list of layer ids"),
    (lambda d: d["stages"][0].update(sends=[]), r"stages\[0\]: sends layers \[\], but the later stages receive \[\d+\]"),
])
def test_hand_edited_inconsistent_plans_are_refused_in_one_line(edit, message):
    data = copy.deepcopy(_plan_json())
    edit(data)
    with pytest.raises(ArtifactError, match=message) as info:
        Plan.from_json(data, "m.plan.json")
    assert str(info.value).startswith("m.plan.json: ") and "\n" not in str(info.value)


# ----- the plan's own record of its data flow -----------------------------------------------------
def test_every_stage_records_what_it_receives_from_earlier_stages_and_sends_to_later_ones():
    """A skip edge 1 -> 4 over three stages of two layers: stage 1 passes nothing of it on,
    stage 2 reads it straight from stage 0."""
    import dataclasses

    from pdtool.artifacts.plan import with_boundaries

    profile = chain_profile([10, 10, 10, 10, 10, 40], [1] * 6, [1000] * 6, skips=[(1, 4)])
    plan = make_plan(profile, parse_cluster("3x1GB/s"), straight=True, simulate=False)
    assert plan.stages == with_boundaries(profile, plan.stages) and plan.stages[1].receives
    pairs = with_boundaries(profile, [dataclasses.replace(plan.stages[0], layers=(2 * i, 2 * i + 1)) for i in range(3)])
    assert [(s.receives, s.sends) for s in pairs] == [((), (1,)), ((1,), (3,)), ((1, 3), ())]
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, ranks=(i,)) for i, s in enumerate(pairs)))
    data = plan.to_json()
    assert [(s["receives"], s["sends"]) for s in data["stages"]] == [([], [1]), ([1], [3]), ([1, 3], [])]
    assert Plan.from_json(json.loads(canonical_json(data)), "p.json") == plan


def test_a_set_shaped_stage_records_each_branch_it_receives():
    plan = make_plan(imported("resnet18"), parse_cluster("4x1e10B/s,2x1.25e9B/s"), cost_model="pipedream",
                     simulate=False)
    profile = imported("resnet18")
    owner = {layer: i for i, s in enumerate(plan.stages) for layer in s.layers}
    for index, stage in enumerate(plan.stages):
        assert stage.receives == tuple(sorted({a for a, b in profile.edges if owner[b] == index != owner[a]}))
        assert stage.sends == tuple(sorted({a for a, b in profile.edges if owner[a] == index != owner[b]}))
    assert any(len(s.receives) > 1 for s in plan.stages)  # the two branches of a residual block


def _swap_stages(data, keys):
    first, second = data["stages"][:2]
    for key in keys:
        first[key], second[key] = second[key], first[key]


@pytest.mark.parametrize("keys, message", [
    (("layers", "first_layer", "last_layer"),
     r"stages\[1\]: receives layer \d+ from an earlier stage, but it computes it itself: the stages are not in "
     r"data-flow order \(edited by hand\?\); regenerate the plan with pd plan$"),
    (("layers", "first_layer", "last_layer", "receives", "sends"),
     r"stages\[0\]: receives layer \d+ from an earlier stage, but stages\[1\] computes it later: the stages are not "
     r"in data-flow order"),
])
def test_stages_out_of_data_flow_order_are_refused_from_the_plan_alone(keys, message):
    data = _plan_json()
    _swap_stages(data, keys)
    with pytest.raises(ArtifactError, match=message) as info:
        Plan.from_json(data, "m.plan.json")
    assert str(info.value).startswith("m.plan.json: ") and "\n" not in str(info.value)


def test_a_layer_moved_across_a_boundary_by_hand_is_refused():
    data = _plan_json()
    moved = data["stages"][0]["sends"][-1]  # a layer stage 1 receives, moved into stage 1
    data["stages"][0]["layers"].remove(moved)
    data["stages"][1]["layers"].append(moved)
    with pytest.raises(ArtifactError, match=rf"stages\[1\]: receives layer {moved} from an earlier stage, but it "
                                            "computes it itself"):
        Plan.from_json(data, "m.plan.json")


def test_a_plan_from_before_the_record_is_refused_with_the_command_that_makes_it_again():
    data = _plan_json()
    data["provenance"]["command"] = "pd plan vgg16.profile.json\n --cluster 4x1GB/s"
    for stage in data["stages"]:
        del stage["receives"], stage["sends"]
    with pytest.raises(ArtifactError) as info:
        Plan.from_json(data, "m.plan.json")
    assert str(info.value) == ("m.plan.json: stages[0]: no receives/sends: the plan was made by an older pdtool, before "
                               "plans recorded what each stage receives and sends; make it again with pd plan "
                               "vgg16.profile.json --cluster 4x1GB/s -o m.plan.json")


def test_a_record_that_disagrees_with_the_profiles_edges_is_refused_when_the_profile_is_at_hand():
    """A record consistent in itself (what stage 0 sends, stage 1 receives) that leaves out an
    edge of the profile: only the profile shows it."""
    import dataclasses

    from pdtool.artifacts.plan import check_against_profile

    profile = chain_profile([10, 10, 10, 10, 10, 40], [1] * 6, [1000] * 6, skips=[(0, 5)])
    plan = make_plan(profile, parse_cluster("2x1GB/s"), straight=True, simulate=False)
    check_against_profile(plan, profile)
    first, second = plan.stages
    assert 0 in second.receives and first.sends[0] == 0
    stale = dataclasses.replace(plan, stages=(dataclasses.replace(first, sends=first.sends[1:]),
                                              dataclasses.replace(second, receives=second.receives[1:])))
    with pytest.raises(ArtifactError, match=rf"^the plan: stages\[0\] records receiving \[\] and sending "
                                            rf"\[{first.sends[-1]}\], but by the profile given's edges it receives "
                                            rf"\[\] and sends \[0,{first.sends[-1]}\] \(edited by hand\?\)"):
        check_against_profile(stale, profile)


def test_a_measurement_far_from_the_prediction_is_explained_from_what_pdtool_knows():
    import dataclasses

    from pdtool.sim.prediction import gap_reasons

    plan = make_plan(imported("vgg16"), parse_cluster("4x1.25e9B/s"), simulate=False)
    plan = dataclasses.replace(plan, profile=dataclasses.replace(plan.profile, device="cpu (2 threads)",
                                                                 layer_sum_over_step=0.5))
    assert gap_reasons(1.2, 1.0, plan, 1, 4, 2, True) == []  # within 1.5x: nothing to say
    reasons = gap_reasons(40.0, 1.0, plan, 1, 4, 2, True)
    assert reasons[0].startswith("4 workers x 1 thread(s) share 2 cores (2.0x oversubscribed")
    assert reasons[1].startswith("the profile was measured with 2 thread(s), the workers have 1")
    assert reasons[2].startswith("the profile's layer times sum to 0.50 of a measured step")
    assert reasons[3].startswith("about 5.0x outside what pdtool models")  # 40 / (2 * 2 * 2)


def test_a_cause_that_points_the_other_way_is_not_cited():
    import dataclasses

    from pdtool.sim.prediction import gap_reasons

    plan = make_plan(imported("vgg16"), parse_cluster("4x1.25e9B/s"), simulate=False)
    over = dataclasses.replace(plan, profile=dataclasses.replace(plan.profile, layer_sum_over_step=2.14))
    # layer times summing above a step make the prediction too high: they cannot explain a slower run
    slower = gap_reasons(2.7, 1.0, over, 1, 2, 2, True)
    assert not any("sum to 2.14" in r for r in slower) and slower[0].startswith("outside what pdtool models")
    faster = gap_reasons(0.4, 1.0, over, 1, 2, 2, True)
    assert faster[0].startswith("the profile's layer times sum to 2.14")
    fewer = dataclasses.replace(plan, profile=dataclasses.replace(plan.profile, device="cpu (1 thread)"))
    assert not any("measured with 1 thread" in r for r in gap_reasons(3.0, 1.0, fewer, 2, 1, 2, True))


def test_the_planner_counts_the_state_of_every_optimizer_the_workers_build():
    from pdtool.planner.costmodel import OPTIMIZER_SLOTS
    from pdtool.runtime.recipe import OPTIMIZERS

    assert tuple(OPTIMIZER_SLOTS) == OPTIMIZERS


def test_a_workers_memory_far_from_the_plan_names_the_term_most_off():
    from pdtool.planner.costmodel import Memory
    from pdtool.sim.prediction import memory_gap, planned_memory

    plan = make_plan(imported("vgg16"), parse_cluster("4x1.25e9B/s"), straight=True)
    planned = planned_memory(plan, None, None, "adam")
    stage = plan.stages[0]
    terms = planned[stage.ranks[0]]
    assert terms["gradients"] == stage.param_bytes and terms["optimizer"] == 2 * stage.param_bytes
    assert terms["temporaries"] == 2 * stage.largest_layer_bytes  # Adam's step: two tensors of the largest layer
    assert sum(terms.values()) == int(Memory(limit=float("inf"), optimizer_slots=2, step_temporaries=2.0).need(
        stage.param_bytes, stage.activation_bytes, terms["activations"] // stage.activation_bytes,
        terms["weights"] // stage.param_bytes, cut=(stage.in_bytes, stage.out_bytes),
        largest=stage.largest_layer_bytes))
    k = stage.in_flight
    assert terms["messages"] == 2 * ((k + 1) * stage.in_bytes + k * stage.out_bytes)
    close = {"base": 100, "peak": 100 + int(sum(terms.values()) * 1.2), **terms}
    assert memory_gap(close, terms) is None  # within 25%: nothing to say
    far = {**close, "peak": 100 + 3 * sum(terms.values()), "activations": terms["activations"] + 2 * sum(terms.values())}
    line = memory_gap(far, terms)
    assert line.startswith("3.0x the plan; the term most off is activations (what remains of the peak")


def test_pd_plan_says_which_noisy_layers_decide_the_plan():
    import dataclasses

    from pdtool.artifacts.profile import Layer

    profile = chain_profile([4.0] * 8, [1000] * 8, [10] * 8)
    layers = list(profile.layers)
    layers[3] = dataclasses.replace(layers[3], fwd_ms_spread=layers[3].fwd_ms)  # spread = the median: noisy
    assert layers[3].noisy and not layers[2].noisy
    assert not Layer(id=0, name="x", kind="k", fwd_ms=0.01, bwd_ms=0.0, act_bytes=0, param_bytes=0,
                 fwd_ms_spread=0.01).noisy  # too short to matter
    noisy = dataclasses.replace(profile, layers=tuple(layers))
    said = []
    plan = make_plan(noisy, parse_cluster("2x1GB/s"), straight=True, say=said.append)
    assert [s.layers for s in plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]  # layer 3 ends stage 0
    assert any("l3" in line and "profile again" in line for line in said)
    quiet = []
    make_plan(profile, parse_cluster("2x1GB/s"), straight=True, say=quiet.append)
    assert not any("disagree" in line for line in quiet)


def test_unranked_clusters_never_get_a_plan_slower_than_data_parallelism_in_simulation(monkeypatch):
    """Beyond the ranked sizes (here every size: the bound lowered to 1 worker), for a schedule
    whose steady state is not computed from one period (here: none is), the cost model's optimum
    is simulated beside data parallelism and loses where it simulates slower: on links with a 1 ms
    latency (which the cost model leaves out) a 3-stage pipeline of small weights."""
    from pdtool.planner import make

    monkeypatch.setattr(make, "RANKED_WORKERS", 1)
    monkeypatch.setattr(make, "steady_applies", lambda plan: False)
    monkeypatch.setattr(make, "steady_state", lambda plan: None)
    profile = chain_profile([1.0] * 8, [1e6] * 8, [1e5] * 8)
    cluster = parse_cluster("4x1GB/s+1ms")
    optimum = make_plan(profile, cluster, simulate=False)
    assert len(optimum.stages) > 1
    plan = make_plan(profile, cluster)
    assert len(plan.stages) == 1 and plan.stages[0].replicas == 4
    assert plan.predicted.why.startswith("data parallelism: the cost model's optimum (3 stages")
    assert plan.predicted.simulated_ms == plan.predicted.simulated_data_parallel_ms
    assert plan.predicted.candidates == 2 and not plan.predicted.simulated_steady
    pipelined = make_plan(chain_profile([1.0] * 8, [2e7] * 8, [1e5] * 8), cluster)  # big weights: the pipeline wins
    assert len(pipelined.stages) > 1 and pipelined.predicted.simulated_ms < pipelined.predicted.simulated_data_parallel_ms


def test_beyond_the_ranked_sizes_pipedream_candidates_are_ranked_by_their_steady_states(monkeypatch):
    """The bound lowered to 1 worker: every candidate (the cost model's best per number of workers,
    straight pipelines, data parallelism) gets its steady state from one period, and the pick is
    the fastest of them, never slower than data parallelism or the cost model's optimum."""
    from pdtool.planner import make
    from pdtool.sim.steady import steady_state

    monkeypatch.setattr(make, "RANKED_WORKERS", 1)
    profile = chain_profile([1.0] * 8, [1e6] * 8, [1e5] * 8)
    cluster = parse_cluster("4x1GB/s+1ms")
    plan = make_plan(profile, cluster)
    assert plan.predicted.simulated_steady and plan.predicted.candidates > 2
    assert "steady states" in plan.predicted.why
    optimum = steady_state(make_plan(profile, cluster, simulate=False)).time_per_minibatch_ms
    assert plan.predicted.simulated_ms <= min(optimum, plan.predicted.simulated_data_parallel_ms)
    assert plan.predicted.simulated_ms == pytest.approx(steady_state(plan).time_per_minibatch_ms, rel=1e-5)


def test_a_plan_without_a_replicated_stage_inside_its_pipeline_names_the_best_one_considered():
    from pdtool.artifacts.profile import Profile
    from pdtool.views.show import plan_table

    profile = Profile.load(Path(__file__).resolve().parents[2] / "profiles" / "mlp.profile.json")
    plan = make_plan(profile, parse_cluster("4x1GB/s"))
    assert all(s.replicas == 1 for s in plan.stages) and len(plan.stages) > 1
    hybrid = plan.predicted.hybrid
    assert hybrid and "replicas 1x2x1" in hybrid and "ms per minibatch simulated" in hybrid
    simulated = float(hybrid.split(": ")[1].split(" ms")[0])
    assert simulated >= plan.predicted.simulated_ms - 5e-4  # it lost in simulation (printed to 3 decimals)
    assert f"hybrid       the fastest candidate with a replicated stage inside a pipeline: {hybrid}" in plan_table(plan)
    again = Plan.from_json(json.loads(canonical_json(plan.to_json())), "p.json")
    assert again.predicted.hybrid == hybrid
    replicated = make_plan(profile, parse_cluster("4x100MB/s"))
    assert replicated.predicted.hybrid is None and "hybrid" not in plan_table(replicated)
