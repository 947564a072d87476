"""The one writer of a checkpoint directory: one step at a time, in the background if asked.

Our own thread rather than Orbax's async mode, which starts its threads per
save in the caller's thread and so blocks the training loop longer.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import flags, logging

from haiku_state.checkpoint import encoding, items, retention


class Writer:
    """Writes encoded steps through an Orbax manager, one at a time.

    Args:
      manager: the Orbax manager of the directory.
      retention: told which step is being written, so Orbax keeps it.
      async_save: write in a background thread, so `write` returns at once.
    """

    def __init__(
        self,
        manager: ocp.CheckpointManager,
        retention_policy: retention.Retention,
        *,
        async_save: bool,
    ):
        self._manager = manager
        self._retention = retention_policy
        self._thread = _writer_thread(async_save)
        self._in_flight: concurrent.futures.Future | None = None

    def write(self, encoded: encoding.Encoded, metadata: dict[str, Any]) -> None:
        """Writes one step, after the write in flight (if any) is on disk."""
        self.wait()
        if self._thread is None:
            self._write(encoded, metadata)
        else:
            self._in_flight = self._thread.submit(self._write, encoded, metadata)

    def wait(self) -> None:
        """Blocks until the write in flight (if any) is on disk; raises its error if any."""
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            in_flight.result()

    def close(self) -> None:
        """Waits for the write in flight, then stops the thread."""
        try:
            self.wait()
        finally:
            if self._thread is not None:
                self._thread.shutdown()

    def _write(self, encoded: encoding.Encoded, metadata: dict[str, Any]) -> None:
        self._retention.saving_step = encoded.step
        try:
            args = items.save_args(encoded, metadata)
            self._manager.save(encoded.step, args=args, force=True)
            self._manager.wait_until_finished()
        finally:
            self._retention.saving_step = None


def _writer_thread(async_save: bool) -> concurrent.futures.ThreadPoolExecutor | None:
    """The one thread writes run in, or None to write synchronously."""
    if not async_save:
        return None
    if jax.process_count() > 1 and not _use_client_barriers():
        logging.warning(
            "Multi-process run without parsed absl flags: Orbax's barriers would be "
            "device collectives, which must not run in a background thread. Checkpoints "
            "are written synchronously; run under absl.app to write them asynchronously."
        )
        return None
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint_writer")


def _use_client_barriers() -> bool:
    """Makes Orbax synchronise processes through the `jax.distributed` client.

    Orbax's default barrier is a device collective. Called from the writer thread
    while the main thread dispatches training steps, it could interleave with the
    step's collectives in a different order on each process and deadlock; the
    client's barriers are safe from any thread. Orbax reads the choice from an
    absl flag, so it takes effect only once flags are parsed (as under `app.run`).

    Returns:
      Whether Orbax will use the client's barriers.
    """
    try:
        flags.FLAGS.experimental_orbax_use_distributed_barrier = True
        return bool(flags.FLAGS.experimental_orbax_use_distributed_barrier)
    except flags.UnparsedFlagAccessError:
        return False
