"""`pd plot`: a metrics CSV's curves as a picture, and one line for what it cannot draw."""
import pytest
from click.testing import CliRunner

from pdtool.cli import cli

CSV = "step,minibatches,loss,samples_per_s,lr,grad_norm,busy_rank0\n" + "".join(
    f"{k},2,{2.0 / k:.4f},100,{0.01 * k:.3f},,0.5\n" for k in range(1, 6))


def test_pd_plot_draws_the_loss_and_the_recorded_columns(tmp_path):
    metrics = tmp_path / "m.csv"
    metrics.write_text(CSV)
    result = CliRunner().invoke(cli, ["plot", str(metrics), "-o", str(tmp_path / "loss.png")])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.stderr and "loss, lr by step" in result.stderr  # grad_norm is empty: not drawn
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = CliRunner().invoke(cli, ["plot", str(metrics), "-o", str(tmp_path / "s.svg"), "--column", "samples_per_s"])
    assert svg.exit_code == 0 and "<svg" in (tmp_path / "s.svg").read_text()


@pytest.mark.parametrize("args, line", [
    (["--column", "nope"], "has no column 'nope'; its columns: step, minibatches, loss"),
    (["-o", "x.jpg"], "pd plot writes .png, .svg, .pdf"),
])
def test_what_pd_plot_cannot_draw_is_one_line(tmp_path, args, line):
    metrics = tmp_path / "m.csv"
    metrics.write_text(CSV)
    output = ["-o", str(tmp_path / "x.png")] if "-o" not in args else ["-o", str(tmp_path / args[1])]
    rest = [a for a in args if a not in ("-o", "x.jpg")]
    result = CliRunner().invoke(cli, ["plot", str(metrics), *output, *rest])
    assert result.exit_code == 1 and line in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "x.png").exists()
