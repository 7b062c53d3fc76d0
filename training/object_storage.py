"""Object storage (gs://, s3://) as a pyarrow filesystem, with a bounded wait where a user waits.

pyarrow's Google Cloud Storage client retries a request it cannot authenticate, or cannot
send, under google-cloud-cpp's own retry policy: a `train --data gs://...` on a machine without
credentials sat silent in its pre-flight for over six minutes (measured) before anything was
said. What the driver reads or writes before a run starts (the dataset's manifest, the run lock
in storage, the checkpoints storage holds) asks with `CHECK_RETRY_SECONDS` and then says what
failed in one line. Workers copying a dataset keep the client's default: a copy of hundreds of
GB rides out a short outage. S3 fails fast on its own (a host it cannot resolve: seconds).
"""

from __future__ import annotations

import urllib.parse
from datetime import timedelta

import pyarrow.fs as pafs

# Long enough for a slow first token (a metadata server, a busy link), short enough that a
# missing credential is an error while the user still watches.
CHECK_RETRY_SECONDS = 60.0


def _gcs_filesystem_class() -> type | tuple:
    """pyarrow's GcsFileSystem, or () where pyarrow was built without it (an s3:// URI must
    not fail on the name)."""
    try:
        return pafs.GcsFileSystem
    except ImportError:
        return ()


def child_uri(uri: str, name: str) -> str:
    """`name` under the URI's path, its query kept: gs://b/runs?endpoint_override=h + x is
    gs://b/runs/x?endpoint_override=h (appended to the text, the name became the query's)."""
    parts = urllib.parse.urlsplit(uri)
    return urllib.parse.urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{name}"))


def checking_filesystem_of(uri: str) -> tuple[pafs.FileSystem, str]:
    """`pyarrow.fs.FileSystem.from_uri(uri)` for a check before the run: a GCS filesystem's
    retries limited to `CHECK_RETRY_SECONDS` (unless the URI sets a limit of its own)."""
    filesystem, path = pafs.FileSystem.from_uri(uri)
    if isinstance(filesystem, _gcs_filesystem_class()):
        # The filesystem's own options (endpoint, scheme, ... from the URI's query) with the
        # limit added: pyarrow lets them be read only through its pickling hook.
        rebuild, (options,) = filesystem.__reduce__()
        if options.get("retry_time_limit") is None:
            filesystem = rebuild({**options,
                                  "retry_time_limit": timedelta(seconds=CHECK_RETRY_SECONDS)})
    return filesystem, path


def storage_error(error: OSError) -> str:
    """An error of the storage client, for one line: google-cloud-cpp's status without the
    `error_info` it appends (the same message again, and the retry policy's metadata)."""
    return str(error).split(" error_info=", 1)[0]
