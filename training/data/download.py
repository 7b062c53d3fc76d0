"""Remote datasets (gs://, s3://, ...): copied once into a local cache, then memory-mapped.

Memory-mapping needs a local file; copying a split once keeps the loader's memory flat for
remote data too, and keeps every later epoch off the network.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
import uuid
from datetime import timedelta

import pyarrow.fs as pafs

from bertforge.pipelines.contract import manifest as manifest_lib


def local_dataset_dir(
    data_dir: str,
    split: str,
    cache_dir: str | None,
    filesystem: pafs.FileSystem | None = None,
) -> str:
    """`data_dir` itself when local; else a local copy of its manifest, vocab and split.

    `filesystem` (with `data_dir` a path in it) replaces resolving a URI: for stores that need
    options a URI cannot carry (credentials, an S3 endpoint, a sub-tree).
    """
    if filesystem is None:
        if "://" not in data_dir:
            return data_dir
        filesystem, data_dir = pafs.FileSystem.from_uri(data_dir)
    if isinstance(filesystem, pafs.LocalFileSystem):
        return data_dir
    return download_split(filesystem, data_dir, split, cache_dir)


def download_split(
    filesystem: pafs.FileSystem, root: str, split: str, cache_dir: str | None = None
) -> str:
    """Copy a dataset's manifest, vocab and one split's shards to a local directory.

    The copy lives under `cache_dir/<hash of the manifest>`, so a re-prepared dataset never
    mixes with an old copy; a shard already there with the right size is not fetched again,
    and each copy lands under a temporary name first, so an interrupted one never counts.
    """
    manifest_bytes = _read_manifest_bytes(filesystem, root)
    target = _copy_dir(manifest_bytes, cache_dir)
    os.makedirs(target, exist_ok=True)
    manifest = manifest_lib.Manifest.from_dict(json.loads(manifest_bytes))
    if split not in manifest.splits:
        raise ValueError(f"{root} has no split {split!r} (it has {sorted(manifest.splits)})")
    shard_paths = [entry.path for entry in manifest.splits[split].shards]
    for relative in [manifest_lib.VOCAB_NAME, *shard_paths]:
        _fetch(filesystem, f"{root.rstrip('/')}/{relative}", os.path.join(target, relative))
    manifest_lib.write_manifest(target, manifest)  # last, as in the original
    return target


def _read_manifest_bytes(filesystem: pafs.FileSystem, root: str) -> bytes:
    manifest_path = f"{root.rstrip('/')}/{manifest_lib.MANIFEST_NAME}"
    try:
        with filesystem.open_input_stream(manifest_path) as stream:
            return stream.read()
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"{manifest_path} not found: not a prepared dataset, or its preparation did not "
            "finish (the manifest is written last)"
        ) from error


def _copy_dir(manifest_bytes: bytes, cache_dir: str | None) -> str:
    """Where a dataset's local copy lives: named by its manifest's digest."""
    cache_root = cache_dir or os.path.join(tempfile.gettempdir(), "bertforge-datasets")
    return os.path.join(cache_root, hashlib.sha256(manifest_bytes).hexdigest()[:16])


def _fetch(filesystem: pafs.FileSystem, source: str, destination: str) -> None:
    info = filesystem.get_file_info(source)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"shard or vocabulary {source} is missing (the manifest lists it)")
    if os.path.exists(destination) and os.path.getsize(destination) == info.size:
        return
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    # A name of its own: two runs on one node may fetch the same shard at once.
    handle, partial = tempfile.mkstemp(dir=os.path.dirname(destination),
                                       prefix=os.path.basename(destination) + ".partial-")
    try:
        with filesystem.open_input_stream(source) as stream, os.fdopen(handle, "wb") as out:
            while chunk := stream.read(1 << 24):
                out.write(chunk)
        os.replace(partial, destination)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise


def dataset_on_this_node(data_dir: str, splits: tuple[str, ...], poll_seconds: float = 1.0,
                         wait_hours: float = 24.0) -> str:
    """A training run's dataset as a local directory: `data_dir` itself when local; a gs:// or
    s3:// one copied into this node's cache (`download_split`, each split named) by the node's
    local rank 0, so a node fetches each shard once however many workers it runs. Collective
    when a process group is up.

    No rank waits for a copy in the run's own process group: a copy of hundreds of GB outlasts
    its timeout (30 minutes), whose watchdog would end the run as a failed one. A node's other
    ranks watch for this run's marker file; the nodes then meet in a gloo group of their own
    with a timeout of `wait_hours` (a node that has its copy already waits there for one that
    fetches). A failed copy ends the run through its launcher."""
    import torch.distributed as dist

    from bertforge.training.distributed import local_rank

    if "://" not in data_dir:
        return data_dir
    filesystem, root = pafs.FileSystem.from_uri(data_dir)
    if isinstance(filesystem, pafs.LocalFileSystem):
        return root
    copy = _copy_dir(_read_manifest_bytes(filesystem, root), None)
    waiting = None
    token = [uuid.uuid4().hex]
    if dist.is_initialized():
        waiting = dist.new_group(backend="gloo", timeout=timedelta(hours=wait_hours))
        dist.broadcast_object_list(token, src=0, group=waiting)  # this run's marker name
    marker = os.path.join(copy, f".copied-{token[0]}")
    copying = local_rank() == 0
    if copying:
        for split in splits:
            download_split(filesystem, root, split)
        with open(marker, "w", encoding="utf-8"):
            pass
    else:
        while not os.path.exists(marker):
            time.sleep(poll_seconds)
    if waiting is not None:
        dist.barrier(group=waiting)  # every node's copy is there; the marker is read
        dist.destroy_process_group(waiting)
    if copying:
        with contextlib.suppress(OSError):
            os.remove(marker)
    return copy
