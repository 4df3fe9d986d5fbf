"""The exception types a user is meant to read.

`DviError` carries a message that says what was wrong, where, and what to do (`Refused`: a drafter version that will
not be served, with a reason code). Entry points catch it
and print it as a single line; anything else escaping is a bug in dvi, not bad input. `RecordError` is a
DecisionRecord (object or bytes) that is malformed: the consumer dead-letters it and goes on.
"""


class DviError(Exception):
    """Bad input or environment: the message is for the user, no traceback needed."""


class RecordError(ValueError):
    """A DecisionRecord (object or bytes) that is malformed; `field` names the offending part."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name


class Refused(DviError):
    """A published drafter that will not be served; `reason` is one of the codes `dvi.swap`'s docstring lists."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
