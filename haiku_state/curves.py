"""curves.png: a run's loss, accuracy and learning rate against step, drawn by matplotlib.

Drawn at the end of a run (`summaries.plot_curves`) from its records in `metrics.jsonl`, train
and eval on each panel; matplotlib is imported only then.
"""

from __future__ import annotations

from typing import Any

# Each panel: (metric, axis label, scale); accuracy in percent, as the logs show it.
_CURVES = (
    ("loss", "loss", 1.0),
    ("accuracy", "accuracy (%)", 100.0),
    ("learning_rate", "learning rate", 1.0),
)


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files (the Agg backend), imported when first asked for."""
    import matplotlib

    matplotlib.use("Agg")  # Nothing to do once it is the backend.
    import matplotlib.pyplot as plt

    return plt


def save_figure(records: list[dict[str, Any]], title: str, path: str) -> None:
    """Draws `records` under `title` into the PNG file `path`."""
    figure = curves_figure(records, title)
    figure.savefig(path, dpi=100)
    pyplot().close(figure)


def curves_figure(records: list[dict[str, Any]], title: str) -> Any:
    """The matplotlib figure of `save_figure`: one panel per metric, train and eval on each."""
    figure, axes = pyplot().subplots(1, len(_CURVES), figsize=(15, 4))
    for axis, (metric, label, scale) in zip(axes, _CURVES, strict=True):
        for split, style in (("train", "-"), ("eval", "o-")):
            rows = [r for r in records if r["split"] == split and metric in r]
            if rows:
                steps, values = [r["step"] for r in rows], [scale * r[metric] for r in rows]
                axis.plot(steps, values, style, label=split)
        axis.set(xlabel="step", ylabel=label)
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    return figure
