"""`pd train`, by process: `launcher/` (the launcher's side), `worker/` (one worker's side), and
between them `run` (what crosses: the run's configuration, its resolved schedule, the worker's
report), `peers` (the job's store: joining it, signs of life, a silent peer) and `device`
(where a worker computes)."""
