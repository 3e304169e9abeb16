"""Writing artifacts safely: a temporary name first, then an atomic rename, under the folder's build lock.

An interrupted run therefore never leaves a file under a final name that looks finished but is not,
and two builds never write one folder at once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

import numpy as np

from ..core.errors import PipelineError
from ..core.settings import mention

# In the artifact folder; while a build runs it holds that build's pid.
LOCK = ".build.lock"
# atomic_path's temporary names: .<final name>.<pid of the writer>.tmp
_TEMPORARY = re.compile(r"\..+\.(\d+)\.tmp")


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside `final`; rename it to `final` only if the block succeeds."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = final.with_name(temporary_name(final))
    try:
        yield temporary
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)


@contextlib.contextmanager
def scratch_folder(beside: Path, name: str) -> Iterator[Path]:
    """A folder for a stage's intermediate files, named as this process's temporaries in `beside`'s folder (a killed
    run's is removed by the next build), removed on exit.  Beside the artifacts, not in the system's temporary
    folder: the INT8 stage's scratch graphs are copies of the model's weights, several of them, and belong on the
    disk the user gave the graphs, not in a /tmp that may be memory (a tmpfs, the default of several Linux
    distributions) or too small for them."""
    folder = Path(beside).parent / temporary_name(Path(beside).parent / name)
    folder.mkdir(parents=True)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def temporary_name(final: Path) -> str:
    """The name a file (or a graph's private folder, graph_files.atomic_graph) has while this process writes it."""
    return f".{Path(final).name}.{os.getpid()}.tmp"


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[list[Path]]:
    """Hold `folder`'s build lock for the block; yield the temporaries of killed runs it removed first.

    Two builds writing one folder interleave (one's engine.plan under the other's manifest), so a second
    build is refused at once, naming the first, rather than queued: the user decides whether to wait for
    it or stop it.  The kernel releases an flock when its holder dies, so a killed build leaves no lock.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with _open_lock(folder, os.O_RDWR | os.O_CREAT) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _lock_held(folder, _pid_in(handle)) from None
        _write_pid(handle, str(os.getpid()))
        try:
            yield remove_stale_temporaries(folder)
        finally:
            _write_pid(handle, "")  # a pid left here would name a build that is over


def running_build(folder: Path) -> int | None:
    """The pid of the build writing `folder` now, or None.  Read without locking, so that a reader never
    makes a starting build fail; a build killed before it cleared its pid is told apart by its pid being dead."""
    try:
        with _open_lock(Path(folder), os.O_RDONLY) as handle:
            pid = _pid_in(handle)
    except (FileNotFoundError, PipelineError):  # no lock, or none a build could hold (build_lock refuses it)
        return None
    return pid if pid is not None and _alive(pid) else None


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete the temporaries under `folder` whose writer is dead (a killed run's half-written artifacts: files,
    and the private folders graphs are written in).

    Only dead writers' ones: a benchmark or a diagnosis may be writing its report into the folder right now.
    """
    removed = []
    for path in sorted(Path(folder).rglob(".*.tmp")):
        match = _TEMPORARY.fullmatch(path.name)
        if not match or _alive(int(match[1])) or not path.exists():
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _open_lock(folder: Path, flags: int) -> IO[str]:
    """The lock file, opened only if it is a plain file of its own.  Never through a symbolic link: anyone who can
    write the folder could point the lock at another file, which the build would then empty and write its pid into
    (or create, for a dangling link).  O_NONBLOCK: a FIFO put there opens at once, to be refused, instead of
    blocking until someone writes to it."""
    path = folder / LOCK
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
        raise _not_a_lock(path, file_kind(os.lstat(path))) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        raise _not_a_lock(path, file_kind(info))
    return os.fdopen(fd, "r+" if flags & os.O_RDWR else "r")


def file_kind(info: os.stat_result) -> str:
    """What a file that is not a plain file of one name is, in words (a FIFO, a symbolic link, ...)."""
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link"
    if stat.S_ISREG(info.st_mode):  # a plain file under another name too: writing it would change that file
        return f"a file with {info.st_nlink} names (hard links)"
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket"}
    return next((word for test, word in kinds.items() if test(info.st_mode)), "a device file")


def _not_a_lock(path: Path, kind: str) -> PipelineError:
    return PipelineError(
        f"the build lock {path} is {kind}, not a plain file of the folder's own: a build writes its pid into its "
        "lock, and through a link or another name that would overwrite another file",
        f"check who made it, remove it (rm -r {shlex.quote(str(path))}) and run again: the build makes a new one",
    )


def _lock_held(folder: Path, pid: int | None) -> PipelineError:
    holder = f"process {pid}" if pid is not None else "another process"
    return PipelineError(
        f"another build is writing {folder} ({holder} holds {folder / LOCK}); two builds into one folder would "
        "mix their artifacts",
        f"wait for it to finish, or stop it{f' (kill {pid})' if pid is not None else ''}, then run again; "
        f"or build into another folder ({mention(out_root='...')})",
    )


def _pid_in(handle) -> int | None:
    handle.seek(0)
    text = handle.read().strip()
    return int(text) if text.isdigit() else None


def _write_pid(handle, text: str) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(text)
    handle.flush()


def _alive(pid: int) -> bool:
    """Whether the process runs: one that exists and is no zombie (a killed build whose parent, the command line's
    or a container's first process, has not reaped it: it holds no lock and writes nothing)."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by another user
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Linux's /proc says so (its state Z); False where there is no /proc to ask."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] == "Z"  # the state follows the command's name in parentheses


def write_bytes(final: Path, data: bytes | memoryview) -> None:
    with atomic_path(final) as temporary:
        temporary.write_bytes(data)


def write_npz(final: Path, arrays: dict[str, np.ndarray]) -> None:
    with atomic_path(final) as temporary, open(temporary, "wb") as handle:
        np.savez(handle, **cast(dict[str, Any], arrays))  # numpy's stub types **kwds as allow_pickle


def write_json(final: Path, record: dict) -> None:
    write_bytes(final, (json.dumps(record, indent=2, sort_keys=False, default=str) + "\n").encode())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
