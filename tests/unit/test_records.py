"""Artifacts declared once (`pdtool.artifacts.record`): what pdtool writes reads back and writes back byte
for byte, the published schemas are the ones the declarations make, and plans name their profile."""
import dataclasses
import json
from pathlib import Path

import pytest

from pdtool.artifacts.cluster import Cluster, parse_cluster
from pdtool.artifacts.pipedream import load_pipedream_graph
from pdtool.artifacts.plan import Plan, find_profile
from pdtool.artifacts.profile import Profile
from pdtool.artifacts.schemas import NAMES, generated_text
from pdtool.jsonio import canonical_json
from pdtool.planner import make_plan

ROOT = Path(__file__).parents[2]
PROFILES = sorted((ROOT / "profiles").glob("*.profile.json"))
GRAPHS = sorted((ROOT / "profiles" / "pipedream").glob("*.graph.txt"))


def rewritten(cls, text: str) -> str:
    return canonical_json(cls.from_json(json.loads(text), "x").to_json())


@pytest.mark.parametrize("name", NAMES)
def test_the_checked_in_schemas_are_the_generated_ones(name):
    """Run `python -m pdtool.artifacts.schemas` after changing a declaration."""
    assert (ROOT / "src/pdtool/artifacts/schemas" / f"{name}.schema.json").read_text() == generated_text(name)


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_checked_in_profiles_and_their_plans_write_back_byte_for_byte(path):
    text = path.read_text()
    again = rewritten(Profile, text)
    # these profiles predate some optional fields (wgrad_ms, reduce_ms, split, shared): their rewrite adds those,
    # as the pdtool of this commit writes them too, and changes nothing else; the rewrite writes back byte for byte
    schema = json.loads(generated_text("profile"))
    file, new = json.loads(text), json.loads(again)
    for old, written, declared in [(file, new, schema)] + [(a, b, schema["properties"]["layers"]["items"])
                                                            for a, b in zip(file["layers"], new["layers"])]:
        assert {k: v for k, v in written.items() if k in old and k != "layers"} == {k: v for k, v in old.items()
                                                                                  if k != "layers"}
        assert not set(written) - set(old) & set(declared["required"])
    assert rewritten(Profile, again) == again
    profile = Profile.from_json(json.loads(text), str(path))
    tied = dataclasses.replace(profile, message_ms_per_mib=0.25)
    for plan in (make_plan(profile, parse_cluster("cluster-a:2", memory="16GiB"), simulate=False, command="pd plan x",
                           profile_file=path.name),
                 make_plan(tied, parse_cluster("4x12GB/s+5us,2x10Gbit/s+50us"), cost_model="pipedream")):
        text = canonical_json(plan.to_json())
        assert rewritten(Plan, text) == text
        assert rewritten(Cluster, canonical_json(plan.cluster.to_json())) == canonical_json(plan.cluster.to_json())


@pytest.mark.parametrize("path", GRAPHS, ids=lambda p: p.name)
def test_imported_profiles_write_back_byte_for_byte(path):
    text = canonical_json(load_pipedream_graph(path, 64 if "gnmt" in path.name else None).to_json())
    assert rewritten(Profile, text) == text


def test_a_plan_names_its_profile_and_an_older_plan_is_still_read_by_its_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    profile = Profile.load(PROFILES[0])
    profile.save("measured.json")  # not X.profile.json, so only the plan's own record finds it
    (tmp_path / "plans").mkdir()
    plan = make_plan(profile, parse_cluster("2x1GB/s"), simulate=False, command="pd plan measured.json --cluster 2x1GB/s",
                     profile_file="measured.json")
    assert plan.to_json()["provenance"]["profile"] == "measured.json"
    assert find_profile("plans/p.plan.json", plan) == "measured.json"
    older = dataclasses.replace(plan, profile_file=None)
    assert "profile" not in older.to_json()["provenance"]
    assert find_profile("plans/p.plan.json", older) == "measured.json"
    assert find_profile("plans/p.plan.json", dataclasses.replace(older, command="")) is None
