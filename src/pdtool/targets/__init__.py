"""Plans for the runtimes people already run: `pd export-plan --to torchtitan|megatron|pipelining`.

`units` says where each target can cut a model (module names, Megatron's layer kinds), `export`
what the target runs for a plan (schedule, batch, replicas, recomputation; refusals and
approximations, priced by pdtool's simulator), `formats` the file each target reads, and
`torch_stage` (the only module here that imports torch) builds a stage's module from those names
the way torchtitan does. Pure otherwise.
"""
