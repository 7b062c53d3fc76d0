"""A Ray worker's console: our lines and errors; library warnings only in RUN_DIR/logs."""

import subprocess
import sys
import textwrap

from bertforge.cluster.worker_output import is_ours, worker_log_path

# Run in a fresh interpreter: quiet_worker rewires the process's stdout, stderr and warnings.
# DeepSpeed is imported first, as in a worker, so its console handler exists and is re-pointed;
# quiet_worker runs twice, as in a reused Ray worker process: everything must follow the
# second log file.
WORKER = textwrap.dedent("""
    import logging, sys, warnings
    import deepspeed  # noqa: F401
    import torch.distributed.c10d_logger as library_module
    import bertforge.training.metrics as our_module
    from bertforge.cluster.worker_output import quiet_worker
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
    # Ray Train's worker context logs each report at INFO through a console handler.
    report_logger = logging.getLogger("ray.train.v2._internal.execution.context")
    report_logger.setLevel(logging.INFO)
    report_logger.addHandler(logging.StreamHandler(sys.stderr))
    report_logger.info("Reporting training result 1: TrainingReport(checkpoint=None)")
    console("[train] step 1/2 | loss 9.7")
    print("a library's print")
""")


def test_library_warnings_go_to_the_run_dir_log_and_our_lines_to_the_console(tmp_path):
    first_run = tmp_path / "first"
    result = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path), str(first_run)],
                            capture_output=True, text=True, check=True)
    console = result.stdout + result.stderr
    assert "[train] step 1/2" in console and "a DeepSpeed error" in console
    assert console.count("a warning of our own") == 1  # showwarning not chained twice
    assert "deprecated" not in console and "ZeRO stage 2" not in console
    assert "Reporting training result" not in console
    log = open(worker_log_path(str(tmp_path), 1), encoding="utf-8").read()
    for line in ("`all_gather_into_tensor` is deprecated", "FutureWarning",
                 "ZeRO stage 2 settings", "a DeepSpeed error", "[train] step 1/2",
                 "a warning of our own", "a library's print", "Reporting training result 1"):
        assert log.count(line) == 1, line
    # The first setup's file got only what was written before the second setup.
    first = open(worker_log_path(str(first_run), 1), encoding="utf-8").read()
    assert first == "before the second setup\n"


def test_only_bertforge_files_count_as_ours():
    import torch

    import bertforge.training.loop as loop

    assert is_ours(loop.__file__) and not is_ours(torch.__file__)
