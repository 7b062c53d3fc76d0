"""Steps/s of the same training on one Ray node with 2 workers vs two nodes with 1 worker each.

Both clusters are real (`ray start`) on this machine, on loopback addresses; the job goes in
through `bertforge submit`, as on a real cluster. Needs a prepared shard directory, e.g. the
demo's:

    bertforge demo --output /tmp/demo
    python benchmarks/multinode_steps.py --data /tmp/demo/shards --steps 200
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from bertforge.training.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `tests.support` (helpers shared with the tests, never installed) from this checkout; bertforge
# is the installed package (benchmarks/README.md).
sys.path.insert(0, REPO)


def run_layout(data: str, node_cpus: list[int], steps: int, batch_size: int) -> float:
    """Steps/s after the first logged step (start-up and first-step compilation excluded)."""
    from tests.support.local_cluster import LocalRayCluster

    run_dir = tempfile.mkdtemp(prefix="bf_multinode_")
    with LocalRayCluster(multi_node=True) as cluster:
        cluster.start_head(node_cpus[0])
        for cpus in node_cpus[1:]:
            cluster.add_node(cpus)
        command = [
            sys.executable, "-m", "bertforge.cluster.cli", "submit",
            "--address", cluster.dashboard_url,
            "--working-dir", REPO, "--", "python", "-m", "bertforge.cluster.cli", "train",
            "--address", "auto", "--data", data, "--run-dir", run_dir, "--steps", str(steps),
            "--workers", "2", "--batch-size", str(batch_size), "--resume", "never",
        ]
        env = {**os.environ, "RAY_AUTH_MODE": "token"}  # nodes run with the cluster token
        subprocess.run(command, env=env, cwd=REPO, check=True, capture_output=True, text=True)
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    first, last = records[0], records[-1]
    return (last["step"] - first["step"]) / (last["time"] - first["time"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a prepared shard directory")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    args = parser.parse_args()
    one_node = run_layout(args.data, [2], args.steps, args.batch_size)
    two_nodes = run_layout(args.data, [1, 1], args.steps, args.batch_size)
    print(f"{'layout':<32} {'steps/s':>8} {'ratio':>6}")
    print(f"{'1 node x 2 workers':<32} {one_node:>8.2f} {1.0:>6.2f}")
    print(f"{'2 nodes x 1 worker':<32} {two_nodes:>8.2f} {two_nodes / one_node:>6.2f}")


if __name__ == "__main__":
    main()
