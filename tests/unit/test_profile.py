import copy
import json

import pytest

from pdtool.errors import ArtifactError
from pdtool.jsonio import canonical_json
from pdtool.artifacts.profile import SCHEMA, Layer, ModelRef, Profile, TensorSpec


def make_profile(**overrides) -> Profile:
    layers = tuple(
        Layer(id=i, name=f"l{i}", kind="Linear", fwd_ms=1.0 + i, bwd_ms=2.0 * (1 + i), act_bytes=100 * (i + 1),
              param_bytes=40 * i, fwd_ms_spread=0.1, bwd_ms_spread=0.2, ops=(f"op{i}",))
        for i in range(4)
    )
    values = dict(
        model=ModelRef("pdtool.zoo:mlp", {"hidden": 8}), batch_size=16, inputs=(TensorSpec((16, 784), "float32"),),
        device="cpu (2 threads)", torch_version="2.13.0", fingerprint="ab" * 32, method="fx",
        granularity="module", depth=None, repeats=10, step_ms=25.0, step_ms_spread=1.5, layers=layers,
        edges=((0, 1), (1, 2), (2, 3), (0, 3)),
    )
    values.update(overrides)
    return Profile(**values)


def test_json_round_trip_is_exact():
    profile = make_profile()
    data = json.loads(canonical_json(profile.to_json()))
    again = Profile.from_json(data)
    assert again == profile
    assert canonical_json(again.to_json()) == canonical_json(profile.to_json())


def test_save_and_load_give_identical_bytes(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    make_profile().save(first)
    Profile.load(first).save(second)
    assert first.read_bytes() == second.read_bytes()
    assert json.loads(first.read_text())["schema"] == SCHEMA


def test_derived_figures():
    profile = make_profile()
    assert profile.layer_sum_ms == pytest.approx((1 + 2 + 3 + 4) * 3)
    assert profile.layer_sum_over_step == pytest.approx(30 / 25)
    assert profile.param_bytes == 40 * (0 + 1 + 2 + 3)
    assert profile.to_json()["layer_sum_over_step"] == pytest.approx(1.2)


def test_layers_that_do_not_add_up_to_the_step_are_explained():
    assert make_profile(step_ms=30.0).sum_gap() is None  # exact
    high = make_profile().sum_gap()  # 30 ms of layers over a 25 ms step
    assert high.startswith("the layers' times add up to 1.20x the measured step") and "5.0 ms more" in high
    assert "l3 (12.0 ms), l2 (9.0 ms), l1 (6.0 ms)" in high and "pd plan scales them down to the step" in high
    low = make_profile(step_ms=50.0).sum_gap()
    assert low.startswith("the layers' times add up to 0.60 of the measured step: 20.0 ms of each step (40%) is in "
                          "no layer")
    assert make_profile(step_ms=50.0, measured="layers").sum_gap() is None  # no whole step timed


def _json():
    return json.loads(canonical_json(make_profile().to_json()))


def _broken(edit):
    data = _json()
    edit(data)
    return data


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(schema="pdtool.plan/1"), r"this is a plan \(pdtool.plan/1\), not a profile; train it"),
    (lambda d: d.pop("schema"), "no 'schema' field"),
    (lambda d: d.pop("batch_size"), "batch_size: missing field"),
    (lambda d: d.update(batch_size="16"), "batch_size: expected an integer"),
    (lambda d: d.update(batch_size=0), "batch_size: must be >= 1"),
    (lambda d: d.update(extra=1), "unknown field 'extra'"),
    (lambda d: d["layers"][1].update(extra=1), r"layers\[1\]: unknown field 'extra'"),
    (lambda d: d["layers"][2].pop("fwd_ms"), r"layers\[2\].fwd_ms: missing field"),
    (lambda d: d["layers"][2].update(fwd_ms=-1.0), r"layers\[2\].fwd_ms: must be >= 0"),
    (lambda d: d["layers"][2].update(act_bytes=1.5), r"layers\[2\].act_bytes: expected an integer"),
    (lambda d: d["layers"][2].update(id=7), r"layers\[2\]: id is 7, expected 2"),
    (lambda d: d["layers"][3].update(name="l0"), r"layers\[3\]: name 'l0' repeats layers\[0\]"),
    (lambda d: d["layers"][0].update(ops=[1]), r"layers\[0\].ops: every op must be a string"),
    (lambda d: d.update(layers=[], edges=[]), "at least one layer"),
    (lambda d: d["edges"].append([2, 9]), r"edges\[4\]: edge 2->9 names a layer that does not exist"),
    (lambda d: d["edges"].append([3, 1]), r"edge 3->1 does not go forward"),
    (lambda d: d["edges"].append([1, 1]), r"edge 1->1 does not go forward"),
    (lambda d: d["edges"].append([0, 1]), r"edge 0->1 is listed twice"),
    (lambda d: d["edges"].append([0]), r"edges\[4\]: expected a pair"),
    (lambda d: d.update(method="magic"), "unknown method 'magic'"),
    (lambda d: d.update(granularity="tiny"), "unknown granularity 'tiny'"),
    (lambda d: d.update(depth=0), "depth: must be >= 1"),
    (lambda d: d["inputs"][0].update(shape=[16, -1]), r"inputs\[0\].shape: every dimension"),
    (lambda d: d.update(model={"spec": "x:y"}), "model.kwargs: missing field"),
    (lambda d: d.update(step_ms=-2), "step_ms: must be >= 0"),
])
def test_every_validation_error_names_file_field_and_fix(edit, message):
    with pytest.raises(ArtifactError, match=message) as info:
        Profile.from_json(_broken(edit), "m.profile.json")
    text = str(info.value)
    assert text.startswith("m.profile.json: ") and ";" in text and "\n" not in text


def test_a_profile_that_is_not_an_object_is_refused():
    with pytest.raises(ArtifactError, match="not a pdtool artifact"):
        Profile.from_json([1, 2], "x.json")


def test_constructing_an_invalid_profile_directly_is_refused_too():
    with pytest.raises(ArtifactError, match="does not go forward"):
        make_profile(edges=((2, 1),))


def test_imported_profiles_may_have_no_model():
    profile = make_profile(model=None, method="pipedream")
    assert Profile.from_json(copy.deepcopy(profile.to_json())).model is None
