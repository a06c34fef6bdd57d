"""The Streamlit dashboard: the shared frame, cached reads, pure chart builders and the pages.

It reads captures through `kvscope.telemetry.queries` (read-only) and the leak report from
`kvscope.debug.report`; it never imports torch or the engine layers (tests/test_import_direction.py).
"""

from kvscope.dashboard.frame import PAGE_FILES, Selection, find_captures, render_frame, selection

__all__ = ["PAGE_FILES", "Selection", "find_captures", "render_frame", "selection"]
