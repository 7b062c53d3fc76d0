import subprocess
import sys

import pytest

from cluster.cli import build_parser, main

WORKING_COMMANDS = {"vocab", "prepare", "inspect", "train", "submit", "eval", "export", "demo"}


def test_help_lists_exactly_the_working_commands():
    help_text = build_parser().format_help()
    listed = {name for name in WORKING_COMMANDS if f"    {name} " in help_text}
    assert listed == WORKING_COMMANDS
    # Not built yet: must not be advertised.
    for planned in ("pipeline",):
        assert f"    {planned} " not in help_text


def test_console_script_help_runs():
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "demo" in out and "train" in out


def test_unknown_flag_is_one_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "somewhere", "--bogus"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_missing_dataset_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "manifest.json" in err and "Traceback" not in err


def test_export_of_a_run_without_checkpoints_is_a_clear_error(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--output", str(tmp_path / "hf")]) == 2
    assert "neither a complete checkpoint nor a run with one" in capsys.readouterr().err
