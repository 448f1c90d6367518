"""`--metrics` written as the run goes: rows appear while the workers still train, and the rows
written live are the ones the whole file has at the end."""
import threading
import time

from helpers import config_for, plan_with

from pdtool.runtime.launcher.session import run
from pdtool.views.metrics import write_metrics


def test_metric_rows_appear_during_the_run_and_equal_the_final_file(tmp_path):
    plan, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="pipedream")
    live = tmp_path / "live.csv"
    config = config_for(path, steps=200, metrics=str(live), return_weights=False)
    seen, running = set(), threading.Event()
    running.set()

    def watch():  # counts the rows while the run goes on (run() itself must be on the main thread)
        while running.is_set():
            if live.exists():
                seen.add(len(live.read_text().splitlines()) - 1)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = run(config)
    finally:
        running.clear()
        watcher.join()
    assert any(0 < rows < 200 for rows in seen), seen  # rows while the workers were still training
    rows = live.read_text().splitlines()
    assert len(rows) == 201 and rows[0].startswith("step,minibatches,loss,samples_per_s,lr,grad_norm,eval_loss,eval_accuracy,busy_rank0")
    final = tmp_path / "final.csv"
    write_metrics(str(final), result)
    assert final.read_text().splitlines() == rows


def test_metrics_on_a_full_disk_warn_once_train_on_and_say_at_the_end_what_was_not_written(tmp_path, monkeypatch):
    """Issue 35 item 12: --metrics on a full disk gave 3 tracebacks (the metrics thread, the launcher's stop) and
    no summary. Training goes on, one warning says so, the summary comes, and the end says the file is missing."""
    import errno

    from click.testing import CliRunner

    from pdtool.cli import cli
    from pdtool.errors import ArtifactError
    from pdtool.runtime.launcher import live as live_module
    from pdtool.views import metrics as metrics_module

    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="pipedream")
    rows = []

    def full(self, row):
        rows.append(row)
        if len(rows) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.file.write(row + "\n")

    monkeypatch.setattr(live_module.LiveMetrics, "_row", full)
    monkeypatch.setattr(metrics_module, "write_metrics", lambda *a: (_ for _ in ()).throw(
        ArtifactError("cannot write m.csv: No space left on device; free space or choose another output")))
    result = CliRunner().invoke(cli, ["train", str(path), "--steps", "40", "--metrics", str(tmp_path / "m.csv"),
                                      "--threads", "1", "--quiet"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    warnings = [line for line in result.stderr.splitlines() if "cannot write it (No space left on device)" in line]
    assert len(warnings) == 1 and warnings[0].startswith("pd: warning: --metrics")
    assert "time per minibatch" in result.stdout  # the summary
    assert result.stderr.strip().splitlines()[-1].startswith("pd: error: --metrics") and \
        "was not written" in result.stderr.strip().splitlines()[-1]


def test_a_tensorboard_folder_that_cannot_be_written_is_one_line_before_any_worker(tmp_path):
    from click.testing import CliRunner

    from pdtool.cli import cli

    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="pipedream")
    (tmp_path / "afile").write_text("")
    result = CliRunner().invoke(cli, ["train", str(path), "--steps", "2", "--tensorboard", str(tmp_path / "afile" / "tb")])
    assert result.exit_code != 0 and "--tensorboard" in result.stderr and "cannot write there" in result.stderr
    assert "starting" not in result.stderr
