"""Files and folders written whole: a reader, or a run that was interrupted, sees the old contents
or the new ones, never half of either. JSON in, one clear error for a broken file."""
import contextlib
import json
import os
import shutil
from pathlib import Path

from cli import UserError


@contextlib.contextmanager
def staged_dir(path):
    """Yield an empty folder next to `path`; when the block succeeds it replaces `path`, when it
    fails (or is interrupted) it is removed, and `path` keeps its previous contents."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_dir(staging, path)


def replace_dir(staging, path):
    """Put the complete folder `staging` in the place of `path`, whose old contents are removed."""
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
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
    """Write JSON atomically: a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    staging.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    os.replace(staging, path)
