"""The model side: what a model is to pdtool, and how it is split.

- `spec`: `pkg.module:factory` specs, the factories' `ModelBundle` (module, sample inputs,
  loss, batches) and their building under the user's consent (`pdtool.consent`);
- `layergraph`: a model's layer graph from one torch.fx or torch.export trace;
- `data`: the data sources (synthetic, the UCI digits shipped with pdtool, a user's Dataset)
  and held-out evaluation;
- `stages`: the plan's split of the layer graph into runnable stage modules.

The profiler, the launcher's checks and every worker use it; the zoo of example models sits
beside it (`pdtool.zoo`). Imports torch.
"""
