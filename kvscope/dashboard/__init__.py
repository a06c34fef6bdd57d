"""The Streamlit dashboard: the shared frame (frame.py), cached reads (data.py), pure chart
builders (charts/), the pages (app_pages/) and `make run`'s launcher (launch.py).

It reads captures through `kvscope.telemetry.queries` (read-only) and the leak report from
`kvscope.debug.report`; it never imports torch or the engine layers (tests/test_import_direction.py).

NOTE: nothing is imported here: the launcher runs outside Streamlit, where importing the
cached reads makes Streamlit warn once per cache decorator.
"""
