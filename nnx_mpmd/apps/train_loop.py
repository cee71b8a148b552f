"""The training loop behind ``nnx-mpmd train``: set-up, steps, checkpoints, outputs.

`Trainer` builds the data, the model, the optimizer, the `MpmdMesh` and the
pipelined step from a `nnx_mpmd.apps.train.TrainConfig`, resumes from a
checkpoint if asked (`nnx_mpmd.apps.train_resume`), runs the steps under a rich
progress bar and writes the run directory. In a multi-process run every process builds and steps alike (the
steps and checkpoints are collective); only process 0 prints and writes the
run's files. `nnx_mpmd.apps.train` imports this module only after it has set the
simulated CPU device count, since importing it starts JAX.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
import time
from typing import Any, cast

import jax
import numpy as np
import optax
from flax import nnx

from nnx_mpmd._jax_compat import config_value
from nnx_mpmd.apps.data import BatchIterator, CharTokenizer, stdlib_corpus, train_val_split
from nnx_mpmd.apps.datasets import DEFAULT_VAL_FRACTION, build_data
from nnx_mpmd.apps.local_batches import process_local_batches
from nnx_mpmd.apps.memory_check import check_memory
from nnx_mpmd.apps.pretrained import keep_pretrained_config, pretrained_max_len, pretrained_model
from nnx_mpmd.apps.sampling import generate_text
from nnx_mpmd.apps.stop_signals import StopSignals, stopped_message
from nnx_mpmd.apps.train_args import train_config_values
from nnx_mpmd.apps.train_config import write_run_config
from nnx_mpmd.apps.train_display import (
    CompileCounter,
    first_step_status,
    progress_bar,
    running_venv_hint,
    schedule_label,
    step_status,
)
from nnx_mpmd.apps.train_metrics import TrainReporting, tensorboard_scalars
from nnx_mpmd.apps.train_resume import (
    ARITHMETIC_KEYS,
    LAYOUT_KEYS,
    RESUME_KEYS,
    STRUCTURE_KEYS,
    restore_or_start,
    run_settings,
    save_checkpoint,
)
from nnx_mpmd.checkpoint import CheckpointManager
from nnx_mpmd.distributed import gather
from nnx_mpmd.errors import (
    DistributedError,
    MeshError,
    MpmdError,
    NonFiniteError,
    PartitionError,
    ScheduleError,
)
from nnx_mpmd.jit.jit import jit
from nnx_mpmd.jit.losses import value_and_grad
from nnx_mpmd.jit.precision import Precision, precision_from_names
from nnx_mpmd.models import MODELS, build_model, count_params, lm_loss, preset_names
from nnx_mpmd.models.presets import preset_fields
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.planner.plan import Plan
from nnx_mpmd.runtime.coordination import bounded_by_peers
from nnx_mpmd.schedules import get_schedule, plot_gantt, simulate
from nnx_mpmd.schedules.draw import PLOTS_INSTALL, matplotlib_missing
from nnx_mpmd.schedules.profile import measured_timeline

__all__ = [
    "ARITHMETIC_KEYS",
    "LAYOUT_KEYS",
    "RESUME_KEYS",
    "STRUCTURE_KEYS",
    "Trainer",
    "measured_timeline",
    "plot_losses",
    "train_step",
]

SAMPLE_PROMPT = "def "
VAL_FRACTION = DEFAULT_VAL_FRACTION
DEVICE_FLAG_HINT = "--xla_force_host_platform_device_count=N"


def _compile_cache_text() -> str:
    """Where JAX's persistent compilation cache is, or ``off``."""
    directory = config_value("jax_compilation_cache_dir")
    return directory if directory and config_value("jax_enable_compilation_cache") else "off"


def train_step(model: Any, optimizer: nnx.Optimizer, batch: dict[str, Any]) -> jax.Array:
    """One optimizer step on the mean next-token loss; returns the loss before the update.

    Example:
      >>> import numpy as np
      >>> model = build_model("gpt", "tiny", num_stages=1, rngs=nnx.Rngs(0))
      >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> tokens = np.zeros((2, 8), np.int32)
      >>> float(train_step(model, opt, {"inputs": tokens, "targets": tokens})) > 0
      True
    """
    loss, grads = value_and_grad(lm_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


def _train_step_in(precision: Precision) -> Any:
    """`train_step` with the loss computed under ``precision`` (``--dtype``, ``--param-dtype``);
    `train_step` itself when the policy changes nothing (the float32 default)."""
    if not precision.is_mixed:
        return train_step
    loss_fn = precision.wrap(lm_loss)

    def train_step_in_precision(model: Any, optimizer: nnx.Optimizer, batch: Any) -> jax.Array:
        loss, grads = value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    return train_step_in_precision


def plot_losses(metrics: list[dict[str, Any]], path: pathlib.Path, title: str) -> None:
    """Draws loss against step into ``path`` (matplotlib, no pyplot); ``eval_loss`` records too.

    Example:
      >>> import tempfile
      >>> out = pathlib.Path(tempfile.mkdtemp()) / "loss.png"
      >>> plot_losses([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}], out, "t")
      >>> out.exists()
      True
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.6))
    ax = fig.add_subplot()
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], marker=".", lw=1)
    evals = [m for m in metrics if m.get("eval_loss") is not None]
    if evals:
        ax.plot([m["step"] for m in evals], [m["eval_loss"] for m in evals], "o-", lw=1)
        ax.legend(["training", "held-out (--eval-every)"])
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def _quiet(*args: Any, **kwargs: Any) -> None:
    """Prints nothing: the log of processes other than 0."""


class Trainer:
    """Builds everything for one ``nnx-mpmd train`` run and runs it.

    Args:
      cfg: the parsed options (`nnx_mpmd.apps.train.TrainConfig`).
      run_dir: the output directory.

    Raises:
      MpmdError: too few devices, an unknown model, preset or schedule, a
        schedule that does not fit the stages, or an incompatible checkpoint.

    Example:
      >>> import tempfile
      >>> from nnx_mpmd.apps.train import config_from_args
      >>> cfg = config_from_args(["--meshes", "1", "--data", "1", "--steps", "1",
      ...     "--batch-size", "4", "--microbatches", "2", "--corpus-bytes", "20000"])
      >>> Trainer(cfg, pathlib.Path(tempfile.mkdtemp())).num_stages
      1
    """

    def __init__(self, cfg: Any, run_dir: pathlib.Path) -> None:
        self.cfg = cfg
        self.run_dir = pathlib.Path(run_dir)
        #: Whether this process prints the log and writes the run's files (process 0).
        self.writes_outputs = jax.process_index() == 0
        self.schedule = get_schedule(cfg.schedule)
        self.num_stages = cfg.stages or self.schedule.default_num_stages(cfg.meshes)
        if cfg.model not in MODELS:
            raise MpmdError(f"unknown --model {cfg.model!r}; choose one of {sorted(MODELS)}.")
        if cfg.preset not in preset_names(cfg.model):
            raise MpmdError(
                f"unknown --preset {cfg.preset!r} for --model {cfg.model}; choose one of "
                f"{preset_names(cfg.model)}."
            )
        try:
            self.schedule.check(self.num_stages, cfg.meshes, cfg.microbatches)
        except ScheduleError as e:
            raise ScheduleError(
                f"--schedule {cfg.schedule} with {self.num_stages} stages, --meshes "
                f"{cfg.meshes}, --microbatches {cfg.microbatches}: {e} (set them with "
                "--stages, --meshes and --microbatches)"
            ) from None
        self.num_layers, self.notes = self._choose_layers()
        devices = jax.devices()
        needed = cfg.meshes * cfg.data
        if len(devices) < needed:
            processes = jax.process_count()
            among = f" among {processes} processes" if processes > 1 else ""
            raise MeshError(
                f"--meshes {cfg.meshes} x --data {cfg.data} needs {needed} devices but JAX "
                f"has {len(devices)}{among} ({devices[0].platform}); lower --meshes or --data, "
                f"or raise --devices (CPU only; XLA_FLAGS={DEVICE_FLAG_HINT}; under "
                "`nnx-mpmd launch`, --devices-per-process)."
            )

        # --- precision (issue 48): the zoo's layers compute in the policy's dtype ---
        self.precision = precision_from_names(
            getattr(cfg, "dtype", "float32"), getattr(cfg, "param_dtype", "float32")
        )
        if self.precision.is_mixed:
            self.notes.append(
                f"precision: compute {self.precision.compute_dtype.name}, parameters and "
                f"optimizer state {self.precision.param_dtype.name}"
            )
        if getattr(cfg, "init_from", None):  # the checkpoint's context, not the preset's
            context = pretrained_max_len(cfg.init_from)
        else:
            context = int(preset_fields(cfg.model, cfg.preset)["max_len"])
        shown = self.writes_outputs
        self.data = build_data(cfg, self.run_dir, cfg.seq_len or context, show_progress=shown)
        if self.data is None:
            text = stdlib_corpus(cfg.corpus_bytes)
            self.tokenizer = CharTokenizer.from_text(text)
            tokens = self.tokenizer.encode(text)
            fraction = getattr(cfg, "val_fraction", None) or VAL_FRACTION
            train_tokens, self.val_tokens = train_val_split(tokens, fraction)
        else:
            self.tokenizer, self.val_tokens = self.data.tokenizer, self.data.val_tokens
            self.notes.extend(self.data.notes)
        overrides: dict[str, Any] = {
            "vocab_size": self.tokenizer.vocab_size,
            "n_layers": self.num_layers,
            "scan_layers": bool(getattr(cfg, "scan_layers", False)),
            "dtype": self.precision.compute_dtype,
        }
        if getattr(cfg, "init_from", None):  # a Hugging Face directory (apps.pretrained)
            shape = ("vocab_size", "n_layers")  # the checkpoint's; other overrides apply
            self.model = pretrained_model(
                cfg.init_from,
                num_stages=self.num_stages,
                vocab_size=overrides["vocab_size"],
                **{k: v for k, v in overrides.items() if k not in shape},
            )
        else:
            self.model = build_model(
                cfg.model,
                cfg.preset,
                num_stages=self.num_stages,
                rngs=nnx.Rngs(cfg.seed),
                **overrides,
            )
        if getattr(cfg, "plan", None):
            Plan.load(cfg.plan).apply(self.model)
        max_len = self.model.config.max_len
        self.seq_len = cfg.seq_len or max_len
        if not 1 <= self.seq_len <= max_len:
            raise MpmdError(
                f"--seq-len={self.seq_len} must lie in [1, {max_len}] (the {cfg.model} "
                f"{cfg.preset} context length); pick a shorter one."
            )
        if self.data is None:
            self.batches = BatchIterator(
                train_tokens,  # pyright: ignore[reportPossiblyUnboundVariable]: set when data is None
                cfg.batch_size,
                self.seq_len,
                seed=cfg.seed,
            )
        else:
            self.batches = self.data.batches(cfg.batch_size, self.seq_len, cfg.seed)
        warmup = min(cfg.warmup, cfg.steps - 1)
        self.lr = optax.warmup_cosine_decay_schedule(
            0.0, cfg.lr, warmup, decay_steps=max(cfg.steps, warmup + 1), end_value=cfg.lr / 10
        )
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(self.lr, b2=0.99))
        if self.precision.is_mixed:  # before the optimizer: its state takes the params' dtype
            self.precision.apply_to(self.model)
        self.optimizer = nnx.Optimizer(self.model, tx, wrt=nnx.Param)
        jax_mesh = jax.make_mesh(
            (cfg.meshes, cfg.data), ("stage", "data"), devices=devices[:needed]
        )
        self.mesh = MpmdMesh(jax_mesh, "stage")
        self.step_fn = jit(
            _train_step_in(self.precision),
            mesh=self.mesh,
            schedule=self.schedule,
            num_microbatches=cfg.microbatches,
            donate_argnums=() if getattr(cfg, "no_donate", False) else (0, 1),
            check_finite=bool(getattr(cfg, "check_finite", False)),
        )
        #: mfu, evaluation and TensorBoard (`nnx_mpmd.apps.train_metrics`).
        self.reporting = TrainReporting(self, devices[0].device_kind)
        # --- each process reads only its share (issue 48) ---
        self.batches = process_local_batches(self.batches, self.step_fn, self.model, self.optimizer)
        self.start_step = 0
        #: ``(step, signal, saved)`` once a stop signal ended the loop early, else None.
        self.stopped: tuple[int, int, bool] | None = None
        if not getattr(cfg, "skip_memory_check", False):
            check_memory(self)  # before anything compiles or is written

    def _choose_layers(self) -> tuple[int, list[str]]:
        """The number of blocks: the preset's, or one per stage when it has fewer."""
        cfg = self.cfg
        preset_layers = int(preset_fields(cfg.model, cfg.preset)["n_layers"])
        where = f"--schedule {cfg.schedule} runs {self.num_stages} stages on {cfg.meshes} meshes"
        if cfg.layers is not None:
            if cfg.layers < self.num_stages:
                raise PartitionError(
                    f"--layers {cfg.layers} is too few: {where} and every stage needs at least "
                    f"one block; add --layers {self.num_stages} (or more), or use fewer "
                    "--meshes or --stages."
                )
            return cfg.layers, []
        if preset_layers >= self.num_stages:
            return preset_layers, []
        note = (
            f"note: {where} but the {cfg.model} {cfg.preset} preset has {preset_layers} "
            f"layers; using {self.num_stages} layers (one per stage). Pass --layers to choose, "
            "or fewer --meshes."
        )
        return self.num_stages, [note]

    # -- checkpoints: the settings saved with each, resuming (`nnx_mpmd.apps.train_resume`) --

    def settings(self) -> dict[str, Any]:
        """The JSON configuration saved in checkpoint metadata (`run_settings`)."""
        return run_settings(self)

    def restore_or_start(self, manager: CheckpointManager | None) -> None:
        """Resumes the newest intact checkpoint (``--resume[-step]``) or checks the run is new."""
        restore_or_start(self, manager)

    def save_checkpoint(self, manager: CheckpointManager, step: int) -> None:
        """Saves model, optimizer, data position, settings and tokenizer as checkpoint ``step``."""
        save_checkpoint(self, manager, step)

    # -- the loop ---------------------------------------------------------------------

    def _header(self) -> str:
        cfg = self.cfg
        tl = simulate(self.schedule.tasks(self.num_stages, cfg.meshes, cfg.microbatches))
        processes = jax.process_count()
        across = f", {processes} processes" if processes > 1 else ""
        preset_layers = int(preset_fields(cfg.model, cfg.preset)["n_layers"])
        layers = f"{self.num_layers} layers"
        title = f"{cfg.model} {cfg.preset}"
        if getattr(cfg, "init_from", None):  # a Hugging Face directory has no preset
            title = f"{cfg.model} from {cfg.init_from}"
        elif self.num_layers != preset_layers:
            layers += f" (the preset has {preset_layers})"
        unit = "chars" if isinstance(self.tokenizer, CharTokenizer) else "tokens"
        return (
            f"{title}: {layers}, {count_params(self.model):,} parameters, "
            f"{self.num_stages} stages on {cfg.meshes} meshes x {cfg.data} data "
            f"({jax.devices()[0].platform}{across}), schedule {schedule_label(self.schedule)}, "
            f"{cfg.microbatches} microbatches (simulated bubble "
            f"{tl.bubble_fraction:.1%}); batch {cfg.batch_size} x {self.seq_len} {unit}; "
            f"run dir {self.run_dir}; compile cache {_compile_cache_text()}"
        )

    def _metrics(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not self.writes_outputs or not path.exists():
            return []
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        # A resumed run repeats the steps after its checkpoint: drop their old records.
        return [r for r in records if r["step"] <= self.start_step]

    def train(self, stop: StopSignals | None = None) -> dict[str, Any]:
        """Runs the steps and writes the outputs; returns the run's summary.

        After a stop signal the loop ends with a checkpoint of the step in progress and skips
        the validation loss, sample and pictures; processes other than 0 neither score nor sample.
        """
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        manager = None
        if cfg.ckpt_every or cfg.resume:
            manager = CheckpointManager(self.run_dir / "checkpoints", max_to_keep=cfg.keep)
        try:
            self.restore_or_start(manager)
            if self.writes_outputs:  # the settings are accepted: `--resume` reads them back
                write_run_config(self.run_dir, train_config_values(cfg))
            if getattr(cfg, "init_from", None) and self.writes_outputs:
                keep_pretrained_config(cfg.init_from, self.run_dir)  # --resume rebuilds from it
            metrics = self._metrics()
            losses = self._loop(manager, metrics, stop)
        except BaseException:
            if manager is not None:  # a dead peer is already named by the error in flight
                with contextlib.suppress(DistributedError):
                    manager.close()
            raise
        if manager is not None:
            manager.close()  # waits until the last save is committed
        if self.stopped is not None:
            return self._stopped_summary(self.stopped, losses)
        return self._finish(metrics, losses)

    def _stopped_summary(
        self, stopped: tuple[int, int, bool], losses: list[float]
    ) -> dict[str, Any]:
        """The summary of a run a stop signal ended; process 0 prints how to continue it."""
        step, signum, saved = stopped
        if self.writes_outputs:
            print(stopped_message(step, signum, self.run_dir, saved), flush=True)
        return {
            "run_dir": str(self.run_dir),
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "steps_run": len(losses),
            "val_loss": None,
            "sample": "",
            "stopped_at": step,
            "stop_signal": signum,
        }

    def _loop(
        self,
        manager: CheckpointManager | None,
        metrics: list[dict[str, Any]],
        stop: StopSignals | None = None,
    ) -> list:
        cfg = self.cfg
        end = cfg.stop_at or cfg.steps
        tokens_per_step = cfg.batch_size * self.seq_len
        profile_step = min(self.start_step + 2, end) if cfg.profile else None
        report_every = max(cfg.log_every, cfg.steps // 10)
        losses: list[float] = []
        recent: list[float] = []
        progress, bar = progress_bar(cfg.steps, self.start_step, shown=self.writes_outputs)
        say = progress.console.print if self.writes_outputs else _quiet
        say(self._header(), soft_wrap=True)
        for note in self.notes:
            say(note, soft_wrap=True)
        if self.start_step:
            say(f"resumed from step {self.start_step}")
        # The model and optimizer keep their structure from here on (a restore only
        # sets values), so the step needs not walk their graph on every call.
        step_fn = nnx.cached_partial(self.step_fn, self.model, self.optimizer)
        started = time.perf_counter()
        saved_at = None
        if stop is not None:
            stop.begin(self.start_step)
        with progress, self._metrics_log(metrics) as log, self.reporting.tensorboard() as board:
            for step in range(self.start_step + 1, end + 1):
                batch = next(self.batches)
                t0 = time.perf_counter()
                # A process's first step compiles: the bar shows the programs as they finish.
                counter = self._first_step_counter(progress, bar, step)
                try:
                    with counter or contextlib.nullcontext():
                        loss = float(step_fn(batch, profile=step == profile_step))
                except NonFiniteError as e:  # --check-finite
                    raise NonFiniteError(f"step {step}: {e}") from None
                seconds = time.perf_counter() - t0
                if step == profile_step:
                    self._draw_profile()
                losses.append(loss)
                if not math.isfinite(loss):
                    raise MpmdError(
                        f"the loss became {loss} at step {step}; lower --lr (now {cfg.lr}), or "
                        "rerun with --check-finite to find the first stage and parameter "
                        "that went NaN or inf."
                    )
                # The first step of a process includes compilation: keep it out of tok/s.
                if step > self.start_step + 1 or end == self.start_step + 1:
                    recent = [*recent, seconds][-20:]
                tps = tokens_per_step * len(recent) / sum(recent) if recent else 0.0
                tps = tps or tokens_per_step / seconds
                progress.update(bar, completed=step, status=step_status(loss, tps))
                evaluated = self.reporting.evaluate(step, end)  # every process: a collective
                if evaluated or step % cfg.log_every == 0 or step in (self.start_step + 1, end):
                    record = {
                        "step": step,
                        "loss": loss,
                        "tokens_per_s": tps,
                        "mfu": self.reporting.mfu(tps),
                        "step_s": seconds,
                        "lr": float(np.asarray(self.lr(step - 1))),
                        "elapsed_s": time.perf_counter() - started,
                        **evaluated,
                    }
                    metrics.append(record)
                    if log is not None:
                        log.write(json.dumps(record) + "\n")
                        log.flush()
                    if board is not None:
                        board.scalars(step, tensorboard_scalars(record))
                if evaluated:
                    say(
                        f"step {step}/{cfg.steps}  eval loss {evaluated['eval_loss']:.4f}  "
                        f"perplexity {evaluated['eval_ppl']:.2f}"
                    )
                if counter is not None:  # the first step's time is mostly compiling
                    cache_on = _compile_cache_text() != "off"
                    say(
                        f"step {step}/{cfg.steps}  loss {loss:.4f}  (first step {seconds:.1f} s: "
                        f"{counter.text(cache_on)})",
                        soft_wrap=True,
                    )
                elif step % report_every == 0 or step == end:
                    utilization = self.reporting.mfu(tps)
                    shown = "" if utilization is None else f"  mfu {utilization:.1%}"
                    say(f"step {step}/{cfg.steps}  loss {loss:.4f}  {tps:,.0f} tok/s{shown}")
                saver = manager if cfg.ckpt_every else None
                if saver is not None and (step % cfg.ckpt_every == 0 or step == cfg.steps):
                    self.save_checkpoint(saver, step)
                    saved_at = step
                # Every process asks after every step: the stop step is agreed on.
                if stop is not None and stop.should_stop(step):
                    if saver is not None and saved_at != step:
                        self.save_checkpoint(saver, step)
                        saved_at = step
                    # should_stop is True once a signal came: signum is set
                    self.stopped = (step, cast(int, stop.signum), saved_at == step)
                    break
        return losses

    def _first_step_counter(self, progress: Any, bar: Any, step: int) -> CompileCounter | None:
        """A `CompileCounter` that shows its counts on the bar, for this process's first step."""
        if step != self.start_step + 1:
            return None
        cache_on = _compile_cache_text() != "off"

        def show(counter: CompileCounter) -> None:
            progress.update(bar, status=first_step_status(step, counter, cache_on))

        return CompileCounter(show)

    def _metrics_log(self, metrics: list[dict[str, Any]]) -> Any:
        """``metrics.jsonl`` rewritten with ``metrics`` and open for appending, as a context
        manager; on processes other than 0, a context of None."""
        if not self.writes_outputs:
            return contextlib.nullcontext(None)
        path = self.run_dir / "metrics.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in metrics))
        return path.open("a")

    def _picture(self, name: str) -> pathlib.Path | None:
        """The path to draw ``name`` at, or None (and one line saying so) without matplotlib;
        None on processes other than 0."""
        if not self.writes_outputs:
            return None
        if matplotlib_missing() is None:
            return self.run_dir / name
        print(f"skipped {name}: matplotlib is not installed; {PLOTS_INSTALL} to draw it")
        return None

    def _draw_profile(self) -> None:
        if not self.writes_outputs:
            return
        comparison = self.step_fn.last_profile.compare()
        print(comparison.summary())
        path = self._picture("schedule_measured.png")
        if path is not None:
            comparison.plot(path)

    def _val_loss(self, batches: int) -> float | None:
        if not batches:
            return None
        it = BatchIterator(self.val_tokens, self.cfg.batch_size, self.seq_len, seed=1)
        loss_fn = nnx.jit(self.precision.wrap(lm_loss) if self.precision.is_mixed else lm_loss)
        return float(np.mean([float(loss_fn(self.model, next(it))) for _ in range(batches)]))

    def _finish(self, metrics: list[dict[str, Any]], losses: list[float]) -> dict[str, Any]:
        cfg = self.cfg
        tasks = self.schedule.tasks(self.num_stages, cfg.meshes, cfg.microbatches)
        schedule_png = self._picture("schedule.png")
        if schedule_png is not None:
            plot_gantt(
                tasks,
                schedule_png,
                title=f"simulated {schedule_label(self.schedule)}: {self.num_stages} stages, "
                f"{cfg.meshes} meshes, {cfg.microbatches} microbatches",
            )
        loss_png = self._picture("loss.png") if metrics else None
        if loss_png is not None:
            title = f"{cfg.model} {cfg.preset}, {schedule_label(self.schedule)}"
            plot_losses(metrics, loss_png, title)
        gather(self.model)  # collective: every process
        # Only process 0 scores and samples; bounded like a step, so that a peer that
        # dies meanwhile is named now, not at the final barrier.
        val_loss = None
        if self.writes_outputs:
            val_loss = bounded_by_peers(
                "computing the validation loss", self._val_loss, cfg.val_batches
            )
        sample = ""
        if cfg.sample_tokens and self.writes_outputs:
            sample = bounded_by_peers(
                "generating the sample",
                lambda: generate_text(
                    self.model,
                    self.tokenizer,
                    SAMPLE_PROMPT if self.data is None else self.data.sample_prompt,
                    cfg.sample_tokens,
                    temperature=0.8,
                    seed=cfg.seed,
                ),
            )
            (self.run_dir / "sample.txt").write_text(sample + "\n")
        if val_loss is not None:
            print(f"validation loss {val_loss:.4f}")
        if sample:
            print(f"sample:\n{sample}")
        hint = running_venv_hint() if self.writes_outputs else None
        if hint is not None:
            print(hint)
        return {
            "run_dir": str(self.run_dir),
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "steps_run": len(losses),
            "val_loss": val_loss,
            "sample": sample,
            "stopped_at": None,
            "stop_signal": None,
        }
