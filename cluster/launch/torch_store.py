"""Ray Train's torch process group, with its rendezvous store bound to the node's address only.

torch.distributed's TCPStore server listens on every interface (`*:PORT`) whatever MASTER_ADDR
says. Here worker 0 binds the listening socket itself, to the address Ray gives its node
(127.0.0.1 on a local run, the node's own IP on a cluster), and hands it to a multi-tenant
TCPStore server; the process group's own store on the same port then reuses that server
(torch keeps one multi-tenant server per port and process). Everything else is Ray Train's
own set-up (`ray.train.torch.config`), called in the same order.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import ray
from ray.train.torch import TorchConfig
from ray.train.torch.config import (
    _set_torch_distributed_env_vars,
    _setup_torch_process_group,
    _TorchBackend,
)

# Worker 0's store server: it must outlive the process group that uses it.
_SERVER = None


def _host_store(world_size: int, timeout_s: int) -> tuple[str, int]:
    """On worker 0: a TCPStore server listening on this node's address only."""
    import torch.distributed as dist

    global _SERVER
    address = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((address, 0))
    listener.listen(1024)
    port = listener.getsockname()[1]
    _SERVER = dist.TCPStore(address, port, world_size, is_master=True,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            wait_for_workers=False, multi_tenant=True,
                            master_listen_fd=listener.detach())
    return address, port


def _point_at_store(address: str, port: int) -> None:
    import os

    os.environ["MASTER_ADDR"] = address
    os.environ["MASTER_PORT"] = str(port)


class _NodeAddressTorchBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config) -> None:
        if backend_config.backend not in ("gloo", "nccl") or backend_config.init_method != "env":
            super().on_start(worker_group, backend_config)
            return
        world_size = len(worker_group)
        address, port = worker_group.execute_single(0, _host_store, world_size,
                                                    backend_config.timeout_s)
        worker_group.execute(_point_at_store, address=address, port=port)
        worker_group.execute(_set_torch_distributed_env_vars)
        ray.get([
            worker_group.execute_single_async(
                rank, _setup_torch_process_group, backend=backend_config.backend,
                world_rank=rank, world_size=world_size, init_method="env://",
                timeout_s=backend_config.timeout_s)
            for rank in range(world_size)
        ])


@dataclass
class NodeAddressTorchConfig(TorchConfig):
    """TorchConfig whose rendezvous store listens on the node's address, not on `*`."""

    @property
    def backend_cls(self):
        return _NodeAddressTorchBackend
