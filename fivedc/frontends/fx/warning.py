"""The fx frontend's warning: what it dropped or approximated, at the user's line."""

from __future__ import annotations


class FxWarning(UserWarning):
    """Something the fx frontend dropped or approximated (dropout, ignore_index), at the user's
    line, or a slower way it took (a model exported whole, with the reason)."""
