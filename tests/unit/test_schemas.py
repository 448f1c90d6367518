"""The published JSON Schemas (src/pdtool/artifacts/schemas/) agree with what pdtool writes and reads."""
import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest

from pdtool.artifacts.cluster import PRESETS, parse_cluster, preset
from pdtool.errors import ArtifactError
from pdtool.artifacts.plan import Plan
from pdtool.planner import make_plan
from pdtool.artifacts.profile import Profile
from pdtool.artifacts.schemas import NAMES, schema, check_document
from pdtool.schedule import TABLE

PROFILES = sorted((Path(__file__).parents[2] / "profiles").glob("*.profile.json"))


def written(profile_path, message_ms_per_mib=None):
    profile = Profile.load(profile_path)
    if message_ms_per_mib is not None:  # and what a layer-by-layer profile writes besides
        first = dataclasses.replace(profile.layers[0], same_as=0, saved_bytes=profile.layers[0].act_bytes)
        profile = dataclasses.replace(profile, message_ms_per_mib=message_ms_per_mib, copy_ms_per_mib=0.1,
                                      measured="layers", precision="bf16",
                                      classes={"blocks": "ModuleList"},
                                      layers=(first,) + profile.layers[1:])
    measured = message_ms_per_mib is not None
    plan = make_plan(profile, parse_cluster("cluster-a:2", memory="16GiB"), simulate=True,  # `recompute` and
                     recompute="all" if measured else "auto", mode="flush" if measured else None,  # `group` are
                     group=16 if measured else None, shard="optimizer" if measured else "none")  # written when set
    if measured:
        plan = dataclasses.replace(plan, optimizer="adamw")  # pd plan records it (make_plan leaves it out)
    return profile.to_json(), plan.to_json()


@pytest.mark.parametrize("name", NAMES)
def test_every_schema_is_a_valid_json_schema(name):
    jsonschema.Draft202012Validator.check_schema(schema(name))


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_shipped_profiles_and_their_plans_satisfy_the_schemas(path):
    profile, plan = written(path)
    check_document(json.loads(path.read_text()), "profile", str(path))
    check_document(profile, "profile", "written")
    check_document(plan, "plan", "written")


def test_the_plan_schema_accepts_exactly_the_schedule_modes():
    """A mode added to the schedule package (its mode table) must reach the published schema too, or a
    plan of that mode is refused when it is read (the multi-chunk modes too: pd simulate and pd show read them)."""
    assert tuple(schema("plan")["properties"]["mode"]["enum"]) == tuple(TABLE)


def test_cluster_files_satisfy_the_cluster_schema():
    for name in PRESETS:
        check_document(preset(name).to_json(), "cluster", name)
    check_document({"levels": [{"count": 4, "bandwidth": 1e9}]}, "cluster", "hand-written")


def test_the_schemas_list_exactly_the_fields_pdtool_writes():
    profile, plan = written(PROFILES[0], message_ms_per_mib=0.25)  # written when measured (not 0), by layer
    # a level's latency is written when it is not 0
    cluster = make_plan(Profile.load(PROFILES[0]), parse_cluster("4x12GB/s+5us,2x10Gbit/s+50us")).to_json()["cluster"]
    for document, name, nested in ((profile, "profile", {"layers": 0}), (plan, "plan", {"stages": 0}),
                                   (cluster, "cluster", {"levels": 0})):
        tree = schema(name)
        assert set(tree["properties"]) == set(document), name
        for key in nested:
            assert set(tree["properties"][key]["items"]["properties"]) == set(document[key][0]), (name, key)
    assert set(schema("plan")["properties"]["predicted"]["properties"]) == set(plan["predicted"])
    assert set(schema("plan")["properties"]["profile"]["properties"]) == set(plan["profile"])


def test_what_the_reader_ignores_the_schema_still_refuses(tmp_path):
    # layer_sum_over_step is derived, so reading skips it; the schema says it is a number.
    data = json.loads(PROFILES[0].read_text())
    data["layer_sum_over_step"] = "fast"
    path = tmp_path / "p.profile.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError) as info:
        Profile.load(path)
    assert str(info.value) == (f"{path}: layer_sum_over_step: expected a number or null, found a string ('fast'); "
                               "fix the value or regenerate the file (schema: pdtool/artifacts/schemas/profile.schema.json)")


def test_plans_refuse_a_negative_derived_figure(tmp_path):
    _, plan = written(PROFILES[0])
    plan["predicted"]["samples_per_s"] = -1
    with pytest.raises(ArtifactError, match=r"^x: predicted\.samples_per_s: must be >= 0, found -1; "):
        Plan.from_json(plan, "x")


@pytest.mark.parametrize("data, message", [
    ({"levels": []}, "levels: needs at least 1 item, found 0"),
    ({"levels": [{"count": 2}]}, "levels[0].bandwidth: missing field; regenerate the file with the current pdtool"),
    ({"levels": [{"count": 2, "bandwidth": "1GB/s", "x": 1}]},
     "levels[0]: unknown field 'x'; remove it (known fields: bandwidth, count, latency)"),
    ({"levels": [{"count": "2", "bandwidth": "1GB/s"}]}, "levels[0].count: expected an integer, found a string ('2')"),
    ({"schema": "pdtool.plan/1", "levels": [{"count": 2, "bandwidth": "1GB/s"}]},
     "schema: is 'pdtool.plan/1', expected 'pdtool.cluster/1'"),
])
def test_schema_messages_are_one_line_naming_the_field(data, message):
    with pytest.raises(ArtifactError) as info:
        check_document(data, "cluster", "c.json")
    assert "\n" not in str(info.value) and str(info.value).startswith(f"c.json: {message}")
    assert str(info.value).endswith("(schema: pdtool/artifacts/schemas/cluster.schema.json)")

