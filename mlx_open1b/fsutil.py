"""Every file the package writes goes through here, so that a full disk, an I/O error or a missing
permission ends the same way everywhere: a WriteError naming the file, and nothing half-written
left under a name a later command would read.

Atomic writes (write_bytes_atomic, write_json_atomic, atomic_path): a reader never sees a
half-written file, and a crash never replaces a good file with a bad one (write to a temporary file
in the same directory, fsync, rename). write_file: a file inside a temporary directory that is
renamed into place whole (checkpoints, exports). append_durable: one fsynced append (the ledger),
cut back on failure; append_unsynced: the same without fsync (step times, beside the ledger). The
bytes of every write pass through write_all and are made durable by fsync_file: the two places a
test injects a failure."""
from __future__ import annotations

import contextlib
import errno as _errno
import hashlib
import json
import os
import pathlib
import tempfile

from .errors import Open1bError


class WriteError(Open1bError, OSError):
    """A file that could not be written (full disk, I/O error, no permission). The message names
    the file and the cause; the command that catches it adds the step, what is intact and how to
    continue (context()). An OSError too, so every `except OSError` around a write still holds.
    Exit code 3: the work failed, not its input."""

    exit_code = 3

    def __init__(self, path, cause: OSError | None = None, msg: str | None = None):
        self.path = pathlib.Path(path)
        self.cause = cause
        code = getattr(cause, "errno", None)
        why = (cause.strerror or str(cause)) if cause is not None else "write failed"
        name = f", {_errno.errorcode[code]}" if code in _errno.errorcode else ""
        super().__init__(msg or f"cannot write {self.path} ({why}{name})")
        self.errno, self.strerror, self.filename = code, why, str(self.path)

    def __str__(self) -> str:             # the message, not OSError's "[Errno N] ..." form
        return self.args[0]

    @classmethod
    def of_part(cls, whole, e: OSError, what: str = "") -> "WriteError":
        """The failure `e` (an OSError or a WriteError) of writing a part of `whole`, a directory
        written as one (a checkpoint, an export), named by `whole` and the part."""
        cause = getattr(e, "cause", None) or e
        part = getattr(e, "path", None) or (pathlib.Path(e.filename) if getattr(e, "filename", None) else None)
        code = getattr(cause, "errno", None)
        name = f", {_errno.errorcode[code]}" if code in _errno.errorcode else ""
        inner = f"{part.name}: " if part is not None and part != pathlib.Path(whole) else ""
        return cls(whole, cause, f"cannot write {what}{whole} ({inner}{cause.strerror or cause}{name})")

    @property
    def disk_full(self) -> bool:
        return self.errno in (_errno.ENOSPC, _errno.EDQUOT)

    def context(self, at: str = "", intact: str = "", then: str = "") -> "WriteError":
        """The same failure with what the caller knows: where it happened (`at`, e.g. "at step 4"),
        what is intact, and how to continue once the cause is fixed (`then`, e.g. "run `open1b
        train --resume --out R`")."""
        fix = ("free space on the disk" if self.disk_full else
               "make it writable" if self.errno in (_errno.EACCES, _errno.EPERM, _errno.EROFS) else
               "check the disk")
        msg = f"{self}{' ' + at if at else ''}"
        if intact:
            msg += f"; intact: {intact}; nothing half-written is left"
        if then:
            msg += f"; {fix}, then {then}"
        return WriteError(self.path, self.cause, msg)


def write_all(f, data) -> None:
    """Write all of `data` (bytes or a contiguous buffer) to the open binary file `f`; every byte
    the package writes passes here. An unbuffered file may take less than asked: loop."""
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    while view:
        n = f.write(view)
        view = view[n:]


def fsync_file(f) -> None:
    """Flush `f` and make its bytes durable."""
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(path) -> None:
    with contextlib.suppress(OSError):          # not every file system can fsync a directory
        dfd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, mode: int | None = None):
    """Yields a temporary path beside `path`; on success it is fsynced and renamed onto `path`.
    Any OSError (the caller's writes into the temporary path included) becomes a WriteError naming
    `path`; the temporary file is removed and `path` keeps what it held. mode: the file's
    permissions from the start (a private key is never readable by others, not even briefly);
    default 0666 less the umask."""
    path = pathlib.Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask           # mkstemp makes 0600; the result gets a normal file mode
        os.chmod(tmp, mode)
        yield pathlib.Path(tmp)
        with open(tmp, "rb+") as f:
            fsync_file(f)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except WriteError:
        raise
    except OSError as e:
        raise WriteError(path, e) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_bytes_atomic(path, data: bytes, mode: int | None = None) -> None:
    with atomic_path(path, mode) as tmp:
        with open(tmp, "wb", buffering=0) as f:
            write_all(f, data)


def write_json_atomic(path, obj) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def write_file(path, chunks) -> None:
    """Write the byte strings `chunks` to `path` (created or truncated) and fsync it. Not atomic: for
    a file in a temporary directory that is renamed into place once complete. WriteError naming
    `path` on failure."""
    try:
        with open(path, "wb", buffering=0) as f:
            for c in chunks:
                write_all(f, c)
            fsync_file(f)
    except OSError as e:
        raise WriteError(path, e) from None


def append_durable(path, data: bytes) -> None:
    """Append `data` to `path` (created if missing) in one write and fsync it. On failure the file
    is cut back to its previous length, so a partial append never stays, and WriteError names it."""
    path = pathlib.Path(path)
    created = not path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab", buffering=0) as f:
            size = f.seek(0, os.SEEK_END)
            try:
                write_all(f, data)
                fsync_file(f)
            except OSError:
                with contextlib.suppress(OSError):
                    f.truncate(size)
                    os.fsync(f.fileno())
                raise
    except OSError as e:
        raise WriteError(path, e) from None
    if created:                       # make the new file's directory entry durable too
        _fsync_dir(path.parent)


def append_unsynced(path, data: bytes, cut_incomplete: bool = False) -> None:
    """Append `data` to `path` (created if missing) in one write, without fsync: for what is kept
    beside a run, not in it (step times), where a line lost in a crash costs nothing. cut_incomplete:
    first remove the bytes after the file's last newline (a line a crash cut short). On failure the
    file is cut back to its previous length and WriteError names it."""
    path = pathlib.Path(path)
    try:
        with open(path, "a+b", buffering=0) as f:      # appends; reads only to find the last newline
            size = f.seek(0, os.SEEK_END)
            if cut_incomplete and size:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    f.seek(0)
                    size = f.read().rfind(b"\n") + 1
                    f.truncate(size)
            try:
                write_all(f, data)
            except OSError:
                with contextlib.suppress(OSError):
                    f.truncate(size)
                raise
    except OSError as e:
        raise WriteError(path, e) from None


def sha256_file(path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()
