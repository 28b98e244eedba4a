"""How a script runs: its failures reach the user as one line and an exit status; its process group and the
output folder's lock are let go on every exit path. Its options are options.py's, its launch environment launch.py's."""
import atexit
import contextlib
import gc
import json
import os
import signal
import sys
import time
import traceback

from tqdm import tqdm

from . import folder, launch
from .errors import UserError, describe, first_cause
from .launch import current_rank


def run(main):
    """Run `main()`, turning failures into one clear line on stderr and a non-zero exit; in a script that
    runs in a group (launch.in_a_group), after checking its launch variables."""
    import torch.distributed as dist  # its rendezvous errors, its group; every script has imported torch already
    # What the script has imported (torch, transformers: some 200,000 objects) lives as long as the process:
    # frozen, it is no longer walked by each full garbage collection, which a launch's imports keep starting.
    gc.freeze()
    # SIGTERM and SIGUSR1 (a scheduler or launcher stopping the job) unwind like Ctrl-C, once: cleanup code
    # runs (--save-on-signal's handler takes over while training). A launched process stops with its launcher.
    for number in launch.STOP_SIGNALS:
        signal.signal(number, launch.stop_once)
    if launch.launched():
        launch.stop_with_the_parent()
    try:
        if launch.in_a_group():
            launch.check_launch_variables()
        main()
    except SystemExit:  # the script's own exit status stands
        raise
    except UserError as error:
        if error.only_this_rank or current_rank() == 0:  # rank 0 speaks for all
            report(f"error: {error}")
        sys.exit(error.status)
    except KeyboardInterrupt:
        print(f"rank {current_rank()}: interrupted", file=sys.stderr)
        sys.exit(130)
    except (dist.DistNetworkError, dist.DistStoreError) as error:
        # The rendezvous never came together within --dist-timeout: a wrong address, a blocked port, or
        # a process (a node) that never started. Where is in the message; a traceback would add nothing.
        report(f"error: rank {current_rank()} could not reach the process group at {os.environ.get('MASTER_ADDR')}:"
               f"{os.environ.get('MASTER_PORT')} within --dist-timeout: {str(error).splitlines()[0]}")
        sys.exit(1)
    except BaseException as error:  # torch.distributed.checkpoint's errors derive from BaseException, not Exception
        traceback.print_exc()
        report(f"error: rank {current_rank()} failed: {describe(first_cause(error))}")
        sys.exit(1)
    finally:
        # The process is leaving, with its own status: a stop signal now (a launcher stopping the ranks after
        # another failed) changes nothing, and cuts no clean-up short, this or the exit functions'.
        for number in launch.STOP_SIGNALS:
            signal.signal(number, launch.stopping_already)
        if dist.is_initialized():  # leave the group on every exit path, failures included: no peer is left waiting
            leave_the_group(dist)
        folder.release_output_dir()
        # A destroyed gloo group can linger in a reference cycle until the interpreter shuts down, and
        # freeing it then aborts the process about one run in five ("terminate called without an
        # active exception"): free it now.
        gc.collect()
        # What is left lives to the exit, whose collections would walk it all again: over a second of CPU.
        gc.freeze()


def leave_the_group(dist):
    """Destroy the process group, keeping its own handle until the interpreter's exit functions run (atexit),
    so that the handle, not the DDP reducer, frees it last. Gloo's worker threads free a collective's tensors
    under the GIL, and may not have yet; freeing the group joins them. The reducer frees it holding the GIL
    (with the model, when a failure's traceback lets go of it): a deadlock. The handle lets go of the GIL."""
    handle = [dist.group.WORLD]
    dist.destroy_process_group()
    atexit.register(handle.clear)


def report(line):
    """The failure's one line on stderr, and for torchrun (and the launchers built on it) in the error
    file it names: its closing summary then repeats the line instead of a link to its docs. Written as tqdm
    writes: a progress bar still open is cleared first, so the line starts a line of its own."""
    tqdm.write(line, file=sys.stderr)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError), open(os.environ["TORCHELASTIC_ERROR_FILE"], "w", encoding="utf-8") as file:
            json.dump({"message": line, "timestamp": int(time.time())}, file)

