"""The files pdtool reads and writes, each checked on load against its JSON schema (`schemas`).

- `profile`: a model's layer graph with per-layer costs (`pd profile` -> `pd plan`);
- `cluster`: the machines, level by level (`pd plan --cluster`);
- `plan`: stages, replicas and predictions (`pd plan` -> `pd train`, `pd simulate`, `pd show`);
- `checkpoint`: checkpoint folders (shards and a manifest) of `pd train`;
- `pipedream`: the original PipeDream's `graph.txt` profiles, read as a profile.

Reading an artifact never runs code (the plan and the profile name a model factory, which only
`pd train` and `pd profile` import). Pure, but for `checkpoint` (torch's shard files).
"""
