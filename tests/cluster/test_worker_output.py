"""A Ray worker's and the driver's console: our lines and errors; the libraries' output (warnings,
log records, prints) only in the log file."""

import os
import subprocess
import sys
import textwrap

from bertforge.cluster.launch.worker_output import is_ours, worker_log_path

# Run in a fresh interpreter: quiet_worker rewires the process's stdout, stderr and warnings.
# DeepSpeed is imported first, as in a worker, so its console handler exists and is re-pointed;
# quiet_worker runs twice, as in a reused Ray worker process: everything must follow the
# second log file.
WORKER = textwrap.dedent("""
    import logging, sys, warnings
    import deepspeed  # noqa: F401
    import torch.distributed.c10d_logger as library_module
    import bertforge.training.metrics as our_module
    from bertforge.cluster.launch.worker_output import quiet_worker
    from bertforge.training.metrics import console

    quiet_worker(sys.argv[2], 1)
    print("before the second setup")
    quiet_worker(sys.argv[1], 1)
    # What torch's collectives wrapper raises once per call from DeepSpeed's ZeRO:
    warnings.warn_explicit("`all_gather_into_tensor` is deprecated", FutureWarning,
                           library_module.__file__, 83)
    warnings.warn_explicit("a warning of our own", UserWarning, our_module.__file__, 1)
    logging.getLogger("DeepSpeed").warning("ZeRO stage 2 settings")
    logging.getLogger("DeepSpeed").error("a DeepSpeed error")
    # Ray Train's worker context logs each report at INFO on a logger named by its file path,
    # through the root logger's console handler (made before quiet_worker: the real stream).
    import ray.train.v2._internal.execution.context as report_module
    report_logger = logging.getLogger(report_module.__file__)
    report_logger.setLevel(logging.INFO)
    report_logger.info("Reporting training result 1: TrainingReport(checkpoint=None)")
    console("[train] step 1/2 | loss 9.7")
    print("a library's print")
    # DeepSpeed's see_memory_usage prints from its own file:
    import deepspeed.runtime.utils as memory_module
    exec(compile("print('MA 0.53 GB  CPU Virtual Memory')", memory_module.__file__, "exec"))
""")
# The root logger's console handler exists before the worker is set up, as Ray Train makes it.
WORKER = WORKER.replace("import logging, sys, warnings\n",
                        "import logging, sys, warnings\n"
                        "logging.getLogger().addHandler(logging.StreamHandler(sys.stderr))\n")


def test_library_warnings_go_to_the_run_dir_log_and_our_lines_to_the_console(tmp_path):
    first_run = tmp_path / "first"
    result = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path), str(first_run)],
                            capture_output=True, text=True, check=True)
    console = result.stdout + result.stderr
    assert "[train] step 1/2" in console and "a DeepSpeed error" in console
    assert console.count("a warning of our own") == 1  # showwarning not chained twice
    assert "deprecated" not in console and "ZeRO stage 2" not in console
    assert "Reporting training result" not in console and "MA 0.53 GB" not in console
    log = open(worker_log_path(str(tmp_path), 1), encoding="utf-8").read()
    for line in ("`all_gather_into_tensor` is deprecated", "FutureWarning",
                 "ZeRO stage 2 settings", "a DeepSpeed error", "[train] step 1/2",
                 "a warning of our own", "a library's print", "Reporting training result 1",
                 "MA 0.53 GB"):
        assert log.count(line) == 1, line
    # The first setup's file got only what was written before the second setup.
    first = open(worker_log_path(str(first_run), 1), encoding="utf-8").read()
    assert first == "before the second setup\n"


def test_only_bertforge_files_count_as_ours():
    import torch

    import bertforge.training.loop as loop

    assert is_ours(loop.__file__) and not is_ours(torch.__file__)


# The driver: our lines and a library's, before and after the command claims its directory.
DRIVER = textwrap.dedent("""
    import logging, sys, warnings
    from bertforge.cluster.cli import _configure_logging
    from bertforge.cluster.launch.worker_output import log_driver_to, quiet_driver

    _configure_logging()
    quiet_driver("train", verbose=sys.argv[2] == "verbose")
    import deepspeed.runtime.utils as library
    logging.getLogger("ray.auth").warning("Token authentication is enabled")
    exec(compile("print('Processing zero checkpoint')", library.__file__, "exec"))
    log_driver_to(sys.argv[1])
    print("[train] a line of ours")
    logging.getLogger("bertforge.cluster.x").info("[train] a record of ours")
    logging.getLogger("ray.train").error("an engine's error")
    raise SystemExit(3)
""")


def test_the_driver_keeps_the_engines_output_in_its_log_unless_verbose(tmp_path):
    log_path = tmp_path / "logs" / "train.log"
    quiet = subprocess.run([sys.executable, "-c", DRIVER, str(log_path), "quiet"],
                           capture_output=True, text=True)
    assert quiet.returncode == 3
    assert quiet.stdout == "[train] a line of ours\n"
    assert quiet.stderr == "[bertforge.cluster.x] [train] a record of ours\n" \
        "[ray.train] an engine's error\n"
    log = log_path.read_text()
    for line in ("Token authentication is enabled", "Processing zero checkpoint",
                 "[train] a line of ours", "an engine's error"):
        assert log.count(line) == 1, line
    verbose = subprocess.run([sys.executable, "-c", DRIVER, str(log_path), "verbose"],
                             capture_output=True, text=True)
    console = verbose.stdout + verbose.stderr
    assert "Token authentication is enabled" in console
    assert "Processing zero checkpoint" in console
    assert log_path.read_text().count("Processing zero checkpoint") == 2  # appended


def test_our_log_records_are_the_commands_lines_and_an_engines_keep_its_name():
    script = textwrap.dedent("""
        import logging
        from bertforge.cluster.cli import _configure_logging

        _configure_logging("demo")
        logging.getLogger("bertforge.pipelines.prepare").info("prepare: done in 9.7 s")
        logging.getLogger("ray.train").warning("an engine's warning")
        logging.getLogger("ray.train").info("an engine's chatter")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.stderr == "[demo] prepare: done in 9.7 s\n[ray.train] an engine's warning\n"
    # Under the command the stage is, its name once ("[prepare] prepare: done" before).
    alone = subprocess.run([sys.executable, "-c", script.replace('"demo"', '"prepare"')],
                           capture_output=True, text=True)
    assert alone.stderr == "[prepare] done in 9.7 s\n[ray.train] an engine's warning\n"


CRASH = textwrap.dedent("""
    import sys
    from bertforge.cluster.launch.worker_output import log_driver_to, quiet_driver

    quiet_driver("train")
    log_driver_to(sys.argv[1])
    def deep_inside():
        raise RuntimeError("the driver crashed")
    deep_inside()
""")


def test_a_crash_shows_its_traceback_on_the_console_and_in_the_log(tmp_path):
    """The interpreter prints an uncaught exception once the stack has unwound: the console
    looked for the writer's frame there, failed, and the interpreter dropped the traceback
    ("lost sys.stderr"): every crash of a quiet command was exit code 1 and no word."""
    log_path = tmp_path / "logs" / "train.log"
    done = subprocess.run([sys.executable, "-c", CRASH, str(log_path)], capture_output=True,
                          text=True)
    assert done.returncode == 1
    assert done.stderr.startswith("Traceback (most recent call last):"), done.stderr
    assert done.stderr.rstrip().endswith("RuntimeError: the driver crashed"), done.stderr
    assert "in deep_inside" in done.stderr
    assert "RuntimeError: the driver crashed" in log_path.read_text()


def test_a_refusal_leaves_no_log_in_the_temporary_directory_a_failure_does(tmp_path):
    """A command refused before it claimed a directory held only the engines' import chatter
    in its log (DeepSpeed's accelerator line), yet wrote it to /tmp and named it on the
    console: every mistyped flag left a file. A failure with an engine's traceback keeps it."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    refused = subprocess.run(
        [sys.executable, "-m", "bertforge.cluster.cli", "export", str(tmp_path / "no-run"),
         "--output", str(tmp_path / "hf")], capture_output=True, text=True, env=env)
    assert refused.returncode == 2
    assert refused.stderr.strip() == (f"bertforge export: error: checkpoint "
                                      f"{tmp_path / 'no-run'} does not exist"), refused.stderr
    assert not list(tmp_path.glob("bertforge-*.log"))
    # Nor `prepare --help` (its own parser's, inside the command): a log of its help text.
    helped = subprocess.run([sys.executable, "-m", "bertforge.cluster.cli", "prepare", "--help"],
                            capture_output=True, text=True, env=env)
    assert helped.returncode == 0 and "--max-seq-length" in helped.stdout, helped.stderr
    # The command's own flags are said too (--verbose was taken and never listed).
    assert "\n--overwrite replaces" in helped.stdout and "\n--verbose shows" in helped.stdout
    assert not list(tmp_path.glob("bertforge-*.log"))
    # The same refusal after an engine logged a traceback (a failed Beam bundle, say).
    (tmp_path / "engine.py").write_text(
        "import logging\n"
        "def run():\n"
        "    try:\n"
        "        raise RuntimeError('inside the engine')\n"
        "    except RuntimeError:\n"
        "        logging.getLogger('engine').exception('a bundle failed')\n")
    script = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
        "import engine\n"
        "from bertforge.cluster import cli\n"
        "def handler(args):\n"
        "    engine.run()\n"
        "    raise ValueError('the job failed')\n"
        "parser = cli.build_parser\n"
        "def build():\n"
        "    p = parser()\n"
        "    p._subparsers._group_actions[0].choices['export'].set_defaults(handler=handler)\n"
        "    return p\n"
        "cli.build_parser = build\n"
        "sys.exit(cli.main(['export', 'x', '--output', 'y']))\n")
    failed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env)
    assert failed.returncode == 2, failed.stderr
    (log,) = tmp_path.glob("bertforge-export-*.log")
    assert "RuntimeError: inside the engine" in log.read_text()


def test_ray_trains_traceback_of_a_workers_user_error_stays_in_the_log():
    """The driver reports a worker's user error in one line and does not retry it; Ray
    Train's worker had also put its 30-line traceback on the console before that line. A
    crash's traceback still shows."""
    import logging

    from bertforge.cluster.launch.worker_output import record_is_ours

    def ray_train_error(last_line: str) -> logging.LogRecord:
        message = ("Error in training function:\nTraceback (most recent call last):\n  File "
                   f'"/x/checkpoint.py", line 113, in save\n{last_line}\n')
        return logging.LogRecord("ray.train.v2._internal.util", logging.ERROR,
                                 "/site-packages/ray/train/v2/_internal/util.py", 252,
                                 message, None, None)

    assert not record_is_ours(ray_train_error(
        "bertforge.training.errors.UserInputError: no space left on the disk of /r"))
    assert not record_is_ours(ray_train_error(
        "bertforge.training.errors.MissingInputError: dataset /d does not exist"))
    assert not record_is_ours(ray_train_error(  # a subclass, from its own module
        "bertforge.training.data.integrity.CorruptRowError: shard 3 row 7 is damaged"))
    assert record_is_ours(ray_train_error("RuntimeError: CUDA error: an illegal memory access"))
    # A crash while handling a user error is a crash: Ray retries it, and it shows.
    assert record_is_ours(ray_train_error(
        "bertforge.training.errors.UserInputError: x\n\nDuring handling of the above "
        "exception, another exception occurred:\n\nTraceback (most recent call last):\n"
        "RuntimeError: y"))


def test_vocab_keeps_beams_import_warnings_in_its_log(tmp_path):
    """Where Beam finds an optional filesystem's packages half installed (the demo's install
    has no Dataflow extra), it warns at import; `vocab` printed those lines to the console.
    Now its console is its own lines, and the warning is in OUTPUT/logs/vocab.log."""
    breaker = tmp_path / "site"
    breaker.mkdir()
    (breaker / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class Half(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'apache_beam.io.gcp.gcsfilesystem':\n"
        "            raise ImportError('No module named apitools (simulated)')\n"
        "sys.meta_path.insert(0, Half())\n")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox\njumps over the lazy dog\n")
    output = tmp_path / "vocab"
    done = subprocess.run(
        [sys.executable, "-m", "bertforge.cluster.cli", "vocab", "--input", str(corpus),
         "--output", str(output), "--vocab-size", "120"],
        capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(breaker), "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{output / 'vocab.txt'}\n"
    assert "GCSFileSystem" not in done.stderr
    assert all(line.startswith("[vocab] ") for line in done.stderr.splitlines()), done.stderr
    assert "Failed to import GCSFileSystem" in (output / "logs" / "vocab.log").read_text()
    assert not list(tmp_path.glob("bertforge-*.log"))
