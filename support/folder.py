"""The run's folder, --output-dir: checked in every process before any work, claimed and locked by the
process that writes the results, released when the run ends."""
import contextlib
import fcntl
import os
import stat
from pathlib import Path

from .errors import UserError
from .files import RECORD_FILE, clear_dead_staging, existing_parent, holder_line, no_link

# What a run may touch (docs/running.md): only inside --output-dir, following no link there: the folder
# may be a link the user made, but a link in it (a model/ or .lock pointing elsewhere, or to itself) is
# refused, not written through. There, only the entries below, each of its kind (another is refused before
# any work, not moved aside or failed on after the training), and the staging its saves record
# (files.record_staging). The run writing the folder holds an OS lock on this file in it: a second run
# into the folder is refused, and a run that crashed leaves no stale lock (the OS drops it with the process).
LOCK_FILE = RECORD_FILE
RUN_ENTRIES = {"model": "folder", "checkpoint": "folder", "tensorboard": "folder", "result.json": "file",
               "trace.json": "file", LOCK_FILE: "file"}
# What a run replaces whole at each save, with everything in it: no other run's folder may lie there.
REPLACED = [name for name, kind in RUN_ENTRIES.items() if kind == "folder"]
output_lock = None  # (the open lock file, whether this run created the folder) while this process holds it


def check_output_dir(name):
    """In every process, before any work: --output-dir names a folder a run can make or use, else one
    line now rather than a traceback at the first write, after the training."""
    if not name:  # Path("") is the current folder, whose model/ and result.json would be replaced unasked
        raise UserError("--output-dir is empty: name a folder ('.' for the current one)")
    check_name_lengths(name)
    try:
        is_folder = stat.S_ISDIR(os.stat(name).st_mode)
    except FileNotFoundError:  # the run makes it, unless on the way is a link to what does not exist
        for link in (path for path in (Path(name), *Path(name).parents) if os.path.islink(path)):
            if not os.path.exists(link):
                raise UserError(f"--output-dir {name}: {link} is a link to {os.readlink(link)}, which does not "
                                "exist") from None
        return
    except OSError as error:  # a loop of links, a file on the way, no permission
        raise UserError(f"--output-dir {name} cannot be used: {error.strerror}") from None
    if not is_folder:
        raise UserError(f"--output-dir {name} is a file, not a folder")


def check_name_lengths(name):
    """Each name in the folder's path fits its filesystem, and the whole path leaves room below it for the
    run's files (a name of the longest kind): else mkdir, or the first save after the training, fails."""
    folder = existing_parent(name)
    longest = max(Path(name).parts, key=lambda part: len(os.fsencode(part)))
    name_max, path_max = os.pathconf(folder, "PC_NAME_MAX"), os.pathconf(folder, "PC_PATH_MAX")
    if len(os.fsencode(longest)) > name_max:
        raise UserError(f"--output-dir {name}: the name {longest[:16]}... is {len(os.fsencode(longest))} bytes, "
                        f"its filesystem holds at most {name_max}")
    length = len(os.fsencode(os.path.abspath(name)))
    if length + name_max >= path_max:
        raise UserError(f"--output-dir {name[:40]}... is {length} bytes long, too long for the run's files below "
                        f"it: paths on its filesystem hold at most {path_max - 1} bytes")


def claim_output_dir(path):
    """Make --output-dir this run's, before any work: writable, free of links, used by no other run; then
    clear what saves of runs killed mid-write left staged in it."""
    global output_lock
    if output_lock is not None and Path(output_lock[0].name).parent == path:
        return
    created = not path.exists()
    try:
        refuse_a_running_runs_folder(path)
        path.mkdir(parents=True, exist_ok=True)
        check_entries(path)
        lock, record = lock_output_dir(path)
    except OSError as error:  # read-only, not ours, or full: found now, not after the training
        raise UserError(f"--output-dir {path} is not writable: {error.strerror}") from None
    output_lock = lock, created
    cleared = clear_dead_staging(path, record)
    if cleared:
        print(f"note: in {path}, what saves killed mid-write left: {'; '.join(cleared)}", flush=True)


def check_entries(path):
    """The run's entries in `path` are absent or of their kind (RUN_ENTRIES), and no link is there."""
    links = sorted(entry.name for entry in os.scandir(path) if entry.is_symlink())
    if links:
        raise UserError(f"--output-dir {path} holds links ({', '.join(links)}): a run writes only inside its "
                        "folder and follows no link there: remove them, or choose another --output-dir")
    for name, kind in RUN_ENTRIES.items():
        with contextlib.suppress(FileNotFoundError):
            if ("folder" if stat.S_ISDIR(os.lstat(path / name).st_mode) else "file") != kind:
                raise UserError(f"--output-dir {path} holds a {'folder' if kind == 'file' else 'file'} named "
                                f"{name}, where a run writes its {name} {kind}: move it away, or choose another "
                                "--output-dir")


def refuse_a_running_runs_folder(path):
    """`path` is not in what a running run replaces at its next save (its model/, checkpoint/,
    tensorboard/), nor does such a folder of `path` hold a running run."""
    path = Path(os.path.realpath(path))
    for outer in path.parents:
        inner = outer / path.relative_to(outer).parts[0]
        if inner.name in REPLACED and is_held(outer / LOCK_FILE):
            raise UserError(f"--output-dir {path} lies in {inner}, which the run holding {outer} replaces at its "
                            "next save: choose a folder outside it")
    for name in REPLACED:
        held = next((lock.parent for lock in (path / name).rglob(LOCK_FILE) if is_held(lock)), None)
        if held:
            raise UserError(f"--output-dir {path}: the run holding {held} lies in its {name}/, which this run "
                            "would replace: choose another --output-dir, or wait for that run to end")


def is_held(lock_path):
    """Whether a running process holds the lock `lock_path` (a shared lock cannot be had beside it)."""
    try:
        with open(lock_path, encoding="utf-8", opener=no_link) as lock:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # none there, a link, or no locks on its filesystem
        return False
    return False


def lock_output_dir(path):
    """The lock file of `path`, open and locked by this process, and the record of the run that held it
    before (files.clear_dead_staging); or one line naming the run holding it."""
    lock_path = path / LOCK_FILE
    while True:  # O_NOFOLLOW: a .lock that became a link since check_entries is refused, not written through
        lock = open(lock_path, "a+", encoding="utf-8", opener=no_link)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.readline().strip() or "another run"
            lock.close()
            raise UserError(f"--output-dir {path} is in use by {holder}: wait for that run to end, or "
                            "choose another --output-dir") from None
        except OSError as error:
            lock.close()
            raise UserError(f"--output-dir {path} cannot be locked ({error.strerror}): choose a folder on a "
                            "filesystem with file locks") from None
        # The holder before us may have removed the file between our open and our lock: lock anew.
        if lock_path.exists() and os.path.samestat(os.fstat(lock.fileno()), lock_path.stat()):
            break
        lock.close()
    lock.seek(0)
    record = lock.read()
    lock.truncate(0)
    lock.write(holder_line(os.getpid()) + "\n")
    lock.flush()
    return lock, record


def release_output_dir():
    """At the end of the run that claimed --output-dir: the lock file goes, and the folder too if the
    run created it and wrote nothing."""
    global output_lock
    if output_lock is None:
        return
    lock, created = output_lock
    output_lock = None
    folder = Path(lock.name).parent
    Path(lock.name).unlink(missing_ok=True)
    lock.close()
    if created and not any(folder.iterdir()):
        folder.rmdir()


