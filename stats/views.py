"""The three views of the registry: ``/stats`` totals, Prometheus families, the CLI table.

Each walks a registry tuple (``WORKER_STATS`` or ``GATEWAY_STATS``), so a statistic added
to the registry appears in all three, under the names its entry gives it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from pdserve.stats.latency import HistogramSnapshot
from pdserve.stats.registry import Kind, Stat, Total

Row = Mapping[str, Any]


def totals(stats: Sequence[Stat], rows: Sequence[Row]) -> dict[str, Any]:
    """The service's figure for each stat, combined over ``rows`` as its ``total`` says."""
    result: dict[str, Any] = {}
    for stat in stats:
        values = [row[stat.name] for row in rows]
        if stat.label:  # per label value: each value's total
            result[stat.name] = {
                key: sum(v.get(key, 0) for v in values)
                for key in sorted({k for v in values for k in v})
            }
        elif stat.total is Total.SUM:
            result[stat.name] = sum(values)
        elif stat.total is Total.MAX:
            result[stat.name] = max(values, default=0.0)
        elif stat.total is Total.POOL_WEIGHTED:
            pool = sum(row["num_blocks"] for row in rows)
            result[stat.name] = (
                sum(row[stat.name] * row["num_blocks"] for row in rows) / pool if pool else 0.0
            )
        elif stat.total is Total.MERGE:
            result[stat.name] = merge_histograms([as_histogram(v) for v in values])
    for stat in stats:  # ratios of the totals, once those exist
        if stat.total is Total.RATIO:
            if stat.ratio_of is None:
                raise ValueError(f"stat {stat.name!r} totals as a RATIO but names no ratio_of")
            numerator, denominator = stat.ratio_of
            result[stat.name] = (
                result[numerator] / result[denominator] if result[denominator] else 0.0
            )
    return result


def as_histogram(value: HistogramSnapshot | Mapping[str, Any]) -> HistogramSnapshot:
    """A histogram back from its JSON form (``/stats`` rows are plain dicts)."""
    if isinstance(value, HistogramSnapshot):
        return value
    return HistogramSnapshot(tuple(value["bounds"]), tuple(value["counts"]), value["sum"])


def merge_histograms(histograms: Sequence[HistogramSnapshot]) -> HistogramSnapshot | None:
    if not histograms:
        return None
    bounds = histograms[0].bounds
    counts = [sum(h.counts[i] for h in histograms) for i in range(len(bounds) + 1)]
    return HistogramSnapshot(bounds, tuple(counts), sum(h.sum for h in histograms))


def prometheus_families(
    stats: Sequence[Stat], label_names: Sequence[str], rows: Sequence[tuple[Sequence[str], Row]]
) -> Iterator[Metric]:
    """One metric family per exported stat, one sample per ``(label values, row)``."""
    for stat in stats:
        if stat.metric is None:
            continue
        labels = [*label_names, stat.label] if stat.label else list(label_names)
        if stat.kind is Kind.HISTOGRAM:
            histograms = HistogramMetricFamily(stat.metric, stat.help, labels=labels)
            for label_values, row in rows:
                histogram = as_histogram(row[stat.name])
                histograms.add_metric(
                    list(label_values), histogram.cumulative_buckets(), histogram.sum
                )
            yield histograms
        else:
            family_class = CounterMetricFamily if stat.kind is Kind.COUNTER else GaugeMetricFamily
            family = family_class(stat.metric, stat.help, labels=labels)
            for label_values, row in rows:
                value = row[stat.name]
                if stat.label:
                    for key, count in sorted(value.items()):
                        family.add_metric([*label_values, str(key)], count)
                else:
                    family.add_metric(list(label_values), value)
            yield family


def format_cell(stat: Stat, value: Any) -> str:
    if stat.unit == "ratio":
        return f"{100 * value:.1f}"
    if stat.unit == "seconds":
        return f"{1000 * value:.2f}"
    return str(value)


def format_table(
    stats: Sequence[Stat], rows: Sequence[Row], total_row: Row, leading: Sequence[tuple[str, str]]
) -> str:
    """A right-aligned text table: the ``leading`` (header, key) columns, then one column per
    stat with a ``column``; the last line is ``total_row``, where a stat whose total is NONE
    (and a leading key the row lacks or leaves empty) shows ``-``."""
    shown = [(stat, stat.column) for stat in stats if stat.column]
    header = [title for title, _ in leading] + [column for _, column in shown]

    def line(row: Row, is_total: bool) -> list[str]:
        cells = [str(row.get(key) or "-") for _, key in leading]
        for stat, _ in shown:
            blank = is_total and stat.total is Total.NONE
            cells.append("-" if blank else format_cell(stat, row[stat.name]))
        return cells

    body = [line(row, False) for row in rows] + [line(total_row, True)]
    widths = [max(len(header[i]), *(len(r[i]) for r in body)) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in [header, *body]
    )
