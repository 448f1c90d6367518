"""Where a process sits in a job that a cluster's own launcher started: torchrun's variables
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or SLURM's
(SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE, the host list
SLURM_STEP_NODELIST in its compressed form, SLURM_JOB_ID for the port). `detect` says which
launcher started this process, `place` where it sits. Pure standard library; `runtime.launcher.external`
runs the job from there.
"""
from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass
from typing import Mapping

from ...errors import LaunchError

LAUNCHERS = ("auto", "local", "torchrun", "slurm")
SLURM_PORTS = (10000, 20000)
"""MASTER_PORT under SLURM when not set: 10000 + SLURM_JOB_ID mod 20000 (below Linux's ephemeral ports, 32768 on)."""
_SPECIAL_STEPS = 4294967290
"""SLURM's step ids from here on are not srun's steps (the batch script's, the extern and interactive steps)."""


@dataclass(frozen=True, kw_only=True)
class Place:
    """Where this process sits in a job that a cluster's launcher started."""

    launcher: str      # torchrun or slurm
    rank: int
    world: int
    local_rank: int    # among the workers of its machine
    local_world: int   # workers of its machine
    machines: int
    master_addr: str   # where the job's store is (rank 0's machine under SLURM)
    master_port: int

    def export(self) -> None:
        """Set the environment that torch's env:// rendezvous and `worker_main` read."""
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world), LOCAL_RANK=str(self.local_rank),
                          LOCAL_WORLD_SIZE=str(self.local_world), MASTER_ADDR=self.master_addr,
                          MASTER_PORT=str(self.master_port))


def detect(choice: str, env: Mapping[str, str] = os.environ) -> str:
    """The launcher `--launcher choice` means here: `auto` is torchrun when TORCHELASTIC_RUN_ID
    and RANK are set, slurm in an srun job step of more than one task, else local (pd train's own)."""
    if choice != "auto":
        return choice
    if env.get("TORCHELASTIC_RUN_ID") and env.get("RANK"):
        return "torchrun"
    step = env.get("SLURM_STEP_ID", "")
    if env.get("SLURM_PROCID") and step.isdigit() and int(step) < _SPECIAL_STEPS:
        return "slurm" if _number(env, "SLURM_NTASKS", 1) > 1 else "local"
    return "local"


def place(launcher: str, env: Mapping[str, str] = os.environ) -> Place | None:
    """Where this process sits under `launcher` (None for pd train's own launcher); one
    `LaunchError` line naming what is missing or malformed."""
    if launcher == "torchrun":
        if not env.get("RANK"):
            raise LaunchError("--launcher torchrun, but RANK is not set: start pd train with torchrun ... --no-python "
                              "pd train PLAN ... (or drop --launcher)")
        return _checked(
            Place(launcher="torchrun", rank=_number(env, "RANK"), world=_number(env, "WORLD_SIZE"),
                  local_rank=_number(env, "LOCAL_RANK"), local_world=_number(env, "LOCAL_WORLD_SIZE"),
                  machines=_number(env, "GROUP_WORLD_SIZE", 1), master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
                  master_port=_number(env, "MASTER_PORT"))
        )
    if launcher == "slurm":
        return _slurm_place(env)
    return None


def _checked(where: Place) -> Place:
    if not (where.rank < where.world and where.local_rank < where.local_world and 0 < where.master_port < 65536):
        raise LaunchError(f"{where.launcher} set rank {where.rank} of {where.world} (local {where.local_rank} of "
                          f"{where.local_world}), port {where.master_port}: not a place in a job; check the "
                          "launcher's environment (MASTER_PORT within 1-65535)")
    return where


def _slurm_place(env: Mapping[str, str]) -> Place:
    if not env.get("SLURM_PROCID"):
        raise LaunchError("--launcher slurm, but SLURM_PROCID is not set: start pd train with srun (srun pd train "
                          "PLAN ... in an allocation or an sbatch script), or drop --launcher")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    tasks = _number(env, "SLURM_STEP_NUM_TASKS", _number(env, "SLURM_NTASKS"))  # no more machines nor tasks than these
    # the step's machines hold its tasks; the job's (a fallback) are at most its node count
    machines = tasks if env.get("SLURM_STEP_NODELIST") else _number(env, "SLURM_JOB_NUM_NODES", MOST_MACHINES)
    hosts = expand_hosts(nodelist, machines) if nodelist else []
    addr = env.get("MASTER_ADDR") or (hosts[0] if hosts else "")
    if not addr:
        raise LaunchError("SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are not set, so the host of rank 0 is not "
                          "known: set MASTER_ADDR to it")
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or
                              env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_NTASKS") or "1", tasks)
    here = env.get("SLURMD_NODENAME")
    node = hosts.index(here) if here in hosts else _number(env, "SLURM_NODEID", 0)  # this machine in the step
    port = (_number(env, "MASTER_PORT") if env.get("MASTER_PORT") else
            slurm_port(_number(env, "SLURM_JOB_ID")))
    return _checked(
        Place(launcher="slurm", rank=_number(env, "SLURM_PROCID"), world=_number(env, "SLURM_NTASKS"),
              local_rank=_number(env, "SLURM_LOCALID", 0),
              local_world=per_node[node] if node < len(per_node) else per_node[0],
              machines=_number(env, "SLURM_STEP_NUM_NODES", _number(env, "SLURM_NNODES", max(len(hosts), 1))),
              master_addr=addr, master_port=port)
    )


MOST_MACHINES = 65536
"""The most machines a SLURM host list may name when nothing in the job says how many it has."""


def slurm_port(job_id: int) -> int:
    """The job's store port under SLURM when MASTER_PORT is not set (the same in every task)."""
    return SLURM_PORTS[0] + job_id % SLURM_PORTS[1]


def _number(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    """A count or index from the launcher's environment; one line when missing or malformed."""
    text = env.get(name)
    if text is None and default is not None:
        return default
    if text is None or not re.fullmatch(r"[0-9]{1,10}", text):
        raise LaunchError(f"{name}={text!r} in the environment is not a number"
                          + (" (the launcher sets it)" if text is not None else ": the launcher did not set it"))
    return int(text)


def expand_hosts(nodelist: str, most: int | None = None) -> list[str]:
    """SLURM's compressed host list, expanded in order: `node[01-03,7],gpu2` is node01, node02,
    node03, node7, gpu2 (a range keeps the width of its first number; several bracket groups in
    one name multiply). One `LaunchError` line when it is malformed, or names more than `most`
    machines (a step has at least one task on each: more hosts than tasks is a damaged list,
    never expanded)."""
    hosts: list[str] = []
    for item in _top_level(nodelist):
        parts = re.split(r"\[([^\[\]]*)\]", item)  # literal, range list, literal, ...
        if not item or any(c in part for part in parts[::2] for c in "[]"):
            raise _unreadable(nodelist)
        left = None if most is None else most - len(hosts)
        choices = [[part] if k % 2 == 0 else _range_list(part, nodelist, left) for k, part in enumerate(parts)]
        if left is not None and math.prod(len(c) for c in choices) > left:
            raise _too_many(nodelist, most)
        hosts.extend("".join(name) for name in itertools.product(*choices))
    return hosts


def _too_many(nodelist: str, most: int) -> LaunchError:
    return LaunchError(f"the SLURM host list {nodelist[:80]!r} names more machines than the step's {most} task(s); "
                       "check SLURM_STEP_NODELIST and SLURM_NTASKS, or set MASTER_ADDR to the host of rank 0")


def _top_level(nodelist: str) -> list[str]:
    """The comma-separated items of a host list, commas inside brackets left alone."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if depth not in (0, 1):
            raise _unreadable(nodelist)
        if c == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise _unreadable(nodelist)
    return items + [nodelist[start:]]


def _unreadable(nodelist: str, where: str = "") -> LaunchError:
    return LaunchError(f"cannot read the SLURM host list {nodelist!r}{where}; set MASTER_ADDR to the host of rank 0")


def _range_list(text: str, nodelist: str, most: int | None = None) -> list[str]:
    """`01-03,7` -> 01, 02, 03, 7 (at most `most` of them, else one line)."""
    found = []
    for piece in text.split(","):
        match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", piece)
        if not match or (match[2] is not None and int(match[2]) < int(match[1])):
            raise _unreadable(nodelist, f" (at {piece!r})")
        first, last = int(match[1]), int(match[2] if match[2] is not None else match[1])
        if most is not None and len(found) + last - first + 1 > most:
            raise _too_many(nodelist, most)
        found.extend(str(n).zfill(len(match[1])) for n in range(first, last + 1))
    return found


def tasks_per_node(text: str, most: int | None = None) -> list[int]:
    """SLURM's tasks per node, expanded: `2(x3),1` is [2, 2, 2, 1]; more machines than `most`
    (the step's tasks) is one line, never expanded."""
    counts = []
    for piece in text.split(","):
        match = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", piece.strip())
        if not match:
            raise LaunchError(f"cannot read SLURM's tasks per node {text!r}")
        repeat = int(match[2] or 1)
        if most is not None and len(counts) + repeat > most:
            raise LaunchError(f"SLURM's tasks per node {text[:80]!r} name more machines than the step's {most} task(s); "
                              "check SLURM_STEP_TASKS_PER_NODE and SLURM_NTASKS")
        counts.extend([int(match[1])] * repeat)
    return counts
