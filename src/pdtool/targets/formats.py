"""The files `pd export-plan` writes, one per target, from an `Export`.

- torchtitan: a TOML fragment of its job config (`[parallelism]`, `[training]`,
  `[activation_checkpoint]`), the keys its documentation shows;
- Megatron-Core: a bash array of its arguments (`PIPELINE_ARGS=( ... )`, the form of its
  example scripts), with `--pipeline-model-parallel-layout` and, where the layout is that
  simple, the uneven first/last stage layer counts it equals;
- torch.distributed.pipelining: a JSON (`pdtool.pipelining/1`) that names each stage's modules,
  its pipeline rank, and the schedule class (docs/export-plan.md builds the stages from it).

Every file starts with where it came from and what `pd simulate` says the target's run takes.
Pure: no torch.
"""
from __future__ import annotations

import json
import shlex

from .export import Export, NAMES

PIPELINING_SCHEMA = "pdtool.pipelining/1"


def header(export: Export, command: str, comment: str) -> list[str]:
    lines = [f"{NAMES[export.target]} settings of a pdtool plan, written by: {command}",
             f"pd simulate: what {NAMES[export.target]} runs takes {export.target_ms:.3f} ms per minibatch "
             f"(the plan as pdtool runs it: {export.plan_ms:.3f} ms)"]
    lines += [f"approximated: {note}" for note in export.notes]
    return [f"{comment} {_one_line(line)}" for line in lines]


def _one_line(text: str) -> str:
    """`text` with its control characters escaped: a comment stays one line (a path given on the command
    line may hold a newline, and the Megatron file is sourced by bash)."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def torchtitan(export: Export, command: str, csv_name: str | None) -> str:
    """The TOML fragment (module docstring)."""
    lines = header(export, command, "#")
    lines += ["# torchtitan 0.1-0.2 read this file (--job.config_file); torchtitan 0.3 takes the same settings as "
              "command-line overrides:", "#   " + " ".join(torchtitan_overrides(export, csv_name)),
              "# (torchtitan's main branch names module_fqns_per_model_part "
              "pipeline_parallel_module_fqns_per_model_part)",
              "", "[parallelism]",
              f"pipeline_parallel_degree = {export.pipeline}",
              f"pipeline_parallel_schedule = {_string(export.schedule)}"]
    if csv_name:
        lines.append(f"pipeline_parallel_schedule_csv = {_string(csv_name)}")
    lines.append(f"pipeline_parallel_microbatch_size = {export.microbatch}")
    lines.append("module_fqns_per_model_part = [")
    lines += [f"    [{', '.join(_string(name) for name in names)}]," for names in export.modules]
    lines.append("]")
    sharded = export.shard == "optimizer" and export.replicas > 1
    lines += [f"data_parallel_replicate_degree = {1 if sharded else export.replicas}",
              f"data_parallel_shard_degree = {export.replicas if sharded else 1}",
              "", "[training]",
              f"local_batch_size = {export.microbatch * export.microbatches}  "  # per data-parallel rank
              f"# {export.microbatches} microbatches of {export.microbatch}",
              "", "[activation_checkpoint]",
              f"mode = {_string('full' if all(export.recompute) else 'none')}", ""]
    return "\n".join(lines)


def torchtitan_overrides(export: Export, csv_name: str | None) -> list[str]:
    """The TOML's settings as torchtitan 0.3's command-line overrides (its tyro parser reads a list of
    strings as one comma-separated word, a list of lists as one such word per inner list)."""
    sharded = export.shard == "optimizer" and export.replicas > 1
    words = ["--parallelism.pipeline_parallel_degree", str(export.pipeline),
             "--parallelism.pipeline_parallel_schedule", export.schedule]
    if csv_name:
        words += ["--parallelism.pipeline_parallel_schedule_csv", shlex.quote(csv_name)]
    words += ["--parallelism.pipeline_parallel_microbatch_size", str(export.microbatch),
              "--parallelism.module_fqns_per_model_part", *(",".join(names) for names in export.modules),
              "--parallelism.data_parallel_replicate_degree", str(1 if sharded else export.replicas),
              "--parallelism.data_parallel_shard_degree", str(export.replicas if sharded else 1),
              "--training.local_batch_size", str(export.microbatch * export.microbatches),
              f"activation_checkpoint:{'full' if all(export.recompute) else 'none'}"]
    return words


def megatron(export: Export, command: str) -> str:
    """The bash array of Megatron-Core arguments (module docstring)."""
    stages = export.megatron
    layout = _layout([stage.layout() for stage in stages])
    layers = sum(len(stage.blocks) for stage in stages)
    arguments = [("--pipeline-model-parallel-size", export.pipeline),
                 ("--pipeline-model-parallel-layout", layout),
                 ("--num-layers", layers),
                 ("--micro-batch-size", export.microbatch),
                 ("--global-batch-size", export.microbatch * export.microbatches * export.replicas)]  # all replicas
    if export.shard == "optimizer":
        arguments.append(("--use-distributed-optimizer", None))
    if all(export.recompute):
        arguments += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                      ("--recompute-num-layers", 1)]
    if not export.tied:
        arguments.append(("--untie-embeddings-and-output-weights", None))
    lines = header(export, command, "#")
    lines.append(f"# {export.pipeline} pipeline ranks x {export.replicas} data-parallel "
                 f"(world size {export.pipeline * export.replicas} without tensor parallelism)"
                 + (f"; virtual pipeline size {export.chunks}: Megatron reads it from the layout's "
                    f"{len(stages)} stages" if export.chunks > 1 else ""))
    simple = _first_last(stages, export.chunks)
    if simple:
        lines.append(f"# the layout equals --decoder-first-pipeline-num-layers {simple[0]} "
                     f"--decoder-last-pipeline-num-layers {simple[1]} (use those instead on a Megatron without it)")
    lines.append("PIPELINE_ARGS=(")
    lines += [f"    {flag}" + ("" if value is None else f" {shlex.quote(str(value))}") for flag, value in arguments]
    lines += [")", ""]
    return "\n".join(lines)


def pipelining(export: Export, command: str, plan_file: str, model: dict | None, csv_name: str | None) -> str:
    """The JSON for torch.distributed.pipelining (module docstring)."""
    record = {
        "schema": PIPELINING_SCHEMA,
        "command": command,
        "plan": plan_file,
        "model": model,
        "schedule": export.schedule,
        "schedule_csv": csv_name,
        "pipeline_degree": export.pipeline,
        "microbatch_size": export.microbatch,
        "n_microbatches": export.microbatches,
        "stages": [{"index": index, "rank": rank, "modules": list(names), "recompute": recompute}
                   for index, (rank, names, recompute) in enumerate(zip(export.stage_ranks, export.modules,
                                                                        export.recompute))],
        "data_parallel": {"degree": export.replicas,
                          "optimizer": "ZeroRedundancyOptimizer" if export.shard == "optimizer" else None},
        "simulated_ms_per_minibatch": round(export.target_ms, 6),
        "plan_simulated_ms_per_minibatch": round(export.plan_ms, 6),
        "approximated": list(export.notes),
    }
    return json.dumps(record, indent=2) + "\n"


def _string(value: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(value)


def _layout(stages: list[str]) -> str:
    """The stages joined by `|`, runs of equal middle stages as `(stage|)*n` (Megatron's grammar)."""
    parts: list[str] = []
    i = 0
    while i < len(stages):
        j = i
        while j + 1 < len(stages) - 1 and stages[j + 1] == stages[i]:
            j += 1
        run = j - i + 1
        if run > 2 and i > 0:
            parts.append(f"({stages[i]}|)*{run}")
            i = j + 1
            continue
        parts.append(stages[i] + ("|" if i < len(stages) - 1 else ""))
        i += 1
    return "".join(parts)


def _first_last(stages, chunks: int) -> tuple[int, int] | None:
    """(first, last) stage layer counts when the layout is Megatron's uneven split: one chunk,
    the embedding on the first stage, the loss on the last, equal middle stages."""
    if chunks != 1 or len(stages) < 3:
        return None
    middle = {len(s.blocks) for s in stages[1:-1]}
    if len(middle) != 1 or not stages[0].embedding or not stages[-1].loss or not stages[0].blocks or \
            not stages[-1].blocks or any(s.embedding or s.loss for s in stages[1:-1]) or stages[0].loss or \
            stages[-1].embedding:  # Megatron wants at least one layer on the first and the last stage
        return None
    return len(stages[0].blocks), len(stages[-1].blocks)
