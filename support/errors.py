"""How a script's failures reach the user: the error a user can fix, reported in one line, and the
first line of any other. Imports nothing: every module may raise a UserError."""


class UserError(Exception):
    """A problem the user can fix (bad data, missing model, wrong launch): reported in one line.

    Most are found by every process alike, and rank 0 speaks for all; one that only some processes
    meet (`only_this_rank=True`) is reported by each of them.
    """
    status = 2  # the exit status, argparse's for a bad option

    def __init__(self, message, only_this_rank=False):
        super().__init__(message)
        self.only_this_rank = only_this_rank


class StoppedAfterSaving(UserError):
    """--save-on-signal's stop: the checkpoint is saved and --resume continues. Its status is sysexits.h's
    EX_TEMPFAIL, "try again later": not 0, so a scheduler or launcher sees the run unfinished (and may
    requeue it), and not a bad option's 2."""
    status = 75


def first_cause(error):
    """The error itself, or the first rank's of the failures torch.distributed.checkpoint gathers into one."""
    failures = getattr(error, "failures", None)
    return next(iter(failures.values()))[0] if isinstance(failures, dict) and failures else error


def describe(error):
    """The error's type and the first line of its message."""
    message = str(error).strip()
    return f"{type(error).__name__}: {message.splitlines()[0]}" if message else type(error).__name__
