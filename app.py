"""kvscope dashboard entry point: `streamlit run app.py [-- --db PATH]`.

The router and the shared frame (capture and run picker, live-refresh toggle); the pages
live in kvscope/dashboard/app_pages/. It never imports torch or the engine layers (a test
checks), so it opens captures on a machine without them.
"""

from __future__ import annotations

import streamlit as st

from kvscope.dashboard import PAGE_FILES, PAGES_DIR, render_frame
from kvscope.telemetry import CaptureError

st.set_page_config(page_title="kvscope", layout="wide")
chosen = render_frame()
pages = [st.Page(PAGES_DIR / file, title=title, default=i == 0) for i, (title, file) in enumerate(PAGE_FILES.items())]
page = st.navigation(pages)
if chosen is None:
    st.stop()
try:
    page.run()
except CaptureError as err:  # a damaged page met by a read (large captures skip the check at open)
    st.error(str(err))
