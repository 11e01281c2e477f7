"""Training curves of several runs side by side, from their metrics.jsonl, in one PNG.

    python -m tools.plot runs/*                          # every run under runs/, into curves.png
    python -m tools.plot runs/distributed runs/dataparallel --output compare.png

Four panels: training loss and top-1 test accuracy, each against the epoch and against the wall time
spent training (the sum of the epochs' epoch_time_s, evaluation not included). Each run is named by its
directory's name; a run still going is drawn up to its last finished epoch.
"""
import json
import sys
from pathlib import Path

from utils import flags
from utils.errors import UsageError, exit_on_error


def read_run(directory: Path) -> list[dict]:
    """The epochs of metrics.jsonl in `directory`; a missing or unreadable file exits with one line."""
    path = directory / "metrics.jsonl"
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise UsageError(f"{directory} holds no metrics.jsonl (is it a run's --output-dir?)") from None
    except (OSError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot read {path} ({error})") from None
    if not records:
        raise UsageError(f"{path} has no finished epoch yet")
    return records


def draw(runs: dict[str, list[dict]], output: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise UsageError("drawing needs matplotlib: pip install matplotlib (requirements-dev.txt)") from None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey="row")
    for name, records in runs.items():
        epochs = [r["epoch"] for r in records]
        wall, total = [], 0.0
        for r in records:
            total += r["epoch_time_s"]
            wall.append(total / 60)
        for column, x in enumerate((epochs, wall)):
            axes[0][column].plot(x, [r["train_loss"] for r in records], marker="o", label=name)
            axes[1][column].plot(x, [r["top1"] for r in records], marker="o", label=name)
    for row, what in enumerate(("training loss", "top-1 test accuracy (%)")):
        axes[row][0].set_ylabel(what)
    for column, what in enumerate(("epoch", "training time (minutes)")):
        axes[1][column].set_xlabel(what)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole epochs
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    parser = flags.Parser(prog="python -m tools.plot", description=__doc__.splitlines()[0],
                          formatter_class=flags.HelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="output directories of runs (each holding a metrics.jsonl)")
    parser.add_argument("--output", type=Path, default=Path("curves.png"), help="the PNG to write")
    args = parser.parse_args(argv)
    with exit_on_error():
        names = [directory.resolve().name for directory in args.runs]
        if len(set(names)) < len(names):  # two runs/x of different parents: their whole paths tell them apart
            names = [str(directory) for directory in args.runs]
        runs = {name: read_run(directory) for name, directory in zip(names, args.runs, strict=True)}
        if not args.output.parent.is_dir():
            raise UsageError(f"--output {args.output}: {args.output.parent} is not a directory")
        draw(runs, args.output)
    print(f"{len(runs)} run(s) drawn into {args.output}")


if __name__ == "__main__":
    main(sys.argv[1:])
