"""Where the evaluation rounds go among a worker's lowered ops (`runtime.worker.evaluation`)."""
from pdtool.runtime.run import evaluation_points as points
from pdtool.runtime.worker.evaluation import Evaluation, with_evaluations
from pdtool.schedule import generate, lower


def test_points_fall_every_n_steps_and_at_the_end_when_asked():
    assert points(12, 2, 3, False) == (6, 12)
    assert points(12, 2, 4, True) == (8, 12)
    assert points(12, 2, None, True) == (12,)
    assert points(12, 2, None, False) == ()


def test_each_round_comes_after_the_drain_and_before_the_next_minibatch_on_first_replicas_only():
    schedule = generate("pipedream", (2, 1), 8, drain_every=4)
    low = lower(schedule)
    evaluation = Evaluation(points(8, 1, 4, True), batches=2, minibatches=8)
    first, second, last = (low.workers[rank] for rank in (0, 1, 2))  # stage 0 replicas 0, 1; stage 1
    ops = with_evaluations(first, [0], 0, [0, 2], evaluation)
    text = " ".join(map(str, ops))
    # stage 0's first replica: the round after its last op of minibatches 0-3, before its first of 4-7
    head, tail = text.split("0E8 send>2 0E9 send>2", 1)
    assert all(int(t.split("F")[-1].split("B")[-1]) < 4 for t in head.split() if "F" in t or "B" in t)
    assert "0E10 send>2 0E11 send>2" in tail and tail.endswith("0E10 send>2 0E11 send>2")
    assert with_evaluations(second, [0], 1, [0, 2], evaluation) == second  # other replicas take no part
    ends = " ".join(map(str, with_evaluations(last, [1], 0, [0, 2], evaluation)))
    assert "recv<0 1E8 recv<0 1E9" in ends and ends.endswith("recv<0 1E10 recv<0 1E11")
    assert evaluation.round_of(11) == (1, 1)


def test_a_worker_of_several_stages_evaluates_each_in_order_and_hands_its_own_over():
    schedule = generate("interleaved", (1, 1, 1, 1), 4, 4, placement=(0, 1, 0, 1))
    low = lower(schedule)
    evaluation = Evaluation((4,), batches=1, minibatches=4)
    first = " ".join(map(str, with_evaluations(low.workers[0], [0, 2], 0, [0, 1, 0, 1], evaluation)))
    second = " ".join(map(str, with_evaluations(low.workers[1], [1, 3], 0, [0, 1, 0, 1], evaluation)))
    assert first.endswith("0E4 send>1 recv<1 2E4 send>1") and second.endswith("recv<0 1E4 send>0 recv<0 3E4")
    v = generate("zbv", (1, 1, 1, 1), 4, 4, placement=(0, 1, 1, 0))
    inner = " ".join(map(str, with_evaluations(lower(v).workers[1], [1, 2], 0, [0, 1, 1, 0], evaluation)))
    assert inner.endswith("recv<0 1E4 2E4 send>0")  # stages 1 and 2 on one worker: handed over in the process
