"""PNG copies of the key plots through kaleido, which needs a Chrome/Chromium on the machine."""
from __future__ import annotations

from pathlib import Path

PNG_FIGURES = ("history", "pareto", "draft_length", "latency")


def write_pngs(figures: dict, directory: Path) -> str:
    """PNG copies through kaleido in one batch; a missing browser is a note, not an error."""
    import plotly.io as pio

    if not figures:
        return "no plots to copy as PNG"
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{name}.png" for name in figures]
    try:
        pio.write_images(list(figures.values()), paths, width=1100, height=450)
    except Exception as e:  # noqa: BLE001 - no Chrome/Chromium, or kaleido could not drive it
        return f"PNG copies skipped: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return f"PNG copies in {directory}: {', '.join(p.name for p in paths)}"
