"""`pd plot`: the curves of a `pd train --metrics` CSV as a picture (matplotlib, when installed).

One panel per column, against the step, sharing the step axis: by default the loss (with the
held-out loss of `--eval-every` as points on it), and the held-out accuracy, the learning rate
and the gradient norm where the run recorded them. It reads a file that a run is
still writing (the rows so far), so it also draws a run in progress.
"""
from __future__ import annotations

import os

from ..errors import PdtoolError
from ..jsonio import write_bytes_atomic

FORMATS = (".png", ".svg", ".pdf")
DEFAULT = ("loss", "eval_accuracy", "lr", "grad_norm")
SPARSE = ("eval_loss", "eval_accuracy")  # columns with values on the evaluated steps only: drawn as points


def plot_metrics(path: str, output: str, columns: tuple[str, ...] | None = None) -> list[str]:
    """Draw `columns` of the metrics CSV at `path` (None: `DEFAULT`'s that hold values) into
    `output` (.png, .svg or .pdf); returns the columns drawn. One `PdtoolError` line for a file
    that is not a metrics CSV, an unknown column, another format, or no matplotlib."""
    import pandas

    extension = os.path.splitext(output)[1].lower()
    if extension not in FORMATS:
        raise PdtoolError(f"{output}: pd plot writes {', '.join(FORMATS)}; give -o a name ending in one of them")
    try:
        frame = pandas.read_csv(path)
    except (OSError, ValueError) as exc:
        raise PdtoolError(f"{path}: not a CSV pd plot can read ({str(exc).splitlines()[0]}); give the file of "
                          "pd train --metrics") from None
    if "step" not in frame.columns or frame.empty:
        raise PdtoolError(f"{path}: no 'step' column or no rows; give the file of pd train --metrics (a run writes its "
                          "first row after its first step)")
    wanted = columns or tuple(c for c in DEFAULT if c in frame.columns and frame[c].notna().any())
    unknown = [c for c in wanted if c not in frame.columns]
    if unknown:
        raise PdtoolError(f"{path} has no column {unknown[0]!r}; its columns: {', '.join(frame.columns)}")
    try:
        import matplotlib
    except ImportError:
        raise PdtoolError("pd plot needs matplotlib: pip install matplotlib (or pdtool[plot])") from None
    matplotlib.use("Agg")
    import io

    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(wanted), 1, sharex=True, figsize=(7, 2.2 * len(wanted) + 0.6), squeeze=False)
    for axis, column in zip(axes[:, 0], wanted):
        _draw(axis, frame, column)
        if column == "loss" and "eval_loss" in frame.columns and frame["eval_loss"].notna().any():
            _draw(axis, frame, "eval_loss")
            axis.legend(["training", "held-out"], fontsize=8)
        axis.set_ylabel(column)
        axis.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    axes[0, 0].set_title(os.path.basename(path))
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format=extension[1:])
    plt.close(figure)
    write_bytes_atomic(output, buffer.getvalue())
    return list(wanted)


def _draw(axis, frame, column: str) -> None:
    """One column against the step: a line, or points for a column of the evaluated steps only."""
    if column in SPARSE:
        held = frame[["step", column]].dropna()
        axis.plot(held["step"], held[column], marker="o", linewidth=1.0)
    else:
        axis.plot(frame["step"], frame[column], linewidth=1.2)
