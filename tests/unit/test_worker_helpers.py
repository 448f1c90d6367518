"""Small pure helpers of runtime.worker.interpreter."""
from pdtool.runtime.worker.interpreter import _next_forwards
from pdtool.schedule import Action


def test_next_forwards_names_the_first_forward_after_each_action():
    actions = [Action.parse(text) for text in "0F0 0F1 0B0 0U 0F2 0B1 0U 0B2 0U".split()]
    assert _next_forwards(actions) == [1, 2, 2, 2, None, None, None, None, None]



def test_the_input_stage_makes_its_next_minibatch_only_where_it_would_wait():
    """Making a minibatch (4.4 ms of bench/train_speed.py's 80 ms on the busiest worker) fills a wait
    for a message; where the message is already here it would only delay what follows, and the
    forward makes it instead."""
    from types import SimpleNamespace

    from pdtool.runtime.worker.interpreter import Interpreter

    made, here = [], set()
    link = SimpleNamespace(arrived=lambda key: key in here, wait_recv=lambda key: ["message", key])
    context = SimpleNamespace(link=link, batch=lambda b: made.append(b) or ("inputs", "target"))
    worker = SimpleNamespace(context=context, upcoming=[5, 6, None], made={}, inbox={}, at=0,
                             key=lambda op: (op.direction, op.minibatch))
    here.add((1, 0))
    Interpreter.recv(worker, SimpleNamespace(direction=1, minibatch=0))  # here already: nothing made
    assert made == [] and worker.inbox == {(1, 0): ["message", (1, 0)]}
    worker.at = 1
    Interpreter.recv(worker, SimpleNamespace(direction=1, minibatch=1))  # not here yet: minibatch 6 made first
    assert made == [6] and 6 in worker.made
    worker.at = 2
    Interpreter.recv(worker, SimpleNamespace(direction=1, minibatch=2))  # no forward ahead: nothing to make
    assert made == [6]


def test_a_workers_measured_memory_leaves_out_file_pages(monkeypatch):
    """Issue 35 item 10: the code of torch's libraries a worker first runs (25-27 MiB a worker on
    bench/recompute.py) is file pages, which no stage holds and the page cache shares: measured
    beside the plan, they read as activations."""
    from types import SimpleNamespace

    import torch

    from pdtool.runtime.worker import memory

    MB = 2**20
    files = iter([10 * MB, 40 * MB])  # at the start, and once training is done
    monkeypatch.setattr(memory, "file_bytes", lambda: next(files))
    monkeypatch.setattr(memory, "resident_bytes", lambda: 300 * MB)
    monkeypatch.setattr(memory, "peak_resident_bytes", lambda: 400 * MB)
    cpu = torch.device("cpu")
    base = memory.start(cpu)
    assert base == 290 * MB
    worker = SimpleNamespace(live=[torch.zeros(MB // 4)], peak_versions=0, stepper=SimpleNamespace(optimizer=None))
    measured = memory.measure(worker, cpu, base, startup=350 * MB)
    assert measured["files"] == 40 * MB and measured["peak"] == 400 * MB  # the whole process's, as before
    assert measured["training"] == 360 * MB
    assert measured["activations"] == (360 - 290 - 2) * MB  # less the weights and their gradients
