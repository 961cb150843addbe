"""The PNGs the demo and the bench write: matplotlib (the demo extra) imported only to draw, on the Agg
backend (no screen), one figure per file, closed whatever happens."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def png(
    path: Path, title: str, nrows: int, ncols: int, figsize: tuple[float, float], *, squeeze: bool = True
) -> Iterator[tuple[Any, Any]]:
    """A figure of ``nrows`` × ``ncols`` axes (``plt.subplots``'s), drawn in the ``with`` block, then
    titled ``title`` and saved to ``path`` (a block that raises saves nothing); closed either way."""
    import matplotlib  # the demo extra; imported only when a chart is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=figsize, squeeze=squeeze)
    try:
        yield fig, axes
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
