"""The launcher's one line for a failed job (`runtime.launcher.launch._explain`): which worker's report
it shows, and in whose words."""
import json
from dataclasses import dataclass

from pdtool.runtime.launcher.launch import _explain


@dataclass
class Info:
    """What torch's launcher knows of a failed worker (its ProcessFailure)."""

    error_file: str
    timestamp: int
    exitcode: int = 1
    local_rank: int = 0

    def signal_name(self):
        return "SIGKILL" if self.exitcode == -9 else "?"


@dataclass
class Failure:
    failures: dict


def _info(tmp_path, rank, message, timestamp, exitcode=1):
    path = tmp_path / f"error-{rank}.json"
    if message is not None:
        path.write_text(json.dumps({"message": {"message": message}}))
    return Info(str(path), timestamp, exitcode)


def test_a_recorded_error_wins_over_the_peer_it_killed_even_a_second_later(tmp_path):
    """Slow data past --timeout: rank 1 waited, recorded why, killed rank 0; rank 0 died first."""
    failure = Failure({0: _info(tmp_path, 0, None, 100, -9),
                       1: _info(tmp_path, 1, "LaunchError: rank 1 waited 5 s for rank 0 to send, which stopped "
                                "answering (hung, stopped, or busy longer than that)", 101)})
    line, raised = _explain(failure)
    assert line.startswith("worker rank 1 failed: rank 1 waited 5 s for rank 0") and "exit code" not in line


def test_a_worker_killed_from_outside_wins_over_a_peer_that_exited_without_a_word_first(tmp_path):
    """SIGKILL of rank 1 on a busy machine: rank 0 saw its peer go and exited 1, a second earlier by the clock."""
    failure = Failure({0: _info(tmp_path, 0, None, 100, 1), 1: _info(tmp_path, 1, None, 101, -9)})
    line, raised = _explain(failure)
    assert line.startswith("worker rank 1 failed: exit code -9 (SIGKILL)") and not raised


def test_the_transports_words_for_a_lost_peer_become_pdtools(tmp_path):
    gloo = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:29500: "
            "Connection reset by peer GLHF!")
    line, raised = _explain(Failure({2: _info(tmp_path, 2, gloo, 100), 3: _info(tmp_path, 3, gloo, 100)}))
    assert line.startswith("worker rank 2 failed: it lost its connection to another worker of the job, which went "
                           "away") and "GLHF" not in line and "pair.cc" not in line and not raised


def test_pdtools_own_words_for_a_lost_peer_stay(tmp_path):
    own = "LaunchError: rank 0 waited for rank 1 to send: rank 1's remote process exited"
    line, _ = _explain(Failure({0: _info(tmp_path, 0, own, 100)}))
    assert line == "worker rank 0 failed: rank 0 waited for rank 1 to send: rank 1's remote process exited; the " \
                   "other workers were stopped"


def test_an_error_torchs_launcher_left_out_is_read_from_the_logs(tmp_path):
    """Slow data past --timeout: rank 0 was killed by rank 1, whose end the launcher never saw."""
    logs = tmp_path / "logs"
    (logs / "pdtool-x" / "attempt_0" / "1").mkdir(parents=True)
    (logs / "pdtool-x" / "attempt_0" / "1" / "error.json").write_text(json.dumps({"message": {"message": (
        "LaunchError: rank 1 waited 3 s for the activations of minibatch 0 from rank 0, which stopped answering")}}))
    failure = Failure({0: Info(str(tmp_path / "none.json"), 100, -9, local_rank=0)})
    line, _ = _explain(failure, str(logs))
    assert line.startswith("worker rank 1 failed: rank 1 waited 3 s for the activations"), line
    assert _explain(failure)[0].startswith("worker rank 0 failed: exit code -9 (SIGKILL)")


def test_verbose_shows_the_reported_workers_own_traceback(tmp_path):
    """Issue 35 item 19: under pd's launcher --verbose showed torchelastic's ProcessExitedException, not the
    worker's traceback, though the line said it would."""
    import json
    from types import SimpleNamespace

    from pdtool.runtime.launcher.launch import _callstack

    error = tmp_path / "error.json"
    error.write_text(json.dumps({"message": {"message": "RuntimeError: dtype mismatch", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\n  File \"stage.py\", line 3\nRuntimeError: dtype mismatch\n",
        "timestamp": "1"}}}))
    failure = SimpleNamespace(failures={1: SimpleNamespace(error_file=str(error), timestamp=1, exitcode=1),
                                        0: SimpleNamespace(error_file="", timestamp=2, exitcode=-15)})
    text = _callstack(failure)
    assert text.startswith("worker rank 1's traceback:\nTraceback (most recent call last):")
    assert text.rstrip().endswith("RuntimeError: dtype mismatch")


def test_torch_launch_config_gets_the_shutdown_timeout_only_where_it_has_one():
    """torch 2.13's LaunchConfig takes `shutdown_timeout`; the torch of a GPU image may be older (2.11 on the
    H200 that ran bench/gpu.py lacks it): the launcher passes it only where the field exists."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    from pdtool.runtime.launcher.launch import SHUTDOWN_S, _shutdown

    assert _shutdown(LaunchConfig) == {"shutdown_timeout": SHUTDOWN_S}
    assert _shutdown(dataclasses.make_dataclass("Older", [("min_nodes", int)])) == {}
