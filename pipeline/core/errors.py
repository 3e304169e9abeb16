"""The one exception type for a user's mistakes.

Anything the user can fix (a bad model name, a checkpoint that does not fit, a
missing package, an input of the wrong shape) raises `PipelineError` with the
problem and the fix.  The command line prints it without a traceback and exits
non-zero.  Every other exception is a bug in this project and keeps its
traceback.
"""


class PipelineError(Exception):
    """A problem the user can fix; the message names the problem and the fix."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(problem if fix is None else f"{problem}\n  fix: {fix}")
