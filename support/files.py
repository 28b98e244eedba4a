"""Files and folders written whole: a reader, or a run that was interrupted, sees the old contents
or the new ones, never half of either. JSON in, one clear error for a broken file."""
import contextlib
import errno
import json
import os
import re
import shutil
import socket
from pathlib import Path

from .errors import UserError, first_cause


@contextlib.contextmanager
def staged_dir(path):
    """Yield an empty folder next to `path`; when the block succeeds it replaces `path`, when it
    fails (or is interrupted) it is removed, and `path` keeps its previous contents."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = staged_name(path, "tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    with removed_on_failure(staging):
        yield staging
    replace_dir(staging, path)


# What a save writes beside its target, named with its process id: .NAME.tmp-PID (the new contents) and
# .NAME.old-PID (the old, being removed); .NAME.staging is a collective save's, named alike in every process.
STAGED_NAME = re.compile(r"\.(.+)\.(?:(?P<role>tmp|old)-(?P<pid>\d+)|staging)")
# The record of a run's staging: the lock file of the folder it holds (folder.py), whose first line names the
# holding process and whose other lines the staging names the run made there, each before making it. Only
# what a dead run recorded is ever renamed or removed: a name alike that the suite did not write stays.
RECORD_FILE = ".lock"
recorded = set()  # (record, name) pairs this process has written


def holder_line(pid):
    """The record's first line: the process holding the folder."""
    return f"the run of pid {pid} on {socket.gethostname()}"


def staged_name(path, role):
    """Where this process stages `path`'s new contents (role "tmp"), its old ones ("old"), or a collective
    save's ("staging", the same name in every process), recorded first where this run holds the folder."""
    staging = path.with_name(f".{path.name}.{role}" + (f"-{os.getpid()}" if role != "staging" else ""))
    record_staging(staging)
    return staging


def record_staging(staging):
    """Add `staging` to the record of its folder when this process holds the folder, or its parent does
    (spawn's processes): nothing when the folder is another run's, or no run's."""
    record = staging.parent / RECORD_FILE
    if (record, staging.name) in recorded:
        return
    try:
        with open(record, "r+", encoding="utf-8", opener=appending) as file:
            if file.readline().strip() not in (holder_line(os.getpid()), holder_line(os.getppid())):
                return
            file.write(f"{staging.name}\n")
    except OSError:  # no record there (a folder no run holds), or a link
        return
    recorded.add((record, staging.name))


def no_link(name, flags):
    """open()'s opener that refuses a link (O_NOFOLLOW): a record or lock is never written through one."""
    return os.open(name, flags | os.O_NOFOLLOW)


def appending(name, flags):
    """no_link's, every write at the end (O_APPEND): spawn's processes and their parent record one after another."""
    return no_link(name, flags | os.O_APPEND)


def clear_dead_staging(folder, record):
    """Clear what the saves of the run that held `folder` before this one left staged when it was killed
    mid-write (SIGKILL, a power cut): the names in its `record` (the lines of its lock file, read before
    this run took it), unless a process of that name still runs. A save killed between replace_dir's two
    renames is finished first: its new contents were complete. Returns what it did, a phrase each. Its
    caller holds the folder's lock."""
    done, folder = [], Path(folder)
    names = sorted(name for name in record.splitlines()[1:] if STAGED_NAME.fullmatch(name) and "/" not in name)
    for name in sorted(names, key=lambda name: STAGED_NAME.fullmatch(name)["role"] != "old"):  # the olds first
        entry, staged = folder / name, STAGED_NAME.fullmatch(name)
        if not os.path.lexists(entry) or (staged["pid"] and process_runs(int(staged["pid"]))):
            continue
        target = entry.with_name(staged[1])
        if staged["role"] == "old" and not os.path.lexists(target):
            new = [folder / other for other in (f".{target.name}.tmp-{staged['pid']}", f".{target.name}.staging")
                   if other in names and os.path.lexists(folder / other)]
            (new[0] if new else entry).rename(target)
            done.append(f"finished the interrupted save of {target.name}")
        if os.path.lexists(entry):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            done.append(f"removed {entry.name}")
    return done


def process_runs(pid):
    try:
        os.kill(pid, 0)  # signal 0: delivers nothing, only checks
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


# torch.save on a full disk fails with "unexpected pos ..." and no errno: a failed write that leaves
# less than this free on its disk is taken for a full disk.
NEARLY_FULL_BYTES = 1 << 20


@contextlib.contextmanager
def removed_on_failure(folder, remove=True):
    """Remove the half-written `folder` if the block fails (when `remove`: the process that owns it),
    and name a full disk as such instead of the library's error deep in a write."""
    try:
        yield
    except BaseException as error:
        if remove:
            shutil.rmtree(folder, ignore_errors=True)
        if is_disk_full(error, folder):
            raise UserError(f"no space left on {existing_parent(folder)}: free some space or choose another "
                            "--output-dir (the previous checkpoint and model are kept)", only_this_rank=True) from error
        raise


def is_disk_full(error, folder):
    """Whether a write into `folder` failed for want of space: ENOSPC (or a quota) among its causes, or
    an error of a library that says neither on a disk with next to nothing left."""
    causes = [error, error.__cause__, error.__context__, first_cause(error)]
    if any(isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT) for cause in causes):
        return True
    if isinstance(error, KeyboardInterrupt):
        return False
    return shutil.disk_usage(existing_parent(folder)).free < NEARLY_FULL_BYTES


def existing_parent(path):
    """`path`, or its nearest folder that exists: where a disk's free space can be read."""
    path = Path(os.path.realpath(path))  # os.path's forms, which Path's raise in: a loop of links, a name too long
    while not os.path.exists(path):
        path = path.parent
    return path


def replace_dir(staging, path):
    """Put the complete folder `staging` in the place of `path`, whose old contents are removed."""
    old = staged_name(path, "old")
    if path.exists():
        path.rename(old)
    staging.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def read_json_object(path, what):
    """The JSON object in `path` (a config file), or one clear error naming the file."""
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} must hold a JSON object (a {what})")
    return config


def write_json(path, data):
    write_text(path, json.dumps(data, ensure_ascii=False, indent=2) + "\n")


def write_text(path, text):
    """Write a file atomically: a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = staged_name(path, "tmp")
    try:
        staging.write_text(text, encoding="utf-8")
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
