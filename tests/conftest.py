"""Shared test set-up: the tests folder is importable, so model specs like `toymodels:dynamic` work."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
