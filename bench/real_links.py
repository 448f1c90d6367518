"""PipeDream's case on real links: 2 emulated machines (1 worker, 1 thread each) joined by a
switch whose ports are shaped to 10 Gbit/s, 1 Gbit/s and 100 Mbit/s (`bench/links.py`: network
namespaces, veth pairs, tc tbf), one `pd train --nnodes 2` launcher per machine.

Two models, each profiled with `pd profile --threads 1` right before its rows at each bandwidth
(this virtual machine's speed drifts 15-30% within minutes, so a profile taken half an hour
before a run predicts the machine of then, not of the run):
- `fc`: pdtool.zoo:mlp 64-2048x4-10, batch 64: 51 MB of parameters, 0.5 MB between layers
  (PipeDream's case: an all-reduce of the parameters costs far more than sending activations);
- `conv`: pdtool.zoo:convnet 16 channels x 6 at 32x32, batch 32: 0.05 MB of parameters, 2 MB
  between layers (the other way round).
For every bandwidth, three plans: `pd plan --cluster 2x<bandwidth>` (pd plan's pick),
`--data-parallel` (1 stage x 2) and `--straight --cost-model pipedream` (a 2-stage pipeline:
that cost model uses every worker); each is trained (the
same plan is trained once) and its measured time per minibatch (what `pd train` prints) is set
beside the prediction `pd plan` prints first (the simulator's) and the cost model's, and pd
plan's pick beside the measured fastest. Each plan is trained three times and the fastest run
counts (on a shared virtual machine a run can lose 10-30% to neighbours; the row shows the
slowest run and the CPU time the hypervisor gave to other guests meanwhile). Each link is
measured first, as a user writes the measured rate and latency of a cluster's links into its
description: its rate by a TCP stream each way at once for 3 s (what a pipeline's activations
and gradients or an all-reduce put on it; the emulation does not reach 10 Gbit/s on every
machine), its latency by a small gloo all-reduce between the two machines right after 20 ms of
CPU work on both (`links.collective_latency`: where the workers keep every core busy, a message
waits for gloo's threads to be scheduled, about 2 ms here, more than the wire); the plans are
made for `2x<rate>+<latency>`.

Then time to a target held-out accuracy on the UCI digits for the `fc` model on the slowest
link, data parallelism against the 2-stage pipeline and pd plan's pick (pipedream mode, 1F1B
with weight stashing): the epochs each needs are found on
loopback (training is deterministic, so the link does not change the weights), then that many
epochs are timed on the slow link (wall time of `pd train`, start-up included).

Then **bf16 messages** on the slowest link: the `conv` model profiled with `--precision fp32` and
`--precision bf16`, each planned as the 2-stage pipeline and trained on the link: bf16 halves the
bytes between the stages (and, on a CPU without bf16 instructions, slows the layers, which its
profile measures); the row sets the measured bf16 / fp32 ratio of the time per minibatch beside
the one the simulator predicts from the two profiles.

Prints the table and whether each target is met, and writes bench/results/real_links.png (time
per minibatch against bandwidth: predicted lines, measured points) and real_links.csv.

    python bench/real_links.py                        # about 30 minutes here; needs root (namespaces)
    python bench/real_links.py --out /tmp/links       # where profiles, plans and the plot go
    python bench/real_links.py --only precision       # the bf16 row alone (a few minutes)
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import links  # noqa: E402
from record import recorded  # bench/record.py: the dated result file

PD = str(Path(sys.executable).parent / "pd")
MODELS = {
    "fc": ("pdtool.zoo:mlp", ["in_features=64", "hidden=2048", "depth=4", "classes=10"], 64),
    "conv": ("pdtool.zoo:convnet", ["channels=16", "depth=6", "image_size=32", "classes=10"], 32),
}
BANDWIDTHS = ["10Gbit", "1Gbit", "100Mbit"]
CONFIGS = {"pd plan": [], "data parallel": ["--data-parallel"],
           "straight": ["--straight", "--cost-model", "pipedream"]}  # that cost model uses every worker: 2 stages
TARGET_ACCURACY = 0.90
TRAIN = ["--lr", "0.05", "--momentum", "0.9", "--threads", "1", "--seed", "0"]
RUNS = 3  # each plan is trained this often; the fastest run counts (the machine is shared: see `stolen`)


def smoke() -> None:
    """`--smoke`: one link, tiny models, one run a plan, an accuracy any epoch reaches."""
    global BANDWIDTHS, RUNS, TARGET_ACCURACY, THROUGHPUT_S, SPEED_MODELS, SPEED_CONFIGS, ACCURACY_CONFIGS, REPEATS
    global LATENCY_ROUNDS
    BANDWIDTHS, RUNS, TARGET_ACCURACY, THROUGHPUT_S, SPEED_MODELS = ["1Gbit"], 1, 0.05, 1, ("fc",)
    LATENCY_ROUNDS = 5
    # the straight and data-parallel rows (speed and time to accuracy) run the same code as pd plan's
    SPEED_CONFIGS, ACCURACY_CONFIGS, REPEATS = ("pd plan",), ("pd plan",), 1
    MODELS["fc"] = ("pdtool.zoo:mlp", ["in_features=64", "hidden=32", "depth=2", "classes=10"], 16)
    MODELS["conv"] = ("pdtool.zoo:convnet", ["channels=4", "depth=2", "image_size=16", "classes=10"], 8)


THROUGHPUT_S = 3  # seconds a link's rate is measured
LATENCY_ROUNDS = 40  # all-reduces timed for a link's latency (`links.collective_latency`)
SPEED_CONFIGS = tuple(CONFIGS)  # the configurations of the speed rows
ACCURACY_CONFIGS = ("data parallel", "straight", "pd plan")  # the configurations timed to the target accuracy
REPEATS = 20  # pd profile --repeats
SPEED_MODELS = tuple(MODELS)  # the models of the speed rows (the bf16 row is conv's)


def stolen() -> float:
    """CPU seconds this (virtual) machine's hypervisor has given other guests since boot (steal
    time, /proc/stat): it grows while a run is slowed down by neighbours, not by pdtool."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def pd(*args: str, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([PD, *args], capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise SystemExit(f"pd {' '.join(args)} failed:\n{done.stderr}")
    return done


def plan(profile: Path, link: str, extra: list[str], out: Path) -> tuple[dict, float]:
    """(the plan's JSON, the ms per minibatch pd plan prints) on 2 machines joined by `link`
    (a cluster level's text: a bandwidth, + a latency)."""
    done = pd("plan", str(profile), "--cluster", f"2x{link}", *extra, "-o", str(out))
    printed = float(re.search(r"([0-9.]+) ms per minibatch", done.stderr).group(1))
    return json.loads(out.read_text()), printed


def train_on(machines, plan_path: Path, workers: int, args: list[str], timeout: float = 600) -> str:
    """Run `pd train` on `workers` emulated machines; the output of the one that reports."""
    procs = []
    for rank, machine in enumerate(machines[:workers]):
        argv = [PD, "train", str(plan_path), *args, "--quiet", "--timeout", "120"]
        if workers > 1:
            argv += ["--nnodes", str(workers), "--node-rank", str(rank), "--master-addr", machines[0].address,
                     "--master-port", "29700"]
        procs.append(machine.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise SystemExit(f"pd train {plan_path} failed:\n{err}")
        outputs.append(out)
    return next(o for o in outputs if "time per minibatch" in o)


def measured_ms(output: str) -> float:
    return float(re.search(r"measured ([0-9.]+) ms", output).group(1))


def shape(data: dict) -> tuple:
    return tuple((tuple(s["layers"]), len(s["ranks"])) for s in data["stages"])


def describe(data: dict) -> str:
    stages = data["stages"]
    return " + ".join(f"{len(s['layers'])}L x{len(s['ranks'])}" for s in stages)


def per_step(data: dict) -> int:
    return len(data["stages"][0]["ranks"])  # pipedream: a step per round of stage 0's replicas


def workers(data: dict) -> int:
    return sum(len(s["ranks"]) for s in data["stages"])


def profile(out: Path, name: str, bandwidth: str) -> Path:
    """Profile model `name` now (for the rows of `bandwidth`); the profile's path."""
    spec, kwargs, batch = MODELS[name]
    path = out / f"{name}-{bandwidth}.profile.json"
    pd("profile", "-m", spec, *[x for kw in kwargs for x in ("-a", kw)], "-b", str(batch), "--threads", "1",
       "--repeats", str(REPEATS), "-q", "-o", str(path))
    return path


def speed_rows_at(out: Path, machines, bandwidth: str, measured: str) -> list[dict]:
    """Rows of the link set to `bandwidth`, planned for the `measured` link (rate + latency)."""
    rows = []
    for name in SPEED_MODELS:
        trained: dict[tuple, float] = {}
        profiled = profile(out, name, bandwidth)
        for config in SPEED_CONFIGS:
            extra = CONFIGS[config]
            path = out / f"{name}-{bandwidth}-{config.replace(' ', '_')}.plan.json"
            data, printed = plan(profiled, measured, extra, path)
            key = shape(data)
            if key not in trained:  # the same plan is trained once (RUNS times)
                minibatches = int(min(max(6000 / max(printed, 1e-3), 16), 64))
                steps = max(minibatches // per_step(data), 4)
                steal = stolen()
                runs = [measured_ms(train_on(machines, path, workers(data), ["--steps", str(steps), *TRAIN]))
                        for _ in range(RUNS)]
                trained[key] = (min(runs), max(runs), stolen() - steal)
            fastest, slowest, steal = trained[key]
            row = {"model": name, "bandwidth": bandwidth, "config": config, "plan": describe(data),
                   "predicted_ms": printed, "cost_model_ms": data["predicted"]["time_per_minibatch_ms"],
                   "measured_ms": fastest, "slowest_ms": slowest, "stolen_s": steal}
            rows.append(row)
            print(f"{name:5} {bandwidth:>7} {config:14} {row['plan']:14} predicted {printed:9.2f} ms  (cost model "
                  f"{row['cost_model_ms']:8.2f})  measured {fastest:9.2f} ms  ({fastest / printed:5.2f}x; slowest run "
                  f"{slowest:.2f}, {steal:.1f} s stolen)", flush=True)
    return rows


def precision_rows(out: Path, machines, link: str) -> list[dict]:
    """The conv model's 2-stage pipeline on `link` in fp32 and in bf16: predicted and measured."""
    spec, kwargs, batch = MODELS["conv"]
    rows = []
    for precision in ("fp32", "bf16"):
        profiled = out / f"conv-{precision}.profile.json"
        pd("profile", "-m", spec, *[x for kw in kwargs for x in ("-a", kw)], "-b", str(batch), "--threads", "1",
           "--repeats", str(REPEATS), "--precision", precision, "-q", "-o", str(profiled))
        path = out / f"conv-{precision}.plan.json"
        data, printed = plan(profiled, link, CONFIGS["straight"], path)
        steps = max(int(min(max(6000 / max(printed, 1e-3), 16), 64)) // per_step(data), 4)
        runs = [measured_ms(train_on(machines, path, workers(data), ["--steps", str(steps), *TRAIN]))
                for _ in range(RUNS)]
        rows.append({"precision": precision, "plan": describe(data), "predicted_ms": printed, "measured_ms": min(runs),
                     "slowest_ms": max(runs)})
        print(f"conv {BANDWIDTHS[-1]} straight {precision}: predicted {printed:9.2f} ms  measured {min(runs):9.2f} ms "
              f"(slowest run {max(runs):.2f})", flush=True)
    return rows


def precision_verdict(rows: list[dict]) -> tuple[bool, str]:
    fp32, bf16 = rows
    predicted = bf16["predicted_ms"] / fp32["predicted_ms"]
    measured = bf16["measured_ms"] / fp32["measured_ms"]
    return (abs(measured / predicted - 1) <= 0.15,
            f"conv on {BANDWIDTHS[-1]}: bf16 / fp32 time per minibatch measured {measured:.2f}, predicted "
            f"{predicted:.2f} (within 15%)")


def epochs_to_target(path: Path, max_epochs: int = 30) -> tuple[int, float]:
    """The fewest epochs after which the plan reaches TARGET_ACCURACY held out, on loopback."""
    for epochs in range(1, max_epochs + 1):
        done = pd("train", str(path), "--data", "digits", "--epochs", str(epochs), "--evaluate", "--quiet", *TRAIN)
        accuracy = float(re.search(r"held-out accuracy: ([0-9.]+)%", done.stdout).group(1)) / 100
        if accuracy >= TARGET_ACCURACY:
            return epochs, accuracy
    raise SystemExit(f"{path} does not reach {TARGET_ACCURACY:.0%} in {max_epochs} epochs")


def accuracy_rows(out: Path, machines) -> list[dict]:
    slow = BANDWIDTHS[-1]
    rows = []
    for config in ACCURACY_CONFIGS:
        path = out / f"fc-{slow}-{config.replace(' ', '_')}.plan.json"
        data = json.loads(path.read_text())
        epochs, accuracy = epochs_to_target(path)
        began = time.perf_counter()
        train_on(machines, path, workers(data), ["--data", "digits", "--epochs", str(epochs), *TRAIN], timeout=1800)
        wall = time.perf_counter() - began
        rows.append({"config": config, "plan": describe(data), "mode": data["mode"], "epochs": epochs,
                     "accuracy": accuracy, "wall_s": wall})
        print(f"fc on {slow}: {config:14} ({describe(data)}, {data['mode']}) reaches {accuracy:.1%} after {epochs} "
              f"epoch(s): {wall:.1f} s on the link", flush=True)
    return rows


def verdicts(rows: list[dict], accuracy: list[dict]) -> list[tuple[bool, str]]:
    found = []
    for name in sorted({r["model"] for r in rows}, key=list(MODELS).index):
        for bandwidth in BANDWIDTHS:
            here = [r for r in rows if r["model"] == name and r["bandwidth"] == bandwidth]
            pick = next(r for r in here if r["config"] == "pd plan")
            best = min(here, key=lambda r: r["measured_ms"])
            ok = pick["measured_ms"] <= best["measured_ms"] * 1.05
            found.append((ok, f"{name} {bandwidth}: pd plan's pick ({pick['plan']}, {pick['measured_ms']:.2f} ms) is "
                              f"the measured fastest or within 5% (fastest: {best['config']}, {best['measured_ms']:.2f} ms)"))
    worst = max(rows, key=lambda r: abs(r["measured_ms"] / r["predicted_ms"] - 1))
    ratio = worst["measured_ms"] / worst["predicted_ms"]
    found.append((abs(ratio - 1) <= 0.15, f"every configuration measured within 15% of pd plan's prediction (worst: "
                                          f"{worst['model']} {worst['bandwidth']} {worst['config']}, {ratio:.2f}x)"))
    slow = {r["config"]: r for r in rows if r["model"] == "fc" and r["bandwidth"] == BANDWIDTHS[-1]}
    by = {r["config"]: r for r in accuracy}
    for config in ("straight", "pd plan"):
        if config not in slow or "data parallel" not in slow:  # --smoke: pd plan's row alone
            continue
        gain = slow["data parallel"]["measured_ms"] / slow[config]["measured_ms"]
        found.append((gain >= 2, f"fc on {BANDWIDTHS[-1]}: {config} ({slow[config]['plan']}, pipedream) has {gain:.1f}x "
                                 "data parallelism's throughput (target 2x)"))
        if config not in by or "data parallel" not in by:  # --smoke: not timed to the target
            continue
        faster = by["data parallel"]["wall_s"] / by[config]["wall_s"]
        found.append((faster >= 1.5, f"fc on {BANDWIDTHS[-1]}: {config} reaches {TARGET_ACCURACY:.0%} {faster:.1f}x "
                                     "faster than data parallelism (target 1.5x)"))
    return found


def plot(rows: list[dict], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is missing (pip install -e '.[plot]')"
    gbit = {b: links.bits_per_s(b) / 1e9 for b in BANDWIDTHS}
    models = [name for name in MODELS if any(r["model"] == name for r in rows)]  # --smoke: fc alone
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for axis, name in zip(axes[0], models):
        for (config, colour) in zip(CONFIGS, ("tab:red", "tab:blue", "tab:green")):
            here = sorted((r for r in rows if r["model"] == name and r["config"] == config),
                          key=lambda r: gbit[r["bandwidth"]])
            xs = [gbit[r["bandwidth"]] for r in here]
            axis.plot(xs, [r["predicted_ms"] for r in here], "-", color=colour, label=f"{config}: predicted")
            big = config == "pd plan"  # a ring around the configuration pd plan picked (it is also one of the others)
            axis.plot(xs, [r["measured_ms"] for r in here], "o", color=colour, label=f"{config}: measured",
                      markersize=13 if big else 6, markerfacecolor="none" if big else colour, zorder=3)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("link bandwidth (Gbit/s)")
        axis.set_ylabel("time per minibatch (ms)")
        axis.set_title(f"{name}: 2 machines x 1 worker")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return f"wrote {path}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench-out/real_links"),
                        help="where the profiles, plans and the CSV go")
    parser.add_argument("--plot", type=Path, default=Path(__file__).resolve().parent / "results" / "real_links.png")
    parser.add_argument("--only", choices=("precision",), help="run only these rows")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: that it runs to its end (the tests run it), not its figures")
    args = parser.parse_args()
    if args.smoke:
        smoke()
    why = links.available()
    if why:
        print(f"real_links: skipped, cannot emulate machines here: {why}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only == "precision":
        ok, text = precision_verdict(_precision(args.out))
        print(f"[{'met' if ok else 'NOT met'}] {text}")
        return 0
    rows = []
    for bandwidth in BANDWIDTHS:  # a switch of that speed for each
        with links.machines(2, bandwidth) as machines:
            link = measured_link(machines, bandwidth)
            print(f"--- {bandwidth} link: {link}", flush=True)
            rows += speed_rows_at(args.out, machines, bandwidth, link.cluster)
            if bandwidth == BANDWIDTHS[-1]:  # the slowest link's machines: the accuracy and precision rows too
                accuracy = accuracy_rows(args.out, machines)
                precision = precision_rows(args.out, machines, link.cluster)
    with open(args.out / "real_links.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(plot(rows, args.plot))
    print()
    results = verdicts(rows, accuracy) + [precision_verdict(precision)]
    for ok, text in results:
        print(f"[{'met' if ok else 'NOT met'}] {text}")
    return 0


@dataclass(frozen=True)
class Link:
    """A link as measured between two emulated machines: a TCP stream each way at once (bits/s
    each) and a small message between the busy machines (s)."""

    rate: float
    latency: float

    @property
    def cluster(self) -> str:
        """The link as `pd plan --cluster` takes it (bandwidth + latency)."""
        return f"{self.rate / 1e6:.0f}Mbit/s+{self.latency * 1e6:.0f}us"

    def __str__(self) -> str:
        return (f"a TCP stream each way at once measures {self.rate / 1e6:.0f} Mbit/s each, a small message between "
                f"the busy machines {self.latency * 1e3:.2f} ms; planned as --cluster 2x{self.cluster}")


def measured_link(machines, bandwidth: str) -> Link:
    rate = links.throughput(machines[0], machines[1], seconds=THROUGHPUT_S, bandwidth=bandwidth, both_ways=True)
    return Link(rate, links.collective_latency(machines[0], machines[1], rounds=LATENCY_ROUNDS))


def _precision(out: Path) -> list[dict]:
    with links.machines(2, BANDWIDTHS[-1]) as machines:
        return precision_rows(out, machines, measured_link(machines, BANDWIDTHS[-1]).cluster)


if __name__ == "__main__":
    with recorded("real_links"):
        code = main()
    sys.exit(code)
