"""One run per run directory: a lock file that also works on a shared filesystem and in storage.

The lock is a small JSON file (`.lock`) naming its holder: host, pid (with the pid's start time,
pid namespace and the kernel's boot id, so a reused pid, another container or another node of
the same name is not taken for the holder), when it started, and a heartbeat timestamp a thread
refreshes every `HEARTBEAT_SECONDS`. Keys it does not know (a newer bertforge's) are ignored.

- Taking it is atomic on a local or shared (NFS) filesystem: the record is written to a private
  temp file and published with `link()`, which fails when `.lock` exists and never shows a
  half-written file (O_CREAT|O_EXCL where the filesystem has no hard links).
- The holder is alive while, on the same host, pid namespace and boot, its pid runs (the
  kernel knows at once; a pid of another user that cannot be inspected counts as running), or,
  seen from anywhere else, its heartbeat is fresh (`STALE_AFTER_SECONDS`; clocks of the nodes
  must agree to within a fraction of that). The root pid namespace has the same id on every
  Linux host, hence the boot id: without it (an older lock, no /proc) only the heartbeat counts.
  A dead holder's lock is taken over with a message; a live holder's makes the new run fail at
  once, naming it. A lock file that cannot be read (another version's) counts as held until
  its mtime is `STALE_AFTER_SECONDS` old.
- Takeover is claimed first: of the runs that found one stale record, only the one that
  creates its claim (`.lock.<digest>.claim`, atomic as the lock) removes it, and only if the
  lock still holds that record; the others retry and find it gone or a fresh one. Unclaimed,
  a run that read the stale record before another took over moved the other's fresh lock
  aside to check it, and a third run took the lock in that moment: two holders (seen with
  real processes where rename and link take a network round trip, as on NFS). A claim whose
  run died is removed once its run is gone, as a lock is; both then race on the atomic create.
  A heartbeat rewrites the record under the same claim, and only if it is still its own: a
  holder resuming from a stall never writes over the lock another run took over meanwhile.
- In object storage (`--storage gs://... / s3://...`, through pyarrow.fs) there is no
  create-if-absent: the lock is written only if absent and read back after `SETTLE_SECONDS`;
  the run that reads its own token holds it. Two runs whose existence checks fall within the
  same second can both write; the later write wins and the earlier writer's read-back sees the
  other's token, unless its write took longer than SETTLE_SECONDS to land. The heartbeat
  re-reads the token and reports a lost lock.

A crash leaves the file behind; the next run sees its holder dead and takes it over.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone

from bertforge.training.errors import UserInputError

LOCK_NAME = ".lock"
HEARTBEAT_SECONDS = 30.0
STALE_AFTER_SECONDS = 120.0  # four missed heartbeats
SETTLE_SECONDS = 1.0  # object storage: how long a write is given to land before reading back


class RunDirectoryInUse(ValueError):
    """Another live run holds the directory: a user error, shown in one line."""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_scope() -> dict[str, str]:
    """Where a pid names this process table: host name, pid namespace and kernel boot."""
    return {"host": socket.gethostname(), "pid_namespace": _pid_namespace(),
            "boot_id": _boot_id()}


def _running(pid: int) -> tuple[bool, float | None]:
    """Whether `pid` runs here, and its start time where it can be read."""
    import psutil

    if pid <= 0:
        return False, None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False, None
    except PermissionError:
        pass  # it exists: another user's process
    try:
        process = psutil.Process(pid)
        # Killed, and not reaped yet by its parent (a notebook, a script waiting on something
        # else): it answers os.kill, but runs no more, and its directory stayed locked.
        if process.status() == psutil.STATUS_ZOMBIE:
            return False, None
        return True, process.create_time()
    except psutil.Error:
        # Another user's process that psutil may not inspect, or hidden by a hidepid /proc:
        # os.kill saw it, so it runs; its start time (pid reuse) cannot be checked.
        return True, None


@dataclass
class Holder:
    host: str
    pid: int
    pid_start: float | None
    pid_namespace: str
    started: float
    heartbeat: float
    command: str
    token: str
    boot_id: str = ""  # "": an older bertforge's lock, or no /proc

    @classmethod
    def me(cls, command: str) -> Holder:
        now = time.time()
        return cls(host=socket.gethostname(), pid=os.getpid(),
                   pid_start=_running(os.getpid())[1], pid_namespace=_pid_namespace(),
                   started=now, heartbeat=now, command=command, token=uuid.uuid4().hex,
                   boot_id=_boot_id())

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder a lock file names, or None; keys of a newer bertforge are ignored."""
        try:
            record = json.loads(text)
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in record.items() if k in known})
        except (ValueError, TypeError, AttributeError):
            return None

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    def is_local(self) -> bool:
        """Whether its pid is one of this kernel's, in this pid namespace."""
        boot_id = _boot_id()
        return (self.host == socket.gethostname() and self.pid_namespace == _pid_namespace()
                and bool(boot_id) and self.boot_id == boot_id)

    def is_alive(self, stale_after: float) -> bool:
        if self.is_local():
            running, start = _running(self.pid)
            # A pid the kernel reused for another process started later: not the holder.
            return running and (start is None or self.pid_start is None
                                or abs(start - self.pid_start) < 1.0)
        return time.time() - self.heartbeat < stale_after

    def describe(self) -> str:
        since = datetime.fromtimestamp(self.started, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        return (f"host {self.host}, pid {self.pid}, since {since}, "
                f"heartbeat {max(0.0, time.time() - self.heartbeat):.0f} s ago")


def _a_file_in_the_way(directory: str) -> str | None:
    """"X is a file, not a directory" where `directory`, or the nearest folder above it that
    exists, is a file (`--output afile`: the OS says only "File exists")."""
    above = os.path.abspath(directory)
    while not os.path.exists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    return f"{above} is a file, not a directory" if os.path.isfile(above) else None


class _LocalFile:
    """The lock file on a POSIX filesystem, local or shared."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)

    def __str__(self) -> str:
        return self.directory

    def create(self, text: str) -> bool:
        try:
            os.makedirs(self.directory, exist_ok=True)
            tmp = self._write_private(text)
        except OSError as error:
            raise ValueError(f"cannot write the run lock in {self.directory}: "
                             f"{_a_file_in_the_way(self.directory) or error.strerror or error}"
                             ) from None
        return self._link_in_place(tmp, self.path, text)

    def _publish(self, path: str, text: str) -> bool:
        """Write `text` at `path` only if no file is there, never half-written. An OSError
        as it is: a heartbeat's (a full disk) is let go and tried again at the next beat."""
        return self._link_in_place(self._write_private(text), path, text)

    def _link_in_place(self, tmp: str, path: str, text: str) -> bool:
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here (some FUSE/object-store mounts)
            return self._create_exclusive(text, path)
        finally:
            os.unlink(tmp)

    def _write_private(self, text: str) -> str:
        tmp = os.path.join(self.directory, f"{LOCK_NAME}.{uuid.uuid4().hex}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _create_exclusive(self, text: str, path: str | None = None) -> bool:
        try:
            fd = os.open(path or self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return True

    def read(self) -> str | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def age(self) -> float:
        try:
            return time.time() - os.stat(self.path).st_mtime
        except FileNotFoundError:
            return 0.0

    def replace(self, text: str) -> None:
        os.replace(self._write_private(text), self.path)

    def replace_if(self, expected: str, text: str) -> None:
        """A heartbeat: `text` over the file only if it still holds `expected`, under the claim
        a takeover of `expected` takes. Read and written unclaimed, a holder resuming after a
        stall wrote its record over the lock another run had just taken over from it: the
        stalled one went on as the holder, and the other was told it lost the lock. Claimed by
        a takeover now: not written; the next beat finds the lock lost."""
        claim = self._claim_path(expected)
        if not self._publish(claim, Holder.me("heartbeat").dumps()):
            self._remove_claim_of_a_run_gone(claim)
            return
        try:
            if self.read() == expected:
                self.replace(text)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(claim)

    def remove_if(self, expected: str) -> bool:
        """Remove the file only if it still holds `expected`, as the one run that claimed
        `expected`'s removal: the others that found it stale leave it to that one."""
        claim = self._claim_path(expected)
        if not self._publish(claim, Holder.me("takeover").dumps()):
            self._remove_claim_of_a_run_gone(claim)
            return False
        try:
            # Read again under the claim: a run that claimed it before may have removed it,
            # and what is there now is a fresh lock, not to be moved even for a moment.
            return self.read() == expected and self._remove_if_still(expected)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(claim)

    def _claim_path(self, expected: str) -> str:
        digest = hashlib.sha256(expected.encode("utf-8")).hexdigest()[:16]
        return f"{self.path}.{digest}.claim"

    def _remove_claim_of_a_run_gone(self, claim: str) -> None:
        """A claim stays only while its run removes the record (a moment): one whose run died
        there would keep the record from ever being taken over."""
        try:
            with open(claim, encoding="utf-8") as f:
                claimant = Holder.parse(f.read())
            age = time.time() - os.stat(claim).st_mtime
        except FileNotFoundError:
            return
        gone = (not claimant.is_alive(STALE_AFTER_SECONDS) if claimant is not None
                else age >= STALE_AFTER_SECONDS)  # unreadable: being written, or old
        if gone:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(claim)

    def _remove_if_still(self, expected: str) -> bool:
        """Rename it away first, then check: never a fresh lock removed. Under the claim a
        fresh one is met here only where its stalled holder, taken for gone, beat again."""
        aside = f"{self.path}.{uuid.uuid4().hex}.stale"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        with open(aside, encoding="utf-8") as f:
            moved = f.read()
        if moved != expected:  # a fresh lock was published meanwhile: put it back
            self._put_back(aside, moved)
            return False
        os.unlink(aside)
        return True

    def _put_back(self, aside: str, text: str) -> None:
        """A live run's lock, moved aside to be checked, back in place: linked, or where the
        filesystem has no hard links written again (O_EXCL). Unlinked instead, its run held
        nothing, and the run that moved it took the lock at its next try: two runs."""
        try:
            os.link(aside, self.path)
        except FileExistsError:
            pass  # a third run published one meanwhile; its heartbeat tells the other
        except OSError:  # no hard links here
            self._create_exclusive(text)
        finally:
            os.unlink(aside)


class _StorageFile:
    """The lock file in object storage (a pyarrow.fs URI): write if absent, then read back."""

    def __init__(self, uri: str, filesystem=None) -> None:
        from bertforge.training.object_storage import checking_filesystem_of

        # Retries bounded: the driver takes this lock before the run starts, and a heartbeat
        # that fails is tried again at the next one.
        try:
            self.fs, base = checking_filesystem_of(uri)  # s3:// asks for the bucket's region
        except OSError as error:
            raise _out_of_reach(uri, error) from error
        self.fs = filesystem or self.fs  # one shared instance (tests: a SubTreeFileSystem)
        self.uri = uri
        self.path = f"{base.rstrip('/')}/{LOCK_NAME}"

    def __str__(self) -> str:
        return self.uri

    def create(self, text: str) -> bool:
        if self.read() is not None:
            return False
        self.replace(text)
        time.sleep(SETTLE_SECONDS)
        return self.read() == text

    def read(self) -> str | None:
        try:
            with self.fs.open_input_stream(self.path) as f:
                return f.read().decode("utf-8")
        except FileNotFoundError:
            return None

    def age(self) -> float:
        mtime = self.fs.get_file_info(self.path).mtime
        return 0.0 if mtime is None else time.time() - mtime.timestamp()

    def replace(self, text: str) -> None:
        self.fs.create_dir(self.path.rsplit("/", 1)[0], recursive=True)
        with self.fs.open_output_stream(self.path) as f:
            f.write(text.encode("utf-8"))

    def replace_if(self, expected: str, text: str) -> None:
        """A heartbeat. Storage has no claim: a takeover between the read and the write is
        lost to this write, and the other run's heartbeat reports it."""
        if self.read() == expected:
            self.replace(text)

    def remove_if(self, expected: str) -> bool:
        if self.read() != expected:
            return False
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.path)
        return True


def _out_of_reach(where, error: OSError) -> UserInputError:
    """A lock in object storage that could not be reached (credentials, network), in a line.
    Only where it is taken: a heartbeat or a release that fails is tried again, or let go."""
    from bertforge.training.object_storage import storage_error

    return UserInputError(f"the run lock in {where} could not be taken: {storage_error(error)}")


def lock_file_for(location):
    """The lock of a directory path, or of a pyarrow.fs URI (gs://, s3://, ...)."""
    if not isinstance(location, str):
        return location  # already a lock file
    if "://" in location and not location.startswith("file://"):
        return _StorageFile(location)
    return _LocalFile(os.path.abspath(location.removeprefix("file://")))


def held_with_token(root: str, token: str, attempts: int = 5) -> bool:
    """Whether the lock of directory `root`, seen from this machine, is the one taken with
    `token` (`RunLock.me.token`): a worker on another node sees the driver's lock only where
    the directory is the same one, on a filesystem both mount."""
    lock = lock_file_for(root)
    for attempt in range(attempts):
        text = lock.read()
        holder = Holder.parse(text) if text is not None else None
        if holder is not None:
            return holder.token == token
        if text is None:
            return False
        time.sleep(0.2 * (attempt + 1))  # a heartbeat rewriting it: read again
    return False


class RunLock:
    """`with RunLock([run_dir], "train"):` one holder at a time across processes and hosts."""

    def __init__(self, locations: list[str], command: str, *,
                 heartbeat_seconds: float = HEARTBEAT_SECONDS,
                 stale_after_seconds: float = STALE_AFTER_SECONDS) -> None:
        self.files = [lock_file_for(location) for location in locations]
        self.command = command
        self.heartbeat_seconds = heartbeat_seconds
        self.stale_after_seconds = stale_after_seconds
        self.me = Holder.me(command)
        self._held: list = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RunLock:
        try:
            for lock in self.files:
                try:
                    self._acquire(lock)
                except OSError as error:  # storage out of reach: credentials, network
                    if isinstance(lock, _LocalFile):
                        raise
                    raise _out_of_reach(lock, error) from error
                self._held.append(lock)
        except BaseException:
            self._release()
            raise
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._release()

    def _acquire(self, lock) -> None:
        mine = self.me.dumps()
        for attempt in range(5):
            if lock.create(mine):
                return
            text = lock.read()
            if text is None:
                continue  # released meanwhile: try again
            holder = Holder.parse(text)
            if holder is None:
                # Being written (O_EXCL path), or another bertforge version's: held until old.
                age = lock.age()
                if age < self.stale_after_seconds:
                    if age < 5.0 and attempt < 4:
                        time.sleep(0.5)
                        continue
                    raise RunDirectoryInUse(
                        f"the lock file in {lock} cannot be read (another bertforge version's?, "
                        f"written {age:.0f} s ago); it counts as held until it is "
                        f"{self.stale_after_seconds:.0f} s old; remove {LOCK_NAME} there if no "
                        f"run uses the directory")
                what = f"an unreadable lock file ({age:.0f} s old)"
            elif holder.is_alive(self.stale_after_seconds):
                raise _in_use(holder, lock)
            else:
                what = f"the lock of a run that is gone ({holder.describe()})"
            if lock.remove_if(text):
                print(f"[{self.command}] taking over {what} in {lock}", flush=True)
            else:  # another run took it, or claimed it (a takeover, a heartbeat): let it end
                time.sleep(0.1 * (attempt + 1))
        raise RunDirectoryInUse(f"could not take the lock in {lock}: other runs keep taking it")

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            self.me.heartbeat = time.time()
            for lock in list(self._held):
                with contextlib.suppress(OSError):
                    self._refresh(lock)

    def _refresh(self, lock) -> None:
        text = lock.read() or ""
        holder = Holder.parse(text)
        if holder is None or holder.token != self.me.token:
            print(f"[{self.command}] warning: the lock in {lock} was taken by "
                  f"{holder.describe() if holder else 'another run'}; two runs may be writing",
                  flush=True)
            self._held.remove(lock)
            return
        lock.replace_if(text, self.me.dumps())

    def _release(self) -> None:
        for lock in reversed(self._held):
            with contextlib.suppress(OSError):
                text = lock.read() or ""
                holder = Holder.parse(text)
                if holder is not None and holder.token == self.me.token:
                    lock.remove_if(text)
        self._held = []


def _in_use(holder: Holder, lock) -> RunDirectoryInUse:
    return RunDirectoryInUse(f"another bertforge {holder.command} is running in {lock} "
                             f"({holder.describe()}); wait for it to end or choose another "
                             "directory")


def live_holder(root: str, stale_after_seconds: float = STALE_AFTER_SECONDS) -> Holder | None:
    """The live run that holds `root`'s lock, or None (no lock, a holder that is gone, or
    `root` no directory: the caller's own checks name what it is)."""
    try:
        text = lock_file_for(root).read()
    except OSError:
        return None
    holder = Holder.parse(text or "")
    return holder if holder is not None and holder.is_alive(stale_after_seconds) else None


def refuse_if_in_use(root: str, stale_after_seconds: float = STALE_AFTER_SECONDS) -> None:
    """The refusal `exclusive_directory` gives a live holder of `root`, without taking the
    lock or making the directory: a pre-flight then reads nothing of a run directory that
    another run is writing (its checkpoints, being saved and pruned meanwhile)."""
    holder = live_holder(root, stale_after_seconds)
    if holder is not None:
        raise _in_use(holder, lock_file_for(root))


@contextlib.contextmanager
def exclusive_directory(root: str, command: str, *, storage: str | None = None,
                        **timing: float) -> Iterator[RunLock]:
    """One run of `command` in `root` (and, given, in the storage location) at a time."""
    with RunLock([root] + ([storage] if storage else []), command, **timing) as lock:
        yield lock
