"""A worker process of `pd train`: `main` builds its stage and links, `interpreter` executes its
lowered ops; `executor` (`StageWorker`: forward, backward, weight versions), `stepper` (its optimizer step),
`split_backward` (B and W), `comm` and `shm` (messages), `tied` (shared weights) and `shards`
(its checkpoint shard) do the work. It gets a `runtime.run.RunConfig` and returns a
`WorkerReport`."""
