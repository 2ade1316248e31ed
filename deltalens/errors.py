"""User-facing errors.

Anything a user can fix (a missing file, a bad flag value, a corrupt checkpoint) raises
`DeltalensError` with a one-line message that says what to do. The CLI prints it and exits 2;
tracebacks are shown only when DELTALENS_DEBUG=1.
"""


class DeltalensError(Exception):
    """An error caused by user input; the message is shown as-is, without a traceback."""

    exit_code = 2
