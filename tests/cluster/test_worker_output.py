"""A Ray worker's console: our lines and errors; library warnings only in RUN_DIR/logs."""

import subprocess
import sys
import textwrap

from bertforge.cluster.worker_output import is_ours, worker_log_path

# Run in a fresh interpreter: quiet_worker rewires the process's stdout, stderr and warnings.
WORKER = textwrap.dedent("""
    import logging, sys, warnings
    import torch.distributed.c10d_logger as library_module
    import bertforge.training.metrics as our_module
    from bertforge.cluster.worker_output import quiet_worker
    from bertforge.training.metrics import console

    quiet_worker(sys.argv[1], 1)
    # What torch's collectives wrapper raises once per call from DeepSpeed's ZeRO:
    warnings.warn_explicit("`all_gather_into_tensor` is deprecated", FutureWarning,
                           library_module.__file__, 83)
    warnings.warn_explicit("a warning of our own", UserWarning, our_module.__file__, 1)
    logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU")
    logging.getLogger("DeepSpeed").error("a DeepSpeed error")
    console("[train] step 1/2 | loss 9.7")
    print("a library's print")
""")


def test_library_warnings_go_to_the_run_dir_log_and_our_lines_to_the_console(tmp_path):
    result = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path)], capture_output=True,
                            text=True, check=True)
    console = result.stdout + result.stderr
    assert "[train] step 1/2" in console and "a DeepSpeed error" in console
    assert "a warning of our own" in console
    assert "deprecated" not in console and "Setting accelerator" not in console
    log = open(worker_log_path(str(tmp_path), 1), encoding="utf-8").read()
    for line in ("`all_gather_into_tensor` is deprecated", "FutureWarning",
                 "Setting accelerator to CPU", "a DeepSpeed error", "[train] step 1/2",
                 "a warning of our own", "a library's print"):
        assert line in log, line
    assert log.count("a DeepSpeed error") == 1


def test_only_bertforge_files_count_as_ours():
    import torch

    import bertforge.training.loop as loop

    assert is_ours(loop.__file__) and not is_ours(torch.__file__)
