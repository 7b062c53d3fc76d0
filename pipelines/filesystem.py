"""Small file helpers over Beam's `FileSystems`, so local paths, gs:// and s3:// all work."""

from __future__ import annotations

import hashlib
import os
import uuid

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from bertforge.pipelines.contract.durable_files import fsync_path


def open_raw(path: str):
    """The file's bytes as stored: decompression is the readers' business (`input_files`)."""
    return FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open_raw(path) as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def sizes_of(paths: list[str]) -> dict[str, int]:
    """Each file's size in bytes (one listing call for them all; local, gs:// or s3://)."""
    if not paths:
        return {}
    results = FileSystems.match(list(paths))
    return {path: result.metadata_list[0].size_in_bytes
            for path, result in zip(paths, results, strict=True) if result.metadata_list}


def write_bytes(path: str, data: bytes) -> None:
    """Write under a unique temp name, then rename: a retried bundle may race an old attempt."""
    tmp_path = f"{path}.tmp-{uuid.uuid4().hex}"
    with FileSystems.create(tmp_path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        f.write(data)
    sync_if_local(tmp_path)
    FileSystems.rename([tmp_path], [path])


def sync_if_local(path: str) -> None:
    """A local file's bytes on the disk (fsync) before a record that vouches for them is
    written: the manifest, a bundle's done-marker. Without it a power loss could keep the
    record and lose the bytes (a new file's data reaches the disk after its name), and the
    same command then took the damaged dataset as finished. Object storage writes whole."""
    if "://" in path and not path.startswith("file://"):
        return
    fsync_path(path.removeprefix("file://"))


def read_bytes(path: str) -> bytes:
    try:
        with open_raw(path) as f:
            return f.read()
    except IsADirectoryError:  # `--vocab v1`, the folder `bertforge vocab` wrote into
        raise ValueError(f"cannot read {path!r}: a directory, not a file (the vocabulary in "
                         f"it: {os.path.join(path, 'vocab.txt')})") from None
    except Exception as error:  # BeamIOError, OSError, ... depending on the filesystem
        raise ValueError(f"cannot read {path!r}: {error}") from error
