"""The one exception type a user is meant to read.

`DviError` carries a message that says what was wrong, where, and what to do. Entry points catch it
and print it as a single line; anything else escaping is a bug in dvi, not bad input.
"""


class DviError(Exception):
    """Bad input or environment: the message is for the user, no traceback needed."""
