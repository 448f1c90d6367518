"""The mode table (`pdtool.schedule.modes`): one row per mode, `resolve`, and nothing outside
`schedule/` that sorts modes by name."""
import ast
from pathlib import Path

import pytest

from pdtool.errors import ScheduleError
from pdtool.schedule import (
    MODES, TABLE, Mode, check_parameters, generate, modes_where, peak_versions, resolve, rules, stash_depth, validate,
)
from pdtool.schedule import modes
from pdtool.sim.simulate import simulate
from test_simulate import make

SRC = Path(__file__).resolve().parents[2] / "src" / "pdtool"


def test_the_table_is_the_list_of_modes_and_every_row_is_consistent():
    assert MODES == ("pipedream", "vsync", "2bw", "flush", "gpipe", "zb", "zb2")
    # the multi-chunk rows are planned, checked and simulated; they join MODES once workers run them (issue 37)
    assert tuple(TABLE) == MODES + ("interleaved", "zbv", "dualpipev") and all(TABLE[m].placement for m in TABLE if m not in MODES)
    for name, row in TABLE.items():
        assert row.name == name and rules(name) is row
        assert row.steps in (modes.ROUND, modes.GROUP) and row.order in (modes.ONE_F_ONE_B, modes.ALL_FORWARD)
        assert row.split or not row.lag  # a weight lag only where backwards are split
        assert not (row.per_round and row.ties)  # stages that step at different times cannot keep copies equal
    assert modes_where(ties=True) == ("2bw", "flush", "gpipe", "zb", "zb2")
    assert modes.DEFAULT in MODES and rules(modes.DEFAULT_TIED).ties and not rules(modes.DEFAULT).ties


def test_unknown_modes_are_one_line_that_lists_the_table():
    with pytest.raises(ScheduleError, match=r"unknown schedule mode 'zb3'; use one of pipedream, vsync, 2bw, flush, "
                                            r"gpipe, zb, zb2$"):
        rules("zb3")
    with pytest.raises(ScheduleError, match="unknown schedule mode"):
        resolve(None, "zb3", (1, 1))


@pytest.mark.parametrize("mode, plan_mode, replicas, group, expected", [
    (None, "pipedream", (1, 1, 1), None, ("pipedream", 1, 1)),
    (None, "pipedream", (3, 1), None, ("pipedream", 1, 3)),  # one step per round of stage 0's replicas
    ("flush", "pipedream", (1, 1, 1), None, ("flush", 3, 3)),  # m defaults to the stages
    ("2bw", "pipedream", (3, 1), None, ("2bw", 3, 3)),  # ... or the span a replica holds in flight
    ("gpipe", "pipedream", (1, 1), 8, ("gpipe", 8, 8)),
    (None, "vsync", (2, 2), None, ("vsync", 1, 2)),
])
def test_resolve_gives_the_effective_mode_group_and_minibatches_per_step(mode, plan_mode, replicas, group, expected):
    run = resolve(mode, plan_mode, replicas, group)
    assert (run.name, run.group, run.per_step) == expected
    schedule = generate(run.name, replicas, 4 * run.per_step, run.group)
    assert schedule.group == run.group  # the generator's own default is the resolver's


def test_messages_that_list_modes_come_from_the_table():
    with pytest.raises(ScheduleError, match=r"or use 2bw, flush, gpipe, zb or zb2$"):
        check_parameters("pipedream", (1, 1), 4, 2)
    assert modes.ties_refusal("2bw") is None
    assert "use --mode 2bw, flush, gpipe, zb or zb2 " in modes.ties_refusal("vsync")


def test_a_new_mode_is_one_row(monkeypatch):
    """A mode that splits every backward but runs each W right after its B (no lag): one row,
    and the generator, validator, version analysis and simulator all run it."""
    row = Mode(name="zb0", about="zb with no weight lag", steps=modes.GROUP, flushes=True, split=True, ties=True,
               versions_kept=1)
    monkeypatch.setitem(TABLE, "zb0", row)
    schedule = generate("zb0", (1, 1), 4, 2)
    validate(schedule)
    assert " ".join(map(str, schedule.workers[1])) == "1F0 1B0 1W0 1F1 1B1 1W1 1U 1F2 1B2 1W2 1F3 1B3 1W3 1U"
    assert " ".join(map(str, schedule.workers[0][:4])) == "0F0 0F1 0B0 0W0"
    assert stash_depth(schedule, 0) == 2 and set(peak_versions(schedule).values()) == {1}
    assert "zb0" in modes_where(split=True) and "zb0" in modes.ties_refusal("pipedream")
    result = simulate(make([(1.0, 2.0, 1), (1.0, 2.0, 1)]), "zb0", minibatches=8)
    assert result.mode == "zb0" and result.group == 2 and {e.kind for e in result.events} == {"F", "B", "W", "U"}


def _mode_comparisons(path: Path) -> list[str]:
    """`x == "flush"`, `mode in ("zb", "zb2")` and the like in one source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        for operand in [node.left, *node.comparators]:
            names = ([operand] if isinstance(operand, ast.Constant) else
                     list(operand.elts) if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [])
            if any(isinstance(n, ast.Constant) and n.value in MODES for n in names):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    return found


def test_no_source_outside_the_schedule_package_compares_mode_names():
    files = [p for p in SRC.rglob("*.py") if "schedule" not in p.relative_to(SRC).parts]
    assert len(files) > 50
    assert [hit for path in files for hit in _mode_comparisons(path)] == []
