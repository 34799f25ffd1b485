"""Pictures of the evaluation results (matplotlib, Agg backend, written by rank 0 only): the passkey
accuracy heatmap (context length x needle depth) and the eval loss by position. A title is lines
(e.g. the model and how it was trained, then the layout it was evaluated under), each wrapped to
the figure's width so that nothing is cut at the edges."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tsp_trainer.eval.passkey import PasskeyResult  # noqa: E402
from tsp_trainer.eval.position_loss import PositionLoss  # noqa: E402


TITLE_FONTSIZE = 9
CHAR_WIDTH = 0.55           # a character's mean width in DejaVu Sans, in units of the font size
LINE_HEIGHT = 0.17          # inches per title line at TITLE_FONTSIZE


def passkey_heatmap(result: PasskeyResult, path: str | Path, *, title: str | Sequence[str]) -> Path:
    """Accuracy per cell: columns = haystack length, rows = needle depth (0% at the top, as the
    needle-in-a-haystack plots draw it), red = missed, green = retrieved; each cell says its
    accuracy and its key loss (nats/token)."""
    lengths = sorted({c.length for c in result.cells})
    depths = sorted({c.depth for c in result.cells})
    grid = [[result.cell(n, d).accuracy for n in lengths] for d in depths]
    samples = result.cells[0].samples
    width = max(5.0, 1.4 + 1.1 * len(lengths))
    title = _wrap([*_lines(title), f"passkey accuracy ({samples} haystacks per cell; "
                                   f"mean {result.accuracy:.2f})"], width)
    # the grid's rows, plus the title's lines and the axis labels (the colorbar needs the height)
    height = max(2.4, 1.0 + 0.6 * len(depths)) + LINE_HEIGHT * title.count("\n")
    fig, ax = plt.subplots(figsize=(width, height))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i, d in enumerate(depths):
        for j, n in enumerate(lengths):
            cell = result.cell(n, d)
            dark = not 0.2 <= cell.accuracy <= 0.8        # the colormap's deep red / green ends
            ax.text(j, i, f"{cell.accuracy:.2f}\nnll {cell.key_nll:.2f}", ha="center", va="center",
                    fontsize=8, color="white" if dark else "black")
    ax.set_xticks(range(len(lengths)), [_tokens(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
    ax.set_xlabel("haystack length (tokens)")
    ax.set_ylabel("needle depth")
    fig.suptitle(title, fontsize=TITLE_FONTSIZE)
    fig.colorbar(image, ax=ax, label="accuracy (exact key)")
    return _save(fig, path)


def loss_by_position_plot(result: PositionLoss, path: str | Path, *, title: str | Sequence[str]) -> Path:
    """Mean loss per power-of-two position bucket, on a log2 position axis."""
    rows = [r for r in result.rows() if r[2] is not None]
    x = [(a + b) / 2 if a != b else max(a, 0.5) for a, b, _, _ in rows]   # bucket middle
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(x, [r[2] for r in rows], marker="o")
    for xi, (_, _, loss, n) in zip(x, rows):     # the early buckets hold few tokens: say how few
        ax.annotate(f"n={n}", (xi, loss), textcoords="offset points", xytext=(0, 6), ha="center",
                    fontsize=6, color="0.35")
    ax.margins(y=0.15)                           # room for the labels above the points
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(a) if a == b else f"{a}-{b}" for a, b, _, _ in rows], rotation=45,
                  ha="right", fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("token position (bucket)")
    ax.set_ylabel("loss (nats/token)")
    fig.suptitle(_wrap([*_lines(title), f"eval loss by position (mean {result.mean_loss:.4f}, "
                                        f"{int(sum(result.tokens))} tokens)"], fig.get_figwidth()),
                 fontsize=TITLE_FONTSIZE)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _lines(title: str | Sequence[str]) -> list[str]:
    return [title] if isinstance(title, str) else list(title)


def _wrap(lines: list[str], fig_width: float) -> str:
    """A figure title (suptitle: centred on the figure, not on the axes that a colorbar pushes
    aside): each line wrapped at 90% of the figure's width (inches) in characters; tight_layout
    then makes room above the axes for however many lines that gives."""
    width = int(0.9 * fig_width * 72 / (TITLE_FONTSIZE * CHAR_WIDTH))
    return "\n".join(textwrap.fill(line, width) for line in lines)


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
