"""Hit rate against pool size, one line per policy and one for Belady's bound.

matplotlib is an optional extra (``pip install 'aiokvo[lab]'``); it is
imported only here, and only when a plot is asked for.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from os import PathLike

from aiokvo.errors import ConfigError

__all__ = ["plot_hit_rates"]

EXTRA = "lab"


def plot_hit_rates(
    rows: Iterable[Mapping[str, object]], path: str | PathLike[str], *, title: str = ""
) -> None:
    """Write a PNG of ``hit_rate`` (and ``belady_hit_rate``) against ``capacity_fraction``.

    ``rows`` are the replay's JSON objects. Raises :class:`ImportError`
    naming the extra when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError as exc:
        raise ImportError(
            f"--plot needs matplotlib: pip install 'aiokvo[{EXTRA}]' ({exc})"
        ) from exc
    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    bound: dict[float, float] = {}
    for row in rows:
        fraction = _number(row, "capacity_fraction")
        lines[str(row["policy"])].append((fraction, 100 * _number(row, "hit_rate")))
        bound[fraction] = 100 * _number(row, "belady_hit_rate")
    if not lines:
        raise ConfigError("nothing to plot: no replay results")
    figure, axes = pyplot.subplots(figsize=(8.5, 4.5), dpi=100)
    try:
        xs = sorted(bound)
        axes.plot([100 * x for x in xs], [bound[x] for x in xs], "k--", linewidth=2,
                  label="Belady (offline optimum)")  # fmt: skip
        for policy in sorted(lines):
            points = sorted(lines[policy])
            axes.plot([100 * x for x, _ in points], [y for _, y in points], marker="o",
                      label=policy)  # fmt: skip
        axes.set_xscale("log")
        axes.set_xticks([100 * x for x in xs], [f"{100 * x:g}%" for x in xs])
        axes.set_xlabel("pool capacity (share of the trace's distinct blocks)")
        axes.set_ylabel("hit rate (% of block references)")
        axes.set_ylim(bottom=0)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        if title:
            axes.set_title(title, fontsize="medium")
        figure.tight_layout()
        figure.savefig(path, format="png")
    finally:
        pyplot.close(figure)


def _number(row: Mapping[str, object], name: str) -> float:
    value = row.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"replay row has no number {name!r}: {dict(row)!r:.120}")
    return float(value)
