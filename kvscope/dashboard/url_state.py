"""The view in the URL: a copied link opens the same capture, run, page and step.

The page is the URL's path (st.navigation: /tree, /leaks, ...); the rest is query parameters:
    capture  the capture file, as the sidebar lists it     (every page)
    run      the run id                                     (every page)
    tenant   the sidebar's tenant filter (absent: all)      (every page)
    step     the Radix tree page's step
    node     the Radix tree page's node in 'Node details'
    rid      the Requests page's request
    x        the x axis of Memory's and the Overview's charts: step or time (wall clock)
The frame writes capture and run on every rerun; a page adds its own keys (`publish`), and a
page's keys leave the URL on the other pages.

NOTE: a value from the URL is applied once, when it is new: on a session's first rerun (a
pasted link), or when a link inside the app (st.page_link) changed the URL. After that the
widgets own the value. Every value is checked where it is used (a run that exists, a step in
the run's range); a bad one becomes a note on the page and the default view, never an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import urlencode

import streamlit as st

FRAME_KEYS = ("capture", "run", "tenant")
PAGE_KEYS = ("step", "node", "rid", "x")
AXES = ("step", "time")  # x's values
MAX_TEXT_LEN = 200
WRITTEN_KEY = "kvscope.url.written"  # the query parameters this session wrote last
HISTORY_KEY = "kvscope.url.history"  # key -> the values this session wrote lately (newest last)
HISTORY_LEN = 64
PENDING_KEY = "kvscope.url.pending"  # values from the URL not applied yet
NOTES_KEY = "kvscope.url.notes"


class Parsed(NamedTuple):
    """Valid values by key, and one note per value that was not."""

    values: dict[str, Any]
    notes: list[str]


def parse(params: Mapping[str, str]) -> Parsed:
    """Type-check the link's values: run, step and node whole numbers >= 0; x one of AXES; capture,
    tenant and rid non-empty printable text. Unknown keys are ignored."""
    values: dict[str, Any] = {}
    notes: list[str] = []
    for key in (*FRAME_KEYS, *PAGE_KEYS):
        if key not in params:
            continue
        text = str(params[key]).strip()
        value = _whole(text) if key in ("run", "step", "node") else _axis(text) if key == "x" else _text(text)
        if value is None:
            notes.append(f"The link's {key} {_shown(text)} is not {_expected(key)}: ignored.")
        else:
            values[key] = value
    return Parsed(values, notes)


def _whole(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 12 else None


def _axis(text: str) -> str | None:
    return text if text in AXES else None


def _text(text: str) -> str | None:
    return text if text and len(text) <= MAX_TEXT_LEN and text.isprintable() else None


def _expected(key: str) -> str:
    if key == "x":
        return " or ".join(AXES)
    return "a whole number" if key in ("run", "step", "node") else "a name"


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "…")


def link(page: str, **values: Any) -> str:
    """A relative link to `page` (its URL path, e.g. 'requests') with these query values."""
    query = urlencode({k: str(v) for k, v in values.items() if v is not None})
    return f"{page}?{query}" if query else page


# -- the session's side: read once per change, write every rerun ----------------------------------


def take_new() -> None:
    """Called by the frame first: the URL's values that differ from what this session wrote
    last become pending (checked for type; bad ones become notes)."""
    current = {k: v for k, v in st.query_params.to_dict().items() if k in (*FRAME_KEYS, *PAGE_KEYS)}
    written = st.session_state.get(WRITTEN_KEY)
    history: dict[str, list[str]] = st.session_state.get(HISTORY_KEY, {})
    # NOTE: a value this session wrote lately is an echo, not a link: a live page writes its step every
    # second from a fragment, and a rerun may carry the browser's URL from before the last write
    # (it then read as a link to an older step and turned the tree's 'follow newest' off)
    new = (
        current
        if written is None
        else {k: v for k, v in current.items() if written.get(k) != v and v not in history.get(k, ())}
    )
    parsed = parse(new)
    st.session_state[PENDING_KEY] = parsed.values
    st.session_state[NOTES_KEY] = parsed.notes


def pending(key: str) -> Any | None:
    """The URL's new value for `key`, once: the caller applies it (or notes why not)."""
    values: dict[str, Any] = st.session_state.get(PENDING_KEY, {})
    return values.pop(key, None)


def note(text: str) -> None:
    st.session_state.setdefault(NOTES_KEY, []).append(text)


def show_notes() -> None:
    """The notes about the link's values (the page shows them under its header)."""
    for text in st.session_state.get(NOTES_KEY, []):
        st.info(text, icon=":material/link_off:")
    st.session_state[NOTES_KEY] = []


def publish(**values: Any) -> None:
    """Put these values in the URL (None removes a key) and remember them as written."""
    written = dict(st.session_state.get(WRITTEN_KEY) or {})
    history: dict[str, list[str]] = st.session_state.setdefault(HISTORY_KEY, {})
    for key, value in values.items():
        if value is None:
            written.pop(key, None)
            st.query_params.pop(key, None)
        else:
            written[key] = str(value)
            st.query_params[key] = str(value)
            recent = history.setdefault(key, [])
            if str(value) not in recent[-1:]:
                recent.append(str(value))
                del recent[:-HISTORY_LEN]
    st.session_state[WRITTEN_KEY] = written


def reset(**frame_values: Any) -> None:
    """The frame's write: capture, run and tenant, and no page's keys (the page adds its own)."""
    for key in PAGE_KEYS:
        st.query_params.pop(key, None)
    st.session_state[WRITTEN_KEY] = {}
    publish(**frame_values)
