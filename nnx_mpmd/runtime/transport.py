"""Point-to-point array transport between processes of a ``jax.distributed`` run.

Arrays move with ``jax.experimental.transfer``: every process runs one transfer
server; the sender offers arrays under a numeric id (``await_pull``, which
returns at once) and the receiver pulls them onto its own devices with the
sharding it asks for (``connect(address).pull``, asynchronous too). Because
neither side blocks when it dispatches, any order of sends and receives is
deadlock free: the receiver only waits when it reads the result.

Small facts (server addresses, the shape/dtype/spec of a value a peer is about
to send) travel through the key-value store of the ``jax.distributed``
coordination service. Every wait polls the liveness of the peers, so a dead
peer turns into a `DistributedError` instead of a hang.

Example:
    >>> from nnx_mpmd.runtime.transport import encode_spec, decode_spec
    >>> from jax.sharding import PartitionSpec as P
    >>> decode_spec(encode_spec(P("data", None, ("a", "b"))))
    P('data', None, ('a', 'b'))
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from nnx_mpmd._jax_compat import coordination_state
from nnx_mpmd.errors import DistributedError

__all__ = [
    "Transport",
    "decode_spec",
    "distributed_client",
    "encode_spec",
    "get_transport",
    "peer_timeout_s",
]

_KEY_PREFIX = "nnx_mpmd"
ENV_TIMEOUT = "NNX_MPMD_PEER_TIMEOUT"
ENV_TRANSFER_ADDRESS = "NNX_MPMD_TRANSFER_ADDRESS"
_POLL_S = 0.02
_LIVENESS_EVERY_S = 0.5


def peer_timeout_s() -> float:
    """How long a process waits for a peer before giving up (``NNX_MPMD_PEER_TIMEOUT``).

    Returns:
      Seconds (default 300).

    Example:
      >>> peer_timeout_s() > 0
      True
    """
    return float(os.environ.get(ENV_TIMEOUT, "300"))


def distributed_client() -> Any:
    """The ``jax.distributed`` coordination client of this process.

    Returns:
      The client object (with its key-value store and liveness queries).

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


def encode_spec(spec: PartitionSpec) -> list[Any]:
    """A JSON-able form of a PartitionSpec.

    Args:
      spec: the PartitionSpec.

    Returns:
      A list with None, axis names, or lists of axis names.

    Example:
      >>> encode_spec(PartitionSpec(None, "data"))
      [None, 'data']
    """
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def decode_spec(entries: Sequence[Any]) -> PartitionSpec:
    """The inverse of `encode_spec`.

    Args:
      entries: the list `encode_spec` returned.

    Returns:
      The PartitionSpec.

    Example:
      >>> decode_spec([None, ["a", "b"]])
      P(None, ('a', 'b'))
    """
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))


def _local_address(coordinator: str | None) -> str:
    """An address of this host that the peers can reach (port 0: any free port)."""
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


class Transport:
    """One process's transfer server, peer connections and liveness checks.

    Args:
      client: the ``jax.distributed`` coordination client.
      process_id: this process's index.
      num_processes: how many processes the run has.
      coordinator: the coordinator address (picks the interface to listen on).

    Example:
      >>> Transport.__name__  # needs a jax.distributed run; see get_transport()
      'Transport'
    """

    def __init__(
        self, client: Any, process_id: int, num_processes: int, coordinator: str | None = None
    ) -> None:
        from jax.experimental import transfer

        self.client = client
        self.process_id = process_id
        self.num_processes = num_processes
        backend = jax.local_devices()[0].client
        address = _local_address(coordinator)
        self.server = transfer.start_transfer_server(backend, address, [address])
        self._connections: dict[int, Any] = {}
        self._last_liveness = 0.0
        self.publish(f"transfer_address/{process_id}", self.server.address())
        atexit.register(self._drain_at_exit)

    def _drain_at_exit(self) -> None:
        # A sender must not leave while a peer still pulls what it offered; a dead
        # peer makes the barrier fail, which is fine at exit.
        with contextlib.suppress(Exception):
            self.barrier("exit", "exiting", timeout_s=min(peer_timeout_s(), 60.0))
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
                if len(self.dead_peers()) == self.num_processes - 1:
                    break
                time.sleep(0.05)

    # ------------------------------------------------------------------ liveness

    def dead_peers(self) -> list[int]:
        """The processes the coordination service no longer sees alive.

        Returns:
          Sorted process indices (empty when every process is alive).
        """
        try:
            live = self.client.get_live_nodes(list(range(self.num_processes)))
        except Exception as e:  # the coordinator itself is gone
            if self.process_id == 0:
                raise
            raise DistributedError(
                f"process {self.process_id} lost the coordination service (process 0): {e}. "
                "Process 0 probably died; see its log, then restart the job."
            ) from None
        return sorted(set(range(self.num_processes)) - set(int(p) for p in live))

    def check_peers(self, where: str, *, force: bool = False) -> None:
        """Raises `DistributedError` if a peer died (rate-limited unless ``force``).

        Args:
          where: what this process was doing, for the message.
          force: query now even if the last query was recent.
        """
        now = time.monotonic()
        if not force and now - self._last_liveness < _LIVENESS_EVERY_S:
            return
        self._last_liveness = now
        dead = self.dead_peers()
        if dead:
            raise DistributedError(
                f"process(es) {dead} died while process {self.process_id} was {where}; the run "
                "cannot continue. Check the dead process's log, then restart every process "
                "(resume from the last checkpoint)."
            )

    # ------------------------------------------------------------------ key-value

    def publish(self, key: str, value: Any) -> None:
        """Stores a JSON-able ``value`` under ``key`` for the peers."""
        self.client.key_value_set(f"{_KEY_PREFIX}/{key}", json.dumps(value), allow_overwrite=True)

    def fetch(self, key: str, peer: int, where: str) -> Any:
        """Waits for the value a peer published under ``key``.

        Args:
          key: the key `publish` used.
          peer: the process expected to publish it (named in errors).
          where: what this process was doing, for the message.

        Returns:
          The JSON value.

        Raises:
          DistributedError: the peer died, or nothing arrived within `peer_timeout_s`.
        """
        raw = self._wait_for_key(key, peer, where, self.client.blocking_key_value_get)
        return json.loads(raw)

    def _wait_for_key(self, key: str, peer: int, where: str, get: Any) -> Any:
        """Polls ``get(key)`` until the peer published it, checking peer liveness."""
        deadline = time.monotonic() + peer_timeout_s()
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
                    f"process {peer} did not publish {full!r} within {peer_timeout_s():.0f} s "
                    f"while process {self.process_id} was {where}. All processes must run the "
                    f"same steps in the same order; raise {ENV_TIMEOUT} if the peer is just slow."
                )

    def barrier(self, name: str, where: str, timeout_s: float | None = None) -> None:
        """Waits until every process reached barrier ``name`` (ids must be unique).

        Args:
          name: the barrier id, the same on every process.
          where: what this process was doing, for the message.
          timeout_s: how long to wait (default `peer_timeout_s`).

        Raises:
          DistributedError: a peer died or did not arrive in time.
        """
        timeout = peer_timeout_s() if timeout_s is None else timeout_s
        try:
            self.client.wait_at_barrier(f"{_KEY_PREFIX}/{name}", int(timeout * 1000))
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

    # ------------------------------------------------------------------ arrays

    def connection(self, peer: int) -> Any:
        """The (cached) connection to ``peer``'s transfer server."""
        conn = self._connections.get(peer)
        if conn is None:
            address = self.fetch(f"transfer_address/{peer}", peer, "connecting")
            conn = self._connections[peer] = self.server.connect(address)
        return conn

    def send(self, uuid: int, arrays: Sequence[jax.Array]) -> None:
        """Offers ``arrays`` to whichever peer pulls ``uuid`` (returns at once)."""
        self.server.await_pull(uuid, list(arrays))

    def receive(
        self, uuid: int, peer: int, avals: Sequence[jax.ShapeDtypeStruct]
    ) -> list[jax.Array]:
        """Pulls the arrays ``peer`` offered under ``uuid`` (asynchronous).

        Args:
          uuid: the id the sender used.
          peer: the sending process.
          avals: shape, dtype and local sharding of each array.

        Returns:
          The arrays (ready once the bytes arrived; an error when the peer died).
        """
        timeout = datetime.datetime.now() + datetime.timedelta(seconds=peer_timeout_s())
        return list(self.connection(peer).pull(uuid, list(avals), timeout=timeout))


def aval_of(meta: Sequence[Any], sharding_mesh: Any) -> jax.ShapeDtypeStruct:
    """The ShapeDtypeStruct for a ``[shape, dtype, spec]`` record on ``sharding_mesh``.

    Args:
      meta: ``[shape, dtype name, encoded spec]``.
      sharding_mesh: the jax Mesh the array goes to.

    Returns:
      A ShapeDtypeStruct with a NamedSharding.

    Example:
      >>> import jax
      >>> aval_of([[2], "float32", []], jax.make_mesh((1,), ("x",))).shape
      (2,)
    """
    shape, dtype, spec = meta
    sharding = NamedSharding(sharding_mesh, decode_spec(spec))
    return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)


def meta_of(x: jax.Array) -> list[Any]:
    """``[shape, dtype name, encoded spec]`` of an array (see `aval_of`).

    Args:
      x: a jax.Array with a NamedSharding (or any sharding: its spec is then P()).

    Returns:
      A JSON-able record.

    Example:
      >>> import jax.numpy as jnp
      >>> meta_of(jnp.ones((2, 3)))
      [[2, 3], 'float32', []]
    """
    sharding = getattr(x, "sharding", None)
    spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
    return [list(x.shape), np.dtype(x.dtype).name, encode_spec(spec)]


_TRANSPORT: Transport | None = None


def get_transport() -> Transport:
    """This process's `Transport`, started on first use.

    Returns:
      The transport.

    Raises:
      DistributedError: ``jax.distributed`` is not initialized.

    Example:
      >>> try:
      ...     get_transport()
      ... except DistributedError:
      ...     print("single process")
      single process
    """
    global _TRANSPORT
    if _TRANSPORT is None:
        client = distributed_client()
        _, coordinator_address = coordination_state()
        _TRANSPORT = Transport(
            client, jax.process_index(), jax.process_count(), coordinator_address
        )
    return _TRANSPORT
