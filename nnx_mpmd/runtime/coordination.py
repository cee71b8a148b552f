"""The coordination service of a ``jax.distributed`` run: liveness, barriers, small values.

Arrays move between processes with ``jax.device_put`` (see
`nnx_mpmd.runtime.cross_process`); what is left here uses the key-value store
and liveness queries of the coordination service that ``jax.distributed``
starts on process 0:

* `Coordination.check_peers` turns a dead peer into a `DistributedError`
  naming it (every wait of the runtime polls it, so nothing hangs);
* `Coordination.barrier`, `publish_array` / `fetch_array` (the collective
  ``gather`` of small state) and `delete`;
* an exit hook that makes the processes leave in order (see `Coordination`);
* `bounded_by_peers`, for waits that cannot poll the peers themselves (orbax's
  barriers during a checkpoint save or restore, device collectives).

Example:
    >>> peer_timeout_s() > 0
    True
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from nnx_mpmd._jax_compat import coordination_state
from nnx_mpmd.errors import DistributedError, MpmdError

__all__ = [
    "Coordination",
    "bounded_by_peers",
    "distributed_client",
    "get_coordination",
    "peer_timeout_s",
    "transfer_address",
]

_KEY_PREFIX = "nnx_mpmd"
ENV_TIMEOUT = "NNX_MPMD_PEER_TIMEOUT"
ENV_TRANSFER_ADDRESS = "NNX_MPMD_TRANSFER_ADDRESS"
ENV_HEARTBEAT = "NNX_MPMD_HEARTBEAT_S"
_POLL_S = 0.02
_LIVENESS_EVERY_S = 0.5


def peer_timeout_s() -> float:
    """Seconds a process waits for a peer before giving up (``NNX_MPMD_PEER_TIMEOUT``, default 300).

    Example:
      >>> peer_timeout_s() > 0
      True
    """
    return float(os.environ.get(ENV_TIMEOUT, "300"))


def distributed_client() -> Any:
    """This process's ``jax.distributed`` coordination client (key-value store, liveness queries).

    Raises:
      DistributedError: ``jax.distributed.initialize`` was not called.

    Example:
      >>> try:
      ...     distributed_client()
      ... except DistributedError as e:
      ...     print("initialize" in str(e))
      True
    """
    client, _ = coordination_state()
    if client is None:
        raise DistributedError(
            "this process is not part of a jax.distributed run (no coordination client); call "
            "nnx_mpmd.distributed.initialize() or "
            "jax.distributed.initialize(...) before creating arrays."
        )
    return client


def transfer_address(coordinator: str | None) -> str:
    """``ip:0``: this host's address the peers can reach, for JAX's cross-host transfers on CPU.

    The interface that reaches ``coordinator`` (``host:port``), or ``NNX_MPMD_TRANSFER_ADDRESS``.

    Example:
      >>> transfer_address("127.0.0.1:1234")
      '127.0.0.1:0'
    """
    configured = os.environ.get(ENV_TRANSFER_ADDRESS)
    if configured:
        return configured
    host = (coordinator or "127.0.0.1").rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1:0"
    try:
        # Connecting a UDP socket sends nothing; it only picks the outgoing interface.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 1))
            return f"{probe.getsockname()[0]}:0"
    except OSError:
        return f"{socket.gethostbyname(socket.gethostname())}:0"


_EXIT_WAIT_S = 10.0


class Coordination:
    """This process's view of the coordination service: liveness, barriers, small values.

    Created once per process (`get_coordination`). Liveness is a heartbeat in
    the key-value store: a daemon thread bumps ``nnx_mpmd/alive/<process>``
    every ``heartbeat_s / 5`` seconds, and a peer whose counter has not moved
    for ``heartbeat_s`` counts as dead. (The service's own ``get_live_nodes``
    is a barrier: every process would have to call it equally often, which
    processes that wait for different things do not.) Its exit hook makes the
    processes leave in order: every process waits at a barrier (bounded), then
    the others disconnect and process 0, which hosts the service, waits until
    it no longer sees them.

    Args:
      client: the ``jax.distributed`` coordination client.
      process_id: this process's index.
      num_processes: how many processes the run has.
      coordinator: the coordinator address.
      heartbeat_s: seconds without a heartbeat after which a peer counts as dead
        (default ``NNX_MPMD_HEARTBEAT_S`` or 10).
      start: start the heartbeat thread and the exit hook (False: only read
        the peers' heartbeats, for tests).

    Example:
      >>> Coordination.__name__  # needs a jax.distributed run; see get_coordination()
      'Coordination'
    """

    def __init__(
        self,
        client: Any,
        process_id: int,
        num_processes: int,
        coordinator: str | None = None,
        heartbeat_s: float | None = None,
        *,
        start: bool = True,
    ) -> None:
        self.client = client
        self.process_id = process_id
        self.num_processes = num_processes
        self.coordinator = coordinator
        self.heartbeat_s = heartbeat_s or float(os.environ.get(ENV_HEARTBEAT, "10"))
        self._last_liveness = 0.0
        self._seen: dict[int, tuple[Any, float]] = {}  # peer -> (last counter, when it moved)
        self._stop = threading.Event()
        if start:
            self._beat(0)
            period = max(0.1, self.heartbeat_s / 5)
            threading.Thread(target=self._beating, args=(period,), daemon=True).start()
            atexit.register(self._drain_at_exit)

    def _beat(self, count: int) -> None:
        self.client.key_value_set(
            f"{_KEY_PREFIX}/alive/{self.process_id}", str(count), allow_overwrite=True
        )

    def _beating(self, period: float) -> None:
        count = 0
        while not self._stop.wait(period):
            count += 1
            try:
                self._beat(count)
            except Exception:  # the service is gone: the peers will notice
                return

    def _drain_at_exit(self) -> None:
        # Nobody leaves while a peer may still read what it sent (a transfer, a
        # gathered value); a dead peer makes the barrier fail, which is fine at exit.
        with contextlib.suppress(Exception):
            self.barrier("exit", "exiting", timeout_s=min(peer_timeout_s(), 60.0))
        self._stop.set()
        # With recoverability on, jax skips its shutdown barrier: if process 0 (which
        # hosts the coordination service) left first, the others would abort while
        # disconnecting. So the others disconnect now, and process 0 waits (bounded)
        # until it no longer sees them before its own shutdown runs.
        if self.process_id != 0:
            with contextlib.suppress(Exception):
                jax.distributed.shutdown()
            return
        deadline = time.monotonic() + _EXIT_WAIT_S
        with contextlib.suppress(Exception):
            while time.monotonic() < deadline:
                live = self.client.get_live_nodes(list(range(self.num_processes)))
                if len(live) <= 1:
                    break
                time.sleep(0.05)

    # ------------------------------------------------------------------ liveness

    def dead_peers(self) -> list[int]:
        """Sorted peers whose heartbeat has not moved for ``heartbeat_s`` seconds.

        Raises:
          DistributedError: the coordination service itself is gone (process 0 died).
        """
        now = time.monotonic()
        dead = []
        for peer in range(self.num_processes):
            if peer == self.process_id:
                continue
            try:
                count = self.client.key_value_try_get(f"{_KEY_PREFIX}/alive/{peer}")
            except Exception as e:
                if "NOT_FOUND" not in str(e).upper():  # the coordinator itself is gone
                    raise DistributedError(
                        f"process {self.process_id} lost the coordination service (process 0): "
                        f"{e}. Process 0 probably died; see its log, then restart the job."
                    ) from None
                count = None
            seen = self._seen.get(peer)
            if seen is None or seen[0] != count:
                self._seen[peer] = (count, now)
            elif now - seen[1] > self.heartbeat_s:
                dead.append(peer)
        return dead

    def check_peers(self, where: str, *, force: bool = False) -> None:
        """Raises `DistributedError` if a peer died (rate-limited unless ``force``)."""
        now = time.monotonic()
        if not force and now - self._last_liveness < _LIVENESS_EVERY_S:
            return
        self._last_liveness = now
        dead = self.dead_peers()
        if dead:
            who = f"process {dead[0]}" if len(dead) == 1 else f"processes {dead}"
            raise DistributedError(
                f"{who} died while process {self.process_id} was {where}; the run cannot "
                "continue. Check the dead process's log, then restart every process (resume "
                "from the last checkpoint)."
            )

    def call_watching_peers(self, where: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, given up with a `DistributedError` as soon as a peer dies.

        ``fn`` runs in a daemon thread (left blocked if abandoned) while this one checks heartbeats.

        Raises:
          DistributedError: a peer died (or the coordination service went away)
            before ``fn`` returned, or ``fn`` failed (not with an `MpmdError`)
            and a peer turns out dead within ``heartbeat_s``.
        """
        outcome: dict[str, Any] = {}
        finished = threading.Event()

        def call() -> None:
            try:
                outcome["value"] = fn(*args)
            except BaseException as error:  # handed to the waiting thread as is
                outcome["error"] = error
            finally:
                finished.set()

        threading.Thread(target=call, name=f"nnx_mpmd: {where}", daemon=True).start()
        while not finished.wait(_LIVENESS_EVERY_S / 2):
            self.check_peers(where)
        error = outcome.get("error")
        if error is None:
            return outcome["value"]
        if not isinstance(error, (MpmdError, KeyboardInterrupt)):
            # A barrier or transfer that failed (cancelled, reset) because a peer died.
            self.blame_peers(where)
        raise error

    def blame_peers(self, where: str) -> None:
        """After a failure a dying peer may explain: raises naming it if one died.

        Waits up to ``heartbeat_s`` plus a second for a stale heartbeat, so the error names
        the dead process rather than the failed transfer.
        """
        deadline = time.monotonic() + self.heartbeat_s + 1.0
        while True:
            self.check_peers(where, force=True)
            if time.monotonic() > deadline:
                return
            time.sleep(_LIVENESS_EVERY_S / 2)

    # ------------------------------------------------------------------ key-value

    def publish(self, key: str, value: Any) -> None:
        """Stores a JSON-able ``value`` under ``key`` for the peers."""
        self.client.key_value_set(f"{_KEY_PREFIX}/{key}", json.dumps(value), allow_overwrite=True)

    def fetch(self, key: str, peer: int, where: str, timeout_s: float | None = None) -> Any:
        """The JSON value ``peer`` published under ``key``; `DistributedError` if dead or late."""
        get = self.client.blocking_key_value_get
        raw = self._wait_for_key(key, peer, where, get, timeout_s)
        return json.loads(raw)

    def _wait_for_key(
        self, key: str, peer: int, where: str, get: Any, timeout_s: float | None = None
    ) -> Any:
        """Polls ``get(key)`` until the peer published it, checking peer liveness."""
        timeout = peer_timeout_s() if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        full = f"{_KEY_PREFIX}/{key}"
        while True:
            try:
                return get(full, 500)
            except Exception as e:
                if "DEADLINE_EXCEEDED" not in str(e) and "deadline" not in str(e).lower():
                    raise DistributedError(
                        f"process {self.process_id} could not read {full!r} from process {peer} "
                        f"while {where}: {e}"
                    ) from None
            self.check_peers(where, force=True)
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"process {peer} did not publish {full!r} within {timeout:.0f} s "
                    f"while process {self.process_id} was {where}. All processes must run the "
                    f"same steps in the same order; raise {ENV_TIMEOUT} if the peer is just slow."
                )

    def barrier(self, name: str, where: str, timeout_s: float | None = None) -> None:
        """Waits until every process reached barrier ``name`` (unique ids).

        Raises:
          DistributedError: a peer died or did not arrive in time.
        """
        timeout = peer_timeout_s() if timeout_s is None else timeout_s
        wait = self.client.wait_at_barrier
        try:
            self.call_watching_peers(where, wait, f"{_KEY_PREFIX}/{name}", int(timeout * 1000))
        except DistributedError:
            raise
        except Exception as e:
            self.check_peers(where, force=True)
            raise DistributedError(
                f"process {self.process_id} waited {timeout:.0f} s at barrier {name!r} while "
                f"{where}, but not every process arrived: {e}. All processes must make the same "
                "calls in the same order."
            ) from None

    def delete(self, key: str) -> None:
        """Removes what `publish` or `publish_array` stored under ``key`` (if anything)."""
        with contextlib.suppress(Exception):  # already gone: nothing to free
            self.client.key_value_delete(f"{_KEY_PREFIX}/{key}")

    def publish_array(self, key: str, value: np.ndarray) -> None:
        """Stores a host array's bytes under ``key`` (small state, not activations)."""
        data = np.ascontiguousarray(value).tobytes()
        self.client.key_value_set_bytes(f"{_KEY_PREFIX}/{key}", data, allow_overwrite=True)

    def fetch_array(self, key: str, peer: int, shape: Any, dtype: Any, where: str) -> np.ndarray:
        """Waits for the array a peer stored with `publish_array`."""
        get = self.client.blocking_key_value_get_bytes
        data = self._wait_for_key(key, peer, where, get)
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)


_COORDINATION: Coordination | None = None


def get_coordination() -> Coordination:
    """This process's `Coordination`, created on first use (with its exit hook).

    Raises:
      DistributedError: ``jax.distributed`` is not initialized.

    Example:
      >>> try:
      ...     get_coordination()
      ... except DistributedError:
      ...     print("single process")
      single process
    """
    global _COORDINATION
    if _COORDINATION is None:
        client = distributed_client()
        _, coordinator_address = coordination_state()
        _COORDINATION = Coordination(
            client, jax.process_index(), jax.process_count(), coordinator_address
        )
    return _COORDINATION


def bounded_by_peers(where: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; in a multi-process run, a `DistributedError` as soon as a peer dies.

    Orbax's barriers and collectives never ask whether a peer lives; this names a dead one.

    Example:
      >>> bounded_by_peers("adding", lambda a, b: a + b, 1, 2)
      3
    """
    if jax.process_count() == 1:
        return fn(*args)
    return get_coordination().call_watching_peers(where, fn, *args)
