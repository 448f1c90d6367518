"""What pdtool shows people: `render` (a plan as a graphviz picture), `show` (text tables of
profiles, plans and simulations) and `trace` (Chrome traces of simulated and measured runs)."""
