"""A command refused by the CLI as a user sees it: exit 2, one `error:` line, no traceback, and
no Ray started (the pre-flight runs in the driver, before Ray)."""

from __future__ import annotations

import psutil
import ray

from bertforge.cluster.cli import main


def ray_processes() -> list[str]:
    """The command lines of this process's Ray children (GCS, raylet, workers)."""
    names = []
    for child in psutil.Process().children(recursive=True):
        try:
            names.append(" ".join(child.cmdline()))
        except psutil.Error:
            continue
    return [n for n in names if "raylet" in n or "gcs_server" in n or "ray::" in n]


def refused(argv: list[str], capsys, *expected: str) -> str:
    """Run the CLI in this process; it must refuse with one line holding every `expected`."""
    status = main(argv)
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert err.startswith(f"bertforge {argv[0]}: error:") and "\n" not in err, err
    assert "Traceback" not in err
    for part in expected:
        assert part in err, err
    assert not ray.is_initialized() and not ray_processes()
    return err
