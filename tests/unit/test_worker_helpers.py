"""Small pure helpers of runtime.worker.interpreter."""
from pdtool.runtime.worker.interpreter import _next_forwards
from pdtool.schedule import Action


def test_next_forwards_names_the_first_forward_after_each_action():
    actions = [Action.parse(text) for text in "0F0 0F1 0B0 0U 0F2 0B1 0U 0B2 0U".split()]
    assert _next_forwards(actions) == [1, 2, 2, 2, None, None, None, None, None]

