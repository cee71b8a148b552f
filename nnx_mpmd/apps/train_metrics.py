"""What ``nnx-mpmd train`` reports besides the loss: evaluation, throughput, MFU, TensorBoard.

**Model FLOPs utilization** (MFU) is the share of the devices' peak the
model's arithmetic uses: ``flops_per_token × tokens/s ÷ (devices × peak FLOP/s
per device)``. The FLOPs per token follow the usual estimate for a
decoder-only transformer (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022,
appendix B) of one training step, forward and backward:

    flops_per_token = 6·N + 12·L·d·T

with ``N`` the parameters that take part in matrix products (all parameters
but the embedding tables, which are looked up; plus the head's ``vocab × d``
when it reuses the token table), ``L`` the blocks, ``d`` the model width and
``T`` the sequence length. The second term is the attention's scores and
weighted sum, counted in full (masked entries too). Recomputation (remat) is
not counted: it is not model arithmetic.

The peak is the device's dense bfloat16 matrix throughput from a small table
(`PEAK_TFLOPS`, matched against ``jax.Device.device_kind``), or
``--peak-tflops X`` per device. Without either (a CPU, an unlisted device)
the ``mfu`` of each record is null and the run says so once.

This module imports no JAX at the top: `check_reporting_flags` runs before the
simulated CPU device count is set.

Example:
    >>> flops_per_token(matmul_params=1000, n_layers=2, d_model=8, seq_len=16)
    9072.0
    >>> peak_flops_per_device("NVIDIA H100 80GB HBM3")
    989000000000000.0
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import pathlib
from collections.abc import Mapping
from typing import Any

from nnx_mpmd.errors import MpmdError

__all__ = [
    "PEAK_TFLOPS",
    "TENSORBOARD_INSTALL",
    "TENSORBOARD_TAGS",
    "TensorBoardLog",
    "TrainReporting",
    "add_reporting_arguments",
    "check_reporting_flags",
    "flops_per_token",
    "matmul_params",
    "mfu",
    "peak_flops_per_device",
    "perplexity",
    "tensorboard_scalars",
]

#: Dense bfloat16 peak TFLOP/s per device, by a substring of ``device_kind`` (the
#: longest match wins). Vendors' data sheets (GPUs: SXM parts, without sparsity).
PEAK_TFLOPS: dict[str, float] = {
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H200": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0,
    "V100": 125.0,
    "TPU v2": 45.0,
    "TPU v3": 123.0,
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,
    "TPU v5e": 197.0,
    "TPU v5p": 459.0,
    "TPU v5": 459.0,
    "TPU v6 lite": 918.0,
    "TPU v6e": 918.0,
}

TENSORBOARD_INSTALL = "pip install 'nnx-mpmd[tensorboard]'"


def check_reporting_flags(cfg: Any) -> None:
    """Refuses out-of-range ``--eval-every``, ``--eval-batches``, ``--peak-tflops``, and
    ``--tensorboard`` without tensorboardX; before anything is written.

    Raises:
      MpmdError: naming the option and the fix.

    Example:
      >>> import argparse
      >>> check_reporting_flags(argparse.Namespace(
      ...     eval_every=0, eval_batches=0, peak_tflops=None, tensorboard=False))
      Traceback (most recent call last):
      ...
      nnx_mpmd.errors.MpmdError: --eval-batches=0 must be >= 1.
    """
    if cfg.eval_every < 0:
        raise MpmdError(f"--eval-every={cfg.eval_every} must be >= 0 (0: no evaluation).")
    if cfg.eval_batches < 1:
        raise MpmdError(f"--eval-batches={cfg.eval_batches} must be >= 1.")
    if cfg.peak_tflops is not None and not 0 < cfg.peak_tflops < math.inf:
        raise MpmdError(
            f"--peak-tflops={cfg.peak_tflops} must be a number > 0: one device's peak "
            "TFLOP/s, e.g. 989 for an H100."
        )
    if cfg.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise MpmdError(
            f"--tensorboard needs tensorboardX, which is not installed; {TENSORBOARD_INSTALL}, "
            "or drop --tensorboard."
        )


def matmul_params(model: Any) -> int:
    """The parameters of ``model`` that take part in matrix products (``N`` above).

    All parameters, less the embedding tables (`nnx_mpmd.models.layers.Embedding`),
    plus the tied head's table (``attend``) when the model has one.

    Example:
      >>> from flax import nnx
      >>> from nnx_mpmd.models import build_model
      >>> model = build_model("gpt", "tiny", num_stages=1, rngs=nnx.Rngs(0))
      >>> matmul_params(model)
      216448
    """
    from flax import nnx

    from nnx_mpmd.models import count_params
    from nnx_mpmd.models.layers import Embedding

    tables = {
        id(node): math.prod(node.table.shape)
        for _, node in nnx.iter_graph(model)
        if isinstance(node, Embedding)
    }
    config: Any = getattr(model, "config", None)
    tied = getattr(config, "tie_embeddings", False)
    head = config.vocab_size * config.d_model if tied else 0
    return count_params(model) - sum(tables.values()) + head


def flops_per_token(matmul_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Model FLOPs of one trained token, forward and backward: ``6·N + 12·L·d·T``.

    Example:
      >>> flops_per_token(matmul_params=10**6, n_layers=4, d_model=64, seq_len=64)
      6196608.0
    """
    return 6.0 * matmul_params + 12.0 * n_layers * d_model * seq_len


def peak_flops_per_device(device_kind: str, peak_tflops: float | None = None) -> float | None:
    """One device's peak FLOP/s: ``peak_tflops`` if given, else from `PEAK_TFLOPS`, else None.

    Example:
      >>> peak_flops_per_device("TPU v5 lite"), peak_flops_per_device("cpu")
      (197000000000000.0, None)
      >>> peak_flops_per_device("cpu", peak_tflops=0.5)
      500000000000.0
    """
    if peak_tflops is not None:
        return float(peak_tflops) * 1e12
    kind = device_kind.lower()
    matches = [name for name in PEAK_TFLOPS if name.lower() in kind]
    if not matches:
        return None
    return PEAK_TFLOPS[max(matches, key=len)] * 1e12


def mfu(
    tokens_per_s: float, flops_per_token: float, devices: int, peak_per_device: float | None
) -> float | None:
    """Model FLOPs utilization: the share of ``devices × peak_per_device`` used (None: unknown).

    Example:
      >>> mfu(1000.0, 6e9, devices=8, peak_per_device=1e12)
      0.75
      >>> mfu(1000.0, 6e9, devices=8, peak_per_device=None) is None
      True
    """
    if peak_per_device is None:
        return None
    return tokens_per_s * flops_per_token / (devices * peak_per_device)


def perplexity(loss: float) -> float:
    """``exp(loss)``, the perplexity of a mean cross-entropy in nats (inf past float range).

    Example:
      >>> round(perplexity(2.0), 4)
      7.3891
    """
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


#: ``metrics.jsonl`` fields and the TensorBoard tags they are shown under.
TENSORBOARD_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "mfu": "train/mfu",
    "eval_loss": "eval/loss",
    "eval_ppl": "eval/perplexity",
}


def tensorboard_scalars(record: Mapping[str, Any]) -> dict[str, float | None]:
    """The TensorBoard scalars of one ``metrics.jsonl`` record (`TENSORBOARD_TAGS`).

    Example:
      >>> tensorboard_scalars({"step": 3, "loss": 2.5, "lr": 0.001})
      {'train/loss': 2.5, 'train/lr': 0.001}
    """
    return {tag: record[field] for field, tag in TENSORBOARD_TAGS.items() if field in record}


class TensorBoardLog:
    """TensorBoard event files under ``RUN/tensorboard`` (tensorboardX), for process 0.

    A resumed run starts a new event file and tells TensorBoard to drop the
    points of the steps it repeats (``purge_step``).

    Args:
      run_dir: the run directory.
      first_step: the first step this process runs.

    Raises:
      MpmdError: tensorboardX is not installed.

    Example:
      >>> import tempfile
      >>> log = TensorBoardLog(pathlib.Path(tempfile.mkdtemp()), first_step=1)
      >>> log.scalars(1, {"train/loss": 2.5, "train/mfu": None})
      >>> log.close()
      >>> len(list(log.directory.glob("events.out.tfevents.*")))
      1
    """

    def __init__(self, run_dir: pathlib.Path, first_step: int) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise MpmdError(
                f"--tensorboard needs tensorboardX, which is not installed; "
                f"{TENSORBOARD_INSTALL}, or drop --tensorboard."
            ) from None
        self.directory = pathlib.Path(run_dir) / "tensorboard"
        purge = first_step if first_step > 1 else None
        self._writer = SummaryWriter(logdir=str(self.directory), purge_step=purge)

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """Adds one point per tag at ``step``; None values are skipped."""
        for tag, value in values.items():
            if value is not None:
                self._writer.add_scalar(tag, float(value), global_step=step)

    def flush(self) -> None:
        """Writes the buffered points to disk."""
        self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file."""
        self._writer.close()


class TrainReporting:
    """The mfu, the evaluations and the TensorBoard log of one training run.

    Args:
      trainer: the `nnx_mpmd.apps.train_loop.Trainer` (its model, mesh, schedule,
        held-out tokens and notes; a note is added when the mfu is not reported).
      device_kind: ``jax.Device.device_kind`` of its devices.

    Example:
      >>> import tempfile
      >>> from nnx_mpmd.apps.train import config_from_args
      >>> from nnx_mpmd.apps.train_loop import Trainer
      >>> cfg = config_from_args(["--meshes", "1", "--data", "1", "--steps", "1",
      ...     "--batch-size", "4", "--microbatches", "2", "--corpus-bytes", "20000",
      ...     "--peak-tflops", "1"])
      >>> reporting = Trainer(cfg, pathlib.Path(tempfile.mkdtemp())).reporting
      >>> reporting.mfu(1e6) == 1e6 * reporting.flops_per_token / 1e12
      True
      >>> reporting.evaluate(step=1, end=1)  # --eval-every 0: none
      {}
    """

    def __init__(self, trainer: Any, device_kind: str) -> None:
        self.trainer = trainer
        cfg = trainer.cfg
        d_model = trainer.model.config.d_model
        n = matmul_params(trainer.model)
        #: The model FLOPs of one trained token (`flops_per_token`).
        self.flops_per_token = flops_per_token(n, trainer.num_layers, d_model, trainer.seq_len)
        self.peak = peak_flops_per_device(device_kind, getattr(cfg, "peak_tflops", None))
        if self.peak is None:
            trainer.notes.append(
                f"mfu: not reported, the peak FLOP/s of a {device_kind!r} device is unknown; "
                "pass --peak-tflops X (one device's peak) to report it"
            )
        self._eval_fn: Any = None

    def mfu(self, tokens_per_s: float) -> float | None:
        """The model FLOPs utilization at ``tokens_per_s`` over all the run's devices."""
        cfg = self.trainer.cfg
        return mfu(tokens_per_s, self.flops_per_token, cfg.meshes * cfg.data, self.peak)

    def evaluate(self, step: int, end: int) -> dict[str, float]:
        """``eval_loss`` and ``eval_ppl`` at the steps ``--eval-every`` asks for, else {}.

        A forward-only pipeline on the train step's meshes and schedule: every
        process runs it, and the model stays where training put it.
        """
        trainer = self.trainer
        cfg = trainer.cfg
        every = getattr(cfg, "eval_every", 0)
        if not every or (step % every and step != end):
            return {}
        import numpy as np

        from nnx_mpmd.apps.data import BatchIterator
        from nnx_mpmd.jit.jit import jit
        from nnx_mpmd.models import lm_loss

        if self._eval_fn is None:
            precision = getattr(trainer, "precision", None)
            mixed = precision is not None and precision.is_mixed
            self._eval_fn = jit(
                precision.wrap(lm_loss) if precision is not None and mixed else lm_loss,  # --dtype
                mesh=trainer.mesh,
                schedule=trainer.schedule,
                num_microbatches=cfg.microbatches,
            )
        # The same held-out batches at every evaluation, as at the end (`_val_loss`).
        it = BatchIterator(trainer.val_tokens, cfg.batch_size, trainer.seq_len, seed=1)
        per_microbatch = [
            np.asarray(self._eval_fn(trainer.model, next(it))) for _ in range(cfg.eval_batches)
        ]
        loss = float(np.mean(per_microbatch))
        return {"eval_loss": loss, "eval_ppl": perplexity(loss)}

    def tensorboard(self) -> Any:
        """A `TensorBoardLog` (process 0, ``--tensorboard``) as a context manager, else
        a context of None."""
        trainer = self.trainer
        if not (trainer.writes_outputs and getattr(trainer.cfg, "tensorboard", False)):
            return contextlib.nullcontext(None)
        return contextlib.closing(TensorBoardLog(trainer.run_dir, trainer.start_step + 1))


def add_reporting_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the evaluation, logging and ``--config`` options to ``nnx-mpmd train``'s parser."""
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="score the held-out loss and perplexity every N steps and at the last step "
        "(0: only the validation loss at the end)",
    )
    p.add_argument(
        "--eval-batches", type=int, default=4, metavar="N", help="held-out batches per evaluation"
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        metavar="X",
        help="one device's peak TFLOP/s for the model FLOPs utilization (mfu) (default: "
        "a table of GPUs and TPUs; none for CPUs, whose mfu is then not reported)",
    )
    p.add_argument(
        "--tensorboard",
        action="store_true",
        help="write TensorBoard event files under RUN/tensorboard (needs tensorboardX: "
        "pip install 'nnx-mpmd[tensorboard]')",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="read options from a flat TOML file, one key per option (batch_size = 8, "
        "scan_layers = true); options on the command line override it",
    )
