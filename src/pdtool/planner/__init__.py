"""The planner: PipeDream's partitioning optimizer over a profile and a cluster, giving a `Plan`.

- `costmodel`: a profile's per-layer costs for the optimizer (`ChainCosts`), the per-worker
  memory model (`Memory`) and the two cost models (`pdtool`'s and the original's);
- `states`: the optimizer's state space, the down-sets of the layer graph (prefixes on a chain);
- `partition`: the dynamic program over the cluster's levels (`Solver`): stages, replicas, cuts;
- `make`: `make_plan`: candidates from the dynamic program ranked by the simulator, written as
  a plan artifact (`artifacts.plan`).

Pure: no torch; numpy for the dynamic program.
"""
from .make import make_plan, shared_parameters

__all__ = ["make_plan", "shared_parameters"]
