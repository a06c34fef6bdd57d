"""kvscope dashboard entry point: `streamlit run app.py`.

The router and the shared frame. It never imports torch or the engine layers (a test
checks), so it opens captures on a machine without them.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

CAPTURE_DIRS = (Path("runs"), Path("sample_runs"))


def find_captures() -> list[Path]:
    """Capture files (*.db) under runs/ then sample_runs/, newest first within each."""
    found: list[Path] = []
    for folder in CAPTURE_DIRS:
        if folder.is_dir():
            found += sorted(folder.glob("*.db"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found


def home() -> None:
    st.title("kvscope")
    st.caption("KV-cache memory, slot by slot: radix tree, SWA vs full pools, leaks.")
    captures = find_captures()
    if not captures:
        st.info(
            "No captures found under `runs/` or `sample_runs/`. Recording runs arrives with the "
            "telemetry store; for now `make run` prints a live demo of the memory pools."
        )
        return
    st.subheader("Captures")
    st.dataframe({"capture": [str(p) for p in captures]}, hide_index=True)


st.set_page_config(page_title="kvscope", layout="wide")
st.navigation([st.Page(home, title="Home", default=True)]).run()
