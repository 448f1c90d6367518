"""The memory model's terms beyond weights, gradients and optimizer state (issue 35 item 10): what
autograd saves (the profile's saved_bytes), the temporaries of the optimizer step and of gradient
accumulation, and the messages a process group shares with the stash."""
import dataclasses

import pytest

from pdtool.artifacts.cluster import parse_cluster
from pdtool.planner import make_plan
from pdtool.planner.costmodel import Memory, memory_model, step_temporaries
from pdtool.sim.prediction import planned_memory
from test_plan import chain_profile

MB = 2**20


def _profile(saved=None):
    profile = chain_profile([10, 10, 10, 10], [1 * MB, 4 * MB, 2 * MB, 1 * MB], [MB] * 4)
    if saved is None:
        return profile
    return dataclasses.replace(profile, layers=tuple(dataclasses.replace(layer, saved_bytes=s)
                                                     for layer, s in zip(profile.layers, saved)))


def test_a_stage_stashes_what_its_layers_save_not_their_outputs():
    without = make_plan(_profile(), parse_cluster("2x10GB/s"), straight=True)
    measured = make_plan(_profile([3 * MB, 0, 5 * MB, 0]), parse_cluster("2x10GB/s"), straight=True)
    assert [s.layers for s in measured.stages] == [s.layers for s in without.stages] == [(0, 1), (2, 3)]
    first, second = measured.stages
    assert first.activation_bytes == 3 * MB  # stage 0 receives nothing; layer 1 saves nothing
    assert second.activation_bytes == second.in_bytes + 5 * MB
    assert [s.activation_bytes for s in without.stages] == [2 * MB, MB + 2 * MB]  # the outputs (older profiles)


@pytest.mark.parametrize("optimizer, decay, mode, factor", [
    ("adamw", 0.1, "pipedream", 2.0),  # sqrt(v), then divided: two tensors of a parameter's size
    ("adam", 0.0, "pipedream", 2.0),
    ("adam", 0.1, "pipedream", 3.0),   # Adam adds the decay to the gradient: one more
    ("sgd", 0.0, "pipedream", 0.0),    # momentum updated in place
    ("sgd", 0.1, "pipedream", 1.0),    # the decayed gradient
    ("sgd", 0.0, "flush", 1.0),        # a backward into a gradient that holds earlier microbatches'
    ("adamw", 0.0, "flush", 2.0),      # never at once: the larger of the two
])
def test_temporaries_are_the_optimizers_or_accumulations_in_units_of_the_largest_layer(optimizer, decay, mode, factor):
    plan = make_plan(_profile(), parse_cluster("2x10GB/s"), straight=True, mode=mode)
    assert [s.largest_layer_bytes for s in plan.stages] == [4 * MB, 2 * MB]
    planned = planned_memory(plan, None, None, optimizer, weight_decay=decay)
    for stage in plan.stages:
        assert planned[stage.ranks[0]].get("temporaries", 0) == factor * stage.largest_layer_bytes


def test_over_a_process_group_a_received_activation_is_the_stashed_input_itself():
    plan = make_plan(_profile(), parse_cluster("2x10GB/s"), straight=True)
    rings = planned_memory(plan, None, None, "sgd")
    group = planned_memory(plan, None, None, "sgd", rings={0: False, 1: False})
    last = plan.stages[1]
    k = last.in_flight
    assert rings[1]["messages"] - group[1]["messages"] == k * last.in_bytes
    assert rings[0]["messages"] == group[0]["messages"]  # stage 0 receives no activations


def test_the_planner_leaves_room_for_the_temporaries_under_a_memory_limit():
    """A limit that the fastest plan fits with SGD but not with Adam's step temporaries beside
    its state: pd plan picks another cut rather than a plan whose step would not fit."""
    profile = chain_profile([10] * 5, [4 * MB, MB, MB, MB, MB], [MB] * 5)
    free = make_plan(profile, parse_cluster("2x10GB/s"), straight=True, optimizer_slots=2)
    model = memory_model(None, 2, "fp32")
    worst = max(free.stages, key=lambda s: s.memory_bytes)
    assert worst.memory_bytes == pytest.approx(sum(model.terms(
        worst.param_bytes, worst.activation_bytes, worst.in_flight, cut=(worst.in_bytes, worst.out_bytes),
        largest=worst.largest_layer_bytes).values()), abs=1)
    limit = worst.memory_bytes - 1
    assert worst.memory_bytes - 2 * worst.largest_layer_bytes < limit  # it fits but for the temporaries
    tight = make_plan(profile, parse_cluster("2x10GB/s", f"{limit}B"), straight=True, optimizer_slots=2)
    assert [s.layers for s in tight.stages] != [s.layers for s in free.stages]
    assert max(s.memory_bytes for s in tight.stages) <= limit


def test_step_temporaries():
    assert step_temporaries(2) == 2.0 and step_temporaries(1) == 0.0 and step_temporaries(1, True) == 1.0
    assert step_temporaries(2, True, decoupled=False) == 3.0 and step_temporaries(2, True) == 2.0
    assert Memory(limit=1.0).terms(8.0, 1.0, 1, largest=4.0).get("temporaries") is None  # none asked for
