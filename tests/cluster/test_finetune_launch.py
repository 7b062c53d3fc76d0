"""Fine-tuning's launch on one machine: one worker on every core unless the flags say otherwise
(cluster.launch.finetune_workers, chosen from benchmarks/finetune_vs_plain_loop.py). Pure: no
Ray; the command-line test stops at the call to run_finetune."""

from __future__ import annotations

import pytest

from bertforge.cluster.cli import main
from bertforge.cluster.commands import finetune_sweep as finetune_module
from bertforge.cluster.launch.finetune_workers import finetune_launch, local_cores
from bertforge.cluster.launch.launch_config import LaunchConfig


@pytest.mark.parametrize(("given", "workers", "threads"), [
    ({}, 1, 2),                                     # the default: one worker, all the cores
    ({"workers": 1}, 1, 2),                         # --workers 1 no longer leaves a core idle
    ({"workers": 2}, 2, 1),                         # the cores split between the workers
    ({"workers": 4}, 4, 1),                         # never below one thread
    ({"workers": 1, "cpus_per_worker": 1}, 1, 1),   # flags given always win
    ({"cpus_per_worker": 3}, 1, 3),
])
def test_a_local_run_shares_the_machine_s_cores_between_its_workers(given, workers, threads):
    launch = finetune_launch(given, cores=2)
    assert (launch.workers, launch.cpus_per_worker) == (workers, threads)


def test_on_a_cluster_or_on_gpus_launch_config_s_defaults_stand():
    defaults = LaunchConfig()
    for given in ({"address": "auto"}, {"gpu": True}):
        launch = finetune_launch(given, cores=16)
        assert (launch.workers, launch.cpus_per_worker) == (defaults.workers,
                                                            defaults.cpus_per_worker)
    assert finetune_launch({"address": "auto", "workers": 3}, cores=16).workers == 3


def test_the_command_line_passes_the_local_default(monkeypatch):
    seen = {}
    monkeypatch.setattr(finetune_module, "run_finetune",
                        lambda cfg, launch: seen.update(launch=launch))
    assert main(["finetune", "--task", "sst2", "--model", "m", "--output", "o"]) == 0
    assert (seen["launch"].workers, seen["launch"].cpus_per_worker) == (1, local_cores())
    assert main(["finetune", "--task", "sst2", "--model", "m", "--output", "o",
                 "--workers", "1", "--cpus-per-worker", "1"]) == 0
    assert (seen["launch"].workers, seen["launch"].cpus_per_worker) == (1, 1)


def test_glue_data_beside_the_checkout_is_found_from_any_working_directory(tmp_path,
                                                                          monkeypatch):
    """`finetune --data-root` and `glue --glue-dir` default to ../shared/data, else to
    shared/data beside this checkout (the checkout was taken for cluster/ when the module
    moved one folder down, and the default was lost outside the checkout)."""
    import bertforge.cluster

    # A checkout laid out as this one (cluster/ in it), shared/data beside it, and a working
    # directory elsewhere: the same answer wherever the test runs, ../shared present or not.
    checkout = tmp_path / "checkout"
    (checkout / "cluster").mkdir(parents=True)
    monkeypatch.setattr(bertforge.cluster, "__file__", str(checkout / "cluster" / "__init__.py"))
    elsewhere = tmp_path / "work" / "here"
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)  # no ../shared/data from here
    assert finetune_module.default_data_root() is None
    (tmp_path / "shared" / "data").mkdir(parents=True)
    assert finetune_module.default_data_root() == str((tmp_path / "shared" / "data").resolve())


@pytest.mark.parametrize("command", [["finetune", "--task", "sst2", "--output", "o"],
                                     ["glue", "--output", "o"]])
def test_no_workers_is_one_line_naming_the_flag(command, capsys):
    """`--workers 0` divided the machine's cores by 0: a ZeroDivisionError's traceback."""
    from tests.support.refusals import refused

    refused([*command, "--model", "m", "--workers", "0"], capsys,
            "--workers must be at least 1, got 0")
