"""The one base class of zero-lab's own errors.

Every error raised for something a user can fix (a flag, a file, a launcher variable, a
checkpoint) derives from ZeroLabError and carries a message that names what is wrong and
where. Entry points print such an error as one `error: ...` line and exit 1; anything else
is a bug and keeps its traceback.
"""


class ZeroLabError(Exception):
    """A user-fixable error; str(error) is the whole one-line message."""
