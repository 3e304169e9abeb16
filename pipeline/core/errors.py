"""The one exception type for a user's mistakes.

Anything the user can fix (a bad model name, a checkpoint that does not fit, a
missing package, an input of the wrong shape) raises `PipelineError` with the
problem and the fix.  The command line prints it without a traceback and exits
non-zero.  Every other exception is a bug in this project and keeps its
traceback.  A setting the message names is worded when the message is read, in
the words of the front end that shows it (core/mentions.py).
"""

import errno

from .mentions import render

# The file system's ways of saying a write does not fit (a full disk, a quota met, a file size limit): the user's to
# fix where the files go, never a reason to go on without the file.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def no_room(error: BaseException) -> bool:
    """Whether `error` is the file system saying a write does not fit (NO_ROOM)."""
    return isinstance(error, OSError) and error.errno in NO_ROOM


class PipelineError(Exception):
    """A problem the user can fix; the message names the problem and the fix."""

    def __init__(self, problem: str, fix: str | None = None):
        self._problem, self._fix = problem, fix
        super().__init__(problem if fix is None else f"{problem}\n  fix: {fix}")

    @property
    def problem(self) -> str:
        return render(self._problem)

    @property
    def fix(self) -> str | None:
        return None if self._fix is None else render(self._fix)

    def __str__(self) -> str:
        return render(super().__str__())

    def __repr__(self) -> str:
        return f"PipelineError({self.problem!r}, {self.fix!r})"
