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
