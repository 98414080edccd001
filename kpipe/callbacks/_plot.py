"""`InputProfiler.plot()`: the per-step timeline as a picture (matplotlib, the `plot` extra).

Uses matplotlib's object API only (no `pyplot`): nothing global is created or left open,
no backend is chosen, and it works in scripts, threads and notebooks alike. The figure it
returns renders itself as PNG in Jupyter (`_repr_png_`), with or without `%matplotlib`.
"""

import io

import numpy as np

_WAIT_COLOUR = "#d1495b"
_COMPUTE_COLOUR = "#5b8db8"
_TITLE = "Where each training step's time went"
_FIGURE_CLASS = None


def require_matplotlib():
    """The `matplotlib` module, or an ImportError naming the extra that installs it."""
    try:
        import matplotlib
        import matplotlib.figure  # noqa: F401 -- the object API used below
        import matplotlib.lines  # noqa: F401
        import matplotlib.patches  # noqa: F401
    except ImportError:
        raise ImportError(
            "InputProfiler.plot() needs matplotlib, which is not installed. Install it with: "
            'pip install "kpipe[plot]" (or pip install matplotlib).'
        ) from None
    return matplotlib


def _figure_class():
    """`matplotlib.figure.Figure` that Jupyter shows as a PNG without `%matplotlib inline`."""
    global _FIGURE_CLASS
    if _FIGURE_CLASS is None:
        from matplotlib.figure import Figure

        class TimelineFigure(Figure):
            """A matplotlib `Figure`; Jupyter displays it as a PNG."""

            def _repr_png_(self):
                buf = io.BytesIO()
                self.savefig(buf, format="png")
                return buf.getvalue()

        _FIGURE_CLASS = TimelineFigure
    return _FIGURE_CLASS


def plot_timelines(steps_list, epochs_list, *, labels, path=None, title=None, dpi=100):
    """One panel per profiler, side by side, sharing both axes. See `InputProfiler.plot`.

    Args:
        steps_list: A `Steps` per panel.
        epochs_list: The matching profilers' `epochs` (per-epoch figures) per panel.
        labels: A title per panel.
        path: File to write, or None. Defaults to None.
        title: Figure title, or None for the default. Defaults to None.
        dpi: Resolution of the written file. Defaults to 100.

    Returns:
        The figure.
    """
    matplotlib = require_matplotlib()
    if len(labels) != len(steps_list):
        raise ValueError(
            f"`labels` must name each of the {len(steps_list)} timelines. Received: labels={labels!r}."
        )
    for label, steps in zip(labels, steps_list):
        if not steps.counted.any():
            raise ValueError(
                f"The profiler of {label!r} has recorded no measured training step: plot() after "
                "model.fit(..., callbacks=[profiler]) has run at least two steps (the first is "
                "left out as warm-up, see `skip_steps`)."
            )
    n = len(steps_list)
    figure_class = _figure_class()
    layout = {"layout": "constrained"} if _version(matplotlib) >= (3, 6) else {"constrained_layout": True}
    # Sized to be read at ~900 px wide (a README column, a notebook cell) without zooming.
    fig = figure_class(figsize=(5.4 * n, 4.0) if n > 1 else (8.0, 4.0), dpi=dpi, **layout)
    axes = fig.subplots(1, n, sharex=True, sharey=True, squeeze=False)[0]
    per_step = np.concatenate([_per_step_ms(s) for s in steps_list])
    top = _y_top(per_step)
    for i, (ax, steps, epochs, label) in enumerate(zip(axes, steps_list, epochs_list, labels)):
        _draw_panel(ax, steps, epochs, label, top)
        if i == 0:
            ax.set_ylabel("time per step (ms)")
    ax = axes[0]
    ax.set_ylim(0, top * 1.3)  # head room for the epoch labels (shared by all panels)
    spans = [(s.first_step[s.counted][0] + 0.5, (s.first_step + s.steps)[s.counted][-1] + 0.5) for s in steps_list]
    ax.set_xlim(min(a for a, _ in spans), max(b for _, b in spans))  # every panel's steps, shared
    handles = [
        matplotlib.patches.Patch(color=_WAIT_COLOUR, label="waiting for input"),
        matplotlib.patches.Patch(color=_COMPUTE_COLOUR, label="computing (step + callbacks)"),
    ]
    if per_step.max() > top:
        handles.append(matplotlib.lines.Line2D([], [], linestyle="none", marker="^", markersize=5, color="0.2",
                                               label=f"step off the scale (up to {per_step.max():,.0f} ms)"))
    if _version(matplotlib) >= (3, 7):
        fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)
    else:  # pragma: no cover - matplotlib 3.5/3.6: inside the first panel
        axes[-1].legend(handles=handles, loc="upper right", fontsize="small")
    fig.suptitle(title or _TITLE, fontweight="bold")
    if path is not None:
        fig.savefig(path, dpi=dpi)
    return fig


def _y_top(per_step_ms):
    """The y-axis top: the tallest step, unless a few outliers (a step stalled by the
    machine, say) would squash every other step flat; those are clipped and marked."""
    tallest = float(per_step_ms.max())
    robust = 1.5 * float(np.percentile(per_step_ms, 99))
    return tallest if tallest <= robust or robust <= 0 else robust


def _per_step_ms(steps):
    rows = steps.counted
    return 1e3 * steps.step_s[rows] / steps.steps[rows]


def _draw_panel(ax, steps, epochs, label, top):
    from matplotlib.ticker import MaxNLocator

    rows = steps.counted
    # Step numbers from 1, as Keras's progress bar counts; a bar centred on its step number.
    first, count = steps.first_step[rows] + 0.5, steps.steps[rows]
    wait_ms = 1e3 * steps.wait_s[rows] / count
    compute_ms = 1e3 * np.maximum(steps.compute_s[rows], 0.0) / count
    # Step-shaped areas (one flat top per row): fast for 10 000 rows, unlike one bar each.
    x = np.append(first, first[-1] + count[-1])
    total = compute_ms + wait_ms
    clipped = total > top
    low, high = np.minimum(compute_ms, top), np.minimum(total, top)  # outliers stop at the top
    ax.fill_between(x, 0, np.append(low, low[-1]), step="post", color=_COMPUTE_COLOUR, linewidth=0)
    ax.fill_between(x, np.append(low, low[-1]), np.append(high, high[-1]), step="post", color=_WAIT_COLOUR, linewidth=0)
    if clipped.any():  # off the scale: a marker at the top (the legend gives the tallest)
        ax.plot(first[clipped] + count[clipped] / 2, np.full(clipped.sum(), top), linestyle="none", marker="^",
                markersize=5, color="0.2")
    wall = sum(e["wall_s"] for e in epochs)
    share = sum(e["input_wait_s"] for e in epochs) / wall if wall else 0.0
    rate = sum(e["steps"] for e in epochs) / wall if wall else 0.0
    ax.set_title(f"{label}\n{share:.0%} of step time waiting, {rate:,.0f} steps/s", fontsize="medium")
    xlabel = "training step"
    if steps.window > 1:
        xlabel += f" (means over windows of up to {steps.window} steps)"
    ax.set_xlabel(xlabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="y", alpha=0.3)
    _mark_epochs(ax, steps, epochs, first[0], x[-1], top)


def _mark_epochs(ax, steps, epochs, x0, x1, top):
    """Dashed lines between epochs; each epoch's share above it, where there is room."""
    share = {e["epoch"]: e["input_wait_share"] for e in epochs}
    bounds = []
    for epoch in np.unique(steps.epoch):
        in_epoch = steps.epoch == epoch
        start = max(float(steps.first_step[in_epoch].min()) + 0.5, x0)
        end = float((steps.first_step[in_epoch] + steps.steps[in_epoch]).max()) + 0.5
        bounds.append((int(epoch), start, end))
    # At most ~7 labels fit side by side: with more epochs, every k-th epoch is labelled.
    stride = max(1, int(np.ceil(len(bounds) / 7)))
    narrow = stride > 1 or min(end - start for _, start, end in bounds) < 0.12 * (x1 - x0)
    for k, (epoch, start, end) in enumerate(bounds):
        if k:
            ax.axvline(start, color="0.35", linestyle="--", linewidth=0.9)
        if epoch in share and k % stride == 0:
            text = f"epoch {epoch + 1}\n{share[epoch]:.0%} wait"
            if narrow:  # left-aligned on the epoch's start line, over the lines it crosses
                ax.text(start + 0.006 * (x1 - x0), top * 1.27, text, ha="left", va="top", fontsize="small", color="0.2",
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0})
            else:
                ax.text((start + end) / 2, top * 1.27, text, ha="center", va="top", fontsize="small", color="0.2")


def _version(module):
    parts = []
    for part in module.__version__.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)
