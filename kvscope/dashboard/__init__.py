"""The Streamlit dashboard: the shared frame (frame.py), the view in the URL (url_state.py),
cached reads (data.py, and reads.py for the links, time and leak views), pure builders
(charts/, timing.py, latency.py, leak_views.py), the pages (app_pages/), what a run's source can
show (capability.py, over kvscope.telemetry.capabilities: each page section renders when its
capability is provided, else one line), the sections that read an engine's own figures (its
/metrics and the page forest of its KV events: reported.py, attached.py), what retention dropped
of a run's events (retained.py) and `make run`'s launcher (launch.py).

It reads captures through kvscope.telemetry's read functions (read-only; it holds no SQL) and
the leak report through kvscope.debug; it never imports torch or the engine layers
(tests/test_import_direction.py).

NOTE: nothing is imported here eagerly: the launcher runs outside Streamlit, where importing
the cached reads makes Streamlit warn once per cache decorator. The frame's names load it on
first use (app.py, inside Streamlit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvscope.dashboard.frame import PAGE_FILES, PAGES_DIR, Selection, find_captures, render_frame, selection

_FRAME_NAMES = ("PAGE_FILES", "PAGES_DIR", "Selection", "find_captures", "render_frame", "selection")


def __getattr__(name: str) -> Any:
    if name in _FRAME_NAMES:
        import importlib

        return getattr(importlib.import_module("kvscope.dashboard.frame"), name)
    raise AttributeError(f"module 'kvscope.dashboard' has no attribute {name!r}")


__all__ = ["PAGES_DIR", "PAGE_FILES", "Selection", "find_captures", "render_frame", "selection"]
