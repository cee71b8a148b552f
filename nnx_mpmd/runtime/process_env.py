"""The environment variables that tell a launched process where it stands in a run.

`nnx-mpmd launch` sets them for every process it starts and
`nnx_mpmd.distributed.initialize` reads them. This module imports neither JAX
nor the rest of the package: the launcher, which only starts processes, loads
it without paying for JAX's import (about two CPU seconds per launch).

Example:
    >>> from nnx_mpmd.runtime.process_env import ENV_NUM_PROCESSES, launch_env
    >>> env = launch_env(1, 2, "127.0.0.1:1234", devices_per_process=4)
    >>> env[ENV_NUM_PROCESSES], env["NNX_MPMD_PROCESS_ID"], env["NNX_MPMD_COORDINATOR_BIND"]
    ('2', '1', '127.0.0.1:1234')
"""

from __future__ import annotations

import os

__all__ = [
    "ENV_COORDINATOR",
    "ENV_COORDINATOR_BIND",
    "ENV_DEVICES_PER_PROCESS",
    "ENV_HEARTBEAT",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "coordinator_bind_address",
    "launch_env",
]

ENV_PROCESS_ID = "NNX_MPMD_PROCESS_ID"
ENV_NUM_PROCESSES = "NNX_MPMD_NUM_PROCESSES"
ENV_COORDINATOR = "NNX_MPMD_COORDINATOR"
ENV_COORDINATOR_BIND = "NNX_MPMD_COORDINATOR_BIND"
ENV_DEVICES_PER_PROCESS = "NNX_MPMD_DEVICES_PER_PROCESS"
ENV_HEARTBEAT = "NNX_MPMD_HEARTBEAT_S"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def coordinator_bind_address(coordinator: str, configured: str | None = None) -> str | None:
    """The address the coordination service should listen on, or None for jax's default.

    A loopback coordinator listens on loopback only; ``configured`` (``NNX_MPMD_COORDINATOR_BIND``)
    wins when set.

    Args:
      coordinator: the ``host:port`` the processes connect to.
      configured: an address the user chose, if any.

    Returns:
      The bind address, or None to let jax listen on every interface.

    Example:
      >>> coordinator_bind_address("127.0.0.1:9876")
      '127.0.0.1:9876'
      >>> coordinator_bind_address("10.0.0.5:9876") is None
      True
    """
    if configured:
        return configured
    host, _, port = coordinator.rpartition(":")
    if host.strip("[]") in _LOOPBACK_HOSTS and port:
        return coordinator  # listen exactly where the processes connect
    return None


def launch_env(
    process_id: int,
    num_processes: int,
    coordinator: str,
    *,
    devices_per_process: int | None = None,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment `nnx-mpmd launch` gives process ``process_id`` (a new dict).

    ``devices_per_process`` sets ``XLA_FLAGS``; a loopback coordinator also gets
    ``NNX_MPMD_COORDINATOR_BIND`` (`coordinator_bind_address`).

    Args:
      process_id: this process's index, 0 to ``num_processes - 1``.
      num_processes: how many processes the run has.
      coordinator: process 0's ``host:port``.
      devices_per_process: simulated CPU devices per process (None: XLA_FLAGS as it is).
      base: the environment to start from (default: this process's).

    Returns:
      The whole environment of the started process.

    Example:
      >>> env = launch_env(0, 2, "127.0.0.1:9", devices_per_process=4, base={})
      >>> env["XLA_FLAGS"], env["NNX_MPMD_COORDINATOR"], env["NNX_MPMD_COORDINATOR_BIND"]
      ('--xla_force_host_platform_device_count=4', '127.0.0.1:9', '127.0.0.1:9')
    """
    env = dict(os.environ if base is None else base)
    env[ENV_PROCESS_ID] = str(process_id)
    env[ENV_NUM_PROCESSES] = str(num_processes)
    env[ENV_COORDINATOR] = coordinator
    bind = coordinator_bind_address(coordinator)
    if bind is not None:
        env[ENV_COORDINATOR_BIND] = bind
    else:
        env.pop(ENV_COORDINATOR_BIND, None)
    if devices_per_process is not None:
        env[ENV_DEVICES_PER_PROCESS] = str(devices_per_process)
        flags = [
            f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)
        ]
        env["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={devices_per_process}"])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
