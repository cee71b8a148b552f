"""``nnx-mpmd generate``: continue a prompt with the model of a training run.

Reads a run directory written by ``nnx-mpmd train``. The model is rebuilt from
the configuration saved in the checkpoint's metadata and its parameters are
restored from the newest intact checkpoint (or ``--step N``) into the layout
asked for, whatever layout trained it:

- by default pipelined over ``--meshes`` submeshes of ``--data`` devices with
  `nnx_mpmd.Generator` (KV-cached decoding; the prompt is copied into one row
  per data device and microbatch, and the first row is shown);
- ``--meshes 1 --data 1``: on one device, the same decoding under ``nnx.jit``.

The prompt is encoded, and the output decoded, with the tokenizer saved in
the metadata (`nnx_mpmd.apps.text_tokenizers.tokenizer_from_dict`); only ids
the tokenizer has are chosen, even when the model's vocabulary is larger (a run
made with ``--init-from``). The text
(the prompt, then the new tokens) streams to stdout as every token is chosen;
the speed goes to stderr at the end. ``--temperature 0`` decodes greedily, and
greedy text is the same in every layout; sampled text depends on ``--seed``
and on the number of rows (each row draws with its own key).

Bad input (a run directory without checkpoints, a missing step, a layout that
does not fit the devices, a prompt the tokenizer cannot encode or the context
cannot hold) prints one line on stderr and exits with 2.

JAX is imported only after the simulated CPU device count is set, so this
module must not import JAX at the top level.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time
from typing import IO, Any, cast

__all__ = ["GenerateConfig", "TextStream", "build_parser", "config_from_args", "main", "run"]


class GenerateConfig(argparse.Namespace):
    """The parsed options of ``nnx-mpmd generate`` (an ``argparse.Namespace``).

    Example:
      >>> cfg = config_from_args(["--run-dir", "r", "--prompt", "def ", "--max-tokens", "8"])
      >>> cfg.meshes, cfg.temperature, cfg.step
      (4, 0.0, None)
    """

    run_dir: str
    step: int | None
    prompt: str
    max_tokens: int
    temperature: float
    top_k: int | None
    seed: int
    meshes: int
    data: int
    schedule: str
    microbatches: int
    devices: int


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``nnx-mpmd generate`` (its ``parse_args`` gives a `GenerateConfig`).

    Example:
      >>> build_parser().parse_args(["--run-dir", "r", "--prompt", "x"]).max_tokens
      100
    """
    from nnx_mpmd.apps.train_args import DEVICE_COUNT_FLAG, HelpFormatter

    p = argparse.ArgumentParser(
        prog="nnx-mpmd generate",
        description="Continue a prompt with the model of an nnx-mpmd train run, restored "
        "from its checkpoint into any layout; the text streams to stdout.",
        formatter_class=HelpFormatter,  # "(default: X)" once, never for None
    )
    p.add_argument("--run-dir", required=True, help="the run directory of nnx-mpmd train")
    p.add_argument(
        "--step", type=int, default=None, help="the checkpoint step (default: newest intact)"
    )
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-tokens", type=int, default=100, help="tokens to generate")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy"
    )
    p.add_argument(
        "--top-k", type=int, default=None, help="sample among the k most likely tokens only"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument(
        "--meshes", type=int, default=4, help="pipeline submeshes (1 with --data 1: one device)"
    )
    p.add_argument("--data", type=int, default=1, help="data-parallel devices per submesh")
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule (its forward tasks)")
    p.add_argument(
        "--microbatches", type=int, default=1, help="microbatches of rows in flight together"
    )
    p.add_argument(
        "--devices",
        type=int,
        default=8,
        help=f"simulated CPU devices (ignored when XLA_FLAGS sets {DEVICE_COUNT_FLAG})",
    )
    return p


def config_from_args(argv: list[str]) -> GenerateConfig:
    """Parses and checks the options after ``generate`` that need no JAX (`MpmdError`: bad range).

    Example:
      >>> config_from_args(["--run-dir", "r", "--prompt", "x", "--top-k", "0"])
      Traceback (most recent call last):
      ...
      nnx_mpmd.errors.MpmdError: --top-k=0 must be >= 1 (or left out to sample among all tokens).
    """
    from nnx_mpmd.apps.validate_args import check_seed
    from nnx_mpmd.errors import MpmdError

    cfg = build_parser().parse_args(argv, namespace=GenerateConfig())
    for name in ("max_tokens", "meshes", "data", "microbatches", "devices"):
        if getattr(cfg, name) < 1:
            raise MpmdError(f"--{name.replace('_', '-')}={getattr(cfg, name)} must be >= 1.")
    if not (math.isfinite(cfg.temperature) and cfg.temperature >= 0):
        raise MpmdError(
            f"--temperature={cfg.temperature} must be a number >= 0 (0 is greedy, e.g. 0.8 "
            "samples)."
        )
    if cfg.top_k is not None and cfg.top_k < 1:
        raise MpmdError(
            f"--top-k={cfg.top_k} must be >= 1 (or left out to sample among all tokens)."
        )
    if cfg.step is not None and cfg.step < 0:
        raise MpmdError(f"--step={cfg.step} must be a saved step number (>= 0).")
    if not cfg.prompt:
        raise MpmdError("--prompt is empty; give the text to continue, e.g. --prompt 'def '.")
    check_seed(cfg.seed)
    return cfg


def checkpoint_dir(run_dir: str | pathlib.Path) -> pathlib.Path:
    """``run_dir/checkpoints``, checked to exist (`CheckpointError` if not); creates nothing."""
    from nnx_mpmd.errors import CheckpointError

    run_dir = pathlib.Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(
            f"--run-dir {run_dir} is not a directory; point it at a run of nnx-mpmd train "
            "(runs/TIME by default)."
        )
    if not (run_dir / "checkpoints").is_dir():
        raise CheckpointError(
            f"--run-dir {run_dir} holds no checkpoints/ directory; train with checkpoints "
            "(nnx-mpmd train --ckpt-every N) or point --run-dir at such a run."
        )
    return run_dir / "checkpoints"


class TextStream:
    """Writes the text of a growing token sequence as it grows, each piece once.

    The whole sequence is decoded at every token and only the new end is
    written, so tokenizers whose pieces depend on their neighbours (a leading
    space, a character split over byte tokens) stream the same text as one
    decode at the end. An unfinished character (U+FFFD at the end) waits for
    the next token. A token that rewrites earlier text (a decoder's clean-up)
    cannot unwrite it: the stream goes on after as many characters.

    Args:
      tokenizer: the run's tokenizer (``decode``).
      prompt_ids: the prompt's token ids; their text is written at once.
      out: the stream written to (flushed after every piece).

    Example:
      >>> import io
      >>> from nnx_mpmd.apps.data import CharTokenizer
      >>> out = io.StringIO()
      >>> stream = TextStream(CharTokenizer.from_text("abc"), [0], out)
      >>> stream.add(2); stream.add(1); stream.finish()
      >>> out.getvalue()
      'acb\\n'
    """

    def __init__(self, tokenizer: Any, prompt_ids: Any, out: IO[str]) -> None:
        self.tokenizer = tokenizer
        self.ids = [int(i) for i in prompt_ids]
        self.out = out
        self.shown = ""
        self._write(tokenizer.decode(self.ids))

    def _write(self, text: str) -> None:
        # A token may rewrite text already written (a decoder's clean-up, "a ." -> "a."):
        # what was written stays, and the stream goes on after as many characters.
        if len(text) > len(self.shown):
            self.out.write(text[len(self.shown) :])
            self.out.flush()
        if len(text) >= len(self.shown):
            self.shown = text

    def add(self, token: int) -> None:
        """Appends one token and writes the text it completes."""
        self.ids.append(int(token))
        self._write(self.tokenizer.decode(self.ids).rstrip("\ufffd"))

    def finish(self) -> None:
        """Writes what is still held back, and a newline."""
        self._write(self.tokenizer.decode(self.ids))
        self.out.write("\n")
        self.out.flush()


def _readable_metadata(manager: Any, steps: list[int], err: IO[str]) -> tuple[int, dict]:
    """The newest of ``steps`` whose metadata reads, and that metadata; damaged ones are
    named on ``err``."""
    from nnx_mpmd.errors import CheckpointDamagedError, CheckpointError

    reasons = []
    for step in reversed(steps):
        try:
            return step, manager.metadata(step)
        except CheckpointDamagedError as e:
            reasons.append(f"step {step}: {e}")
            print(f"nnx-mpmd generate: warning: skipped step {step}: {e}", file=err)
    raise CheckpointError(f"no intact checkpoint in {manager.directory}: {' '.join(reasons)}")


def _build_model(meta: dict, num_stages: int, layout: str, where: str) -> Any:
    """The run's model, rebuilt from the checkpoint's configuration for ``num_stages``."""
    from flax import nnx

    from nnx_mpmd.errors import CheckpointError, PartitionError
    from nnx_mpmd.models import MODELS

    config = meta.get("config")
    config = config if isinstance(config, dict) else {}
    family, model_config = config.get("model"), config.get("model_config")
    if family not in MODELS or not isinstance(model_config, dict):
        raise CheckpointError(
            f"the metadata of {where} has no model configuration (config.model and "
            "config.model_config); it was not written by nnx-mpmd train, or it is damaged: "
            "choose another --step or run."
        )
    layers = model_config.get("n_layers")
    if isinstance(layers, int) and num_stages > layers:
        raise PartitionError(
            f"{layout} runs {num_stages} stages, but the run's model has {layers} layers and "
            f"every stage needs one; use --meshes {layers} or fewer (or --meshes 1 --data 1)."
        )
    model_cls, config_cls = MODELS[family]
    model_config = config_cls.from_dict({**model_config, "num_stages": num_stages})
    return model_cls(model_config, rngs=nnx.Rngs(0))


def restore_run(
    run_dir: str | pathlib.Path,
    step: int | None,
    num_stages: int,
    layout: str,
    err: IO[str] | None = None,
) -> tuple[Any, Any, int]:
    """``(unplaced model, tokenizer, step)`` of a run, restored for ``num_stages`` stages.

    ``step`` None: the newest intact one; warnings about damaged steps go to ``err``.

    Raises:
      CheckpointError: no checkpoint, no such step (the message lists the saved
        ones), or none intact.
      CheckpointDamagedError: ``step`` is damaged.
      PartitionError: more stages than the model has layers.
    """
    from nnx_mpmd.apps.text_tokenizers import tokenizer_from_dict
    from nnx_mpmd.checkpoint import CheckpointManager
    from nnx_mpmd.errors import CheckpointError

    err = cast(IO[str], sys.stderr) if err is None else err
    where = checkpoint_dir(run_dir)
    manager = CheckpointManager(where, async_save=False)
    try:
        steps = manager.all_steps()
        if not steps:
            raise CheckpointError(
                f"{where} holds no finished checkpoint; train until one is saved "
                "(nnx-mpmd train --ckpt-every N), or point --run-dir at another run."
            )
        if step is not None and step not in steps:
            raise CheckpointError(f"--step {step} is not saved in {where}; saved steps: {steps}.")
        if step is not None:  # a damaged step chosen by hand is an error, not skipped
            newest, meta = step, manager.metadata(step)
        else:
            newest, meta = _readable_metadata(manager, steps, err)
        model = _build_model(meta, num_stages, layout, f"checkpoint {newest} in {where}")
        tokenizer = tokenizer_from_dict(meta.get("tokenizer") or {}, run_dir)
        target = {"model": model}
        if step is not None:
            manager.restore(target, step, partial=True)
            restored = step
        else:
            found = manager.restore_newest_intact(target, before=newest, partial=True)
            for line in found.skipped:
                print(f"nnx-mpmd generate: warning: {line}", file=err)
            restored = found.step
    finally:
        manager.close()
    return model, tokenizer, restored


def _encode_prompt(cfg: GenerateConfig, tokenizer: Any, model: Any) -> Any:
    """The prompt's token ids, checked against the vocabulary and the context."""
    import numpy as np

    from nnx_mpmd.errors import MpmdError

    try:
        ids = np.asarray(tokenizer.encode(cfg.prompt), np.int32).reshape(-1)
    except MpmdError as e:
        raise MpmdError(
            f"--prompt cannot be encoded with the run's tokenizer ({e}); write the prompt "
            "with characters of the text the run trained on."
        ) from None
    vocab, window = model.config.vocab_size, model.config.max_len
    if not ids.size:
        raise MpmdError("--prompt encodes to no tokens; give some text to continue.")
    if ids.max() >= vocab:
        raise MpmdError(
            f"--prompt encodes to token {int(ids.max())}, outside the model's vocabulary of "
            f"{vocab}; the run's tokenizer does not fit its checkpoint."
        )
    if ids.size >= window:
        raise MpmdError(
            f"--prompt is {ids.size} tokens, but the model's context holds {window} with the "
            f"new ones; shorten the prompt to at most {window - 1} tokens."
        )
    if ids.size + cfg.max_tokens > window:
        raise MpmdError(
            f"--max-tokens {cfg.max_tokens}: the prompt's {ids.size} tokens and the new ones "
            f"exceed the model's context of {window}; pass --max-tokens "
            f"{window - ids.size} or less."
        )
    return ids


def _layout(cfg: GenerateConfig) -> tuple[Any, int, Any, str]:
    """The schedule, its stages, the `MpmdMesh` and the layout in words, checked against
    the devices before anything is read."""
    import jax

    from nnx_mpmd.errors import MeshError, ScheduleError
    from nnx_mpmd.placement.mesh import MpmdMesh
    from nnx_mpmd.schedules import get_schedule

    schedule = get_schedule(cfg.schedule)
    num_stages = schedule.default_num_stages(cfg.meshes)
    layout = f"--meshes {cfg.meshes} --data {cfg.data} --schedule {cfg.schedule}"
    try:
        schedule.check(num_stages, cfg.meshes, cfg.microbatches)
    except ScheduleError as e:
        raise ScheduleError(f"{layout} --microbatches {cfg.microbatches}: {e}") from None
    devices, needed = jax.devices(), cfg.meshes * cfg.data
    if len(devices) < needed:
        raise MeshError(
            f"{layout} needs {needed} devices but JAX has {len(devices)} "
            f"({devices[0].platform}); lower --meshes or --data, or raise --devices (CPU only)."
        )
    mesh = jax.make_mesh((cfg.meshes, cfg.data), ("stage", "data"), devices=devices[:needed])
    return schedule, num_stages, MpmdMesh(mesh, "stage"), layout


def run(
    cfg: GenerateConfig, out: IO[str] | None = None, err: IO[str] | None = None
) -> dict[str, Any]:
    """Restores the run's model and streams the continuation of the prompt to ``out``.

    Returns ``step``, ``tokens`` (prompt and new), ``text``, ``seconds``, ``tokens_per_s``;
    raises `MpmdError` (see the module docstring).
    """
    import numpy as np

    from nnx_mpmd.aot.compile_cache import enable_compile_cache
    from nnx_mpmd.jit.generate import Generator

    out = cast(IO[str], sys.stdout) if out is None else out
    err = cast(IO[str], sys.stderr) if err is None else err
    enable_compile_cache()
    schedule, num_stages, mesh, layout = _layout(cfg)
    model, tokenizer, step = restore_run(cfg.run_dir, cfg.step, num_stages, layout, err)
    generator = Generator(
        mesh=mesh,
        schedule=schedule,
        num_microbatches=cfg.microbatches,
        window=model.config.max_len,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        vocab_size=tokenizer.vocab_size,  # an --init-from model's table may hold more ids
    )
    prompt = _encode_prompt(cfg, tokenizer, model)
    rows = cfg.microbatches * cfg.data
    prompts = np.tile(prompt, (rows, 1))
    stream = TextStream(tokenizer, prompt, out)
    arrivals: list[float] = []

    def on_token(tokens: np.ndarray) -> None:
        arrivals.append(time.perf_counter())
        stream.add(int(tokens[0]))

    one_device = cfg.meshes * cfg.data == 1
    decode = generator.reference if one_device else generator
    started = time.perf_counter()
    tokens = decode(model, prompts, cfg.max_tokens, seed=cfg.seed, on_token=on_token)[0]
    seconds = time.perf_counter() - started
    stream.finish()
    where = "on one device (nnx.jit)" if one_device else f"pipelined over {layout}"
    print(
        f"nnx-mpmd generate: checkpoint step {step}; {_speed(started, arrivals)} {where}, "
        f"{rows} row(s)",
        file=err,
    )
    return {
        "step": step,
        "tokens": tokens,
        "text": tokenizer.decode(tokens),
        "seconds": seconds,
        "tokens_per_s": len(arrivals) / seconds,
    }


def _speed(started: float, arrivals: list[float]) -> str:
    """Tokens per second in words: overall, and after the first token (which compiles)."""
    total = arrivals[-1] - started
    text = f"{len(arrivals)} tokens in {total:.2f} s ({len(arrivals) / total:.1f} tokens/s"
    if len(arrivals) > 1:
        after = (len(arrivals) - 1) / max(arrivals[-1] - arrivals[0], 1e-9)
        text += (
            f"; the first after {arrivals[0] - started:.2f} s with compiling, then "
            f"{after:.1f} tokens/s"
        )
    return text + ")"


def _fail(message: str, err: IO[str]) -> int:
    print(f"nnx-mpmd generate: error: {message}", file=err)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``nnx-mpmd generate``: 0 on success, 2 on bad input (one line on stderr).

    Example:
      >>> main(["--run-dir", "/no/such/run", "--prompt", "x"])
      2
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    from nnx_mpmd.apps.train_args import set_cpu_devices
    from nnx_mpmd.errors import MpmdError

    try:
        cfg = config_from_args(argv)
        checkpoint_dir(cfg.run_dir)  # before JAX starts: a missing run fails fast
    except MpmdError as e:
        return _fail(str(e), sys.stderr)
    set_cpu_devices(cfg.devices)
    try:
        run(cfg)
    except MpmdError as e:
        return _fail(f"{type(e).__name__}: {e}", sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
