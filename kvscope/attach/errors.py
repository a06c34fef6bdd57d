"""The error every attach step raises for a problem the user can act on.

NOTE: the message is one line that names what was asked of which address and what came back, so a
CLI prints it as is (no traceback) and exits 2.
"""

from __future__ import annotations


class AttachError(RuntimeError):
    """An engine that cannot be reached, does not speak HTTP, or answers in no known shape."""
