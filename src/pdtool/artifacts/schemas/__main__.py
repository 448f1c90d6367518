"""`python -m pdtool.artifacts.schemas`: write the schemas again from the artifacts' declarations."""
from . import main

main()
