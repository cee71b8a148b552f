"""``nnx-mpmd bench``: pipelined steps side by side with the SPMD baselines.

For each GPT preset it measures, in one process on simulated CPU devices:

* (a) the `nnx_mpmd.jit` step for every registered schedule (skipping, with a
  note, schedules the runtime does not support yet),
* (b) the SPMD step users would otherwise write: ``nnx.jit`` with microbatched
  gradient accumulation, data-parallel over all devices,
* (c) the same microbatched step under ``nnx.jit`` on one device (on a machine
  whose simulated devices share a few cores, the no-overhead limit),

and reports median step times and ratios, time to first step, the runtime's
host overhead per task, measured vs simulated peak memory and bubble. Steps are
timed in interleaved rounds (a, b, c, a, b, c, ...) so that load from other
processes hits every variant alike.

Example:
    >>> from nnx_mpmd.apps.bench import parse_args
    >>> parse_args(["--presets", "tiny", "--rounds", "2"]).rounds
    2
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nnx_mpmd._jax_compat import config_value
from nnx_mpmd.apps.bench_probes import (
    Variant,
    block,
    measure_bubble,
    measure_memory,
    measure_overhead,
    median,
)

__all__ = ["BenchSettings", "main", "parse_args", "run_benchmarks"]

#: Schedules benchmarked by default: registry names with their parameters.
DEFAULT_SCHEDULES: tuple[str, ...] = (
    *("gpipe", "1f1b", "interleaved", "looped-bfs"),
    *("zb-h1", "zb-v", "dualpipev"),
)


@dataclasses.dataclass
class BenchSettings:
    """What to benchmark and how hard.

    Args:
      presets: GPT presets (``tiny``, ``small``).
      schedules: schedule registry names.
      num_meshes: pipeline submeshes (the stage axis).
      data: devices per submesh (the data axis).
      microbatches: microbatches of the timed steps.
      batch: global batch (sequences per step).
      seq: tokens per sequence.
      rounds: timed rounds (one step of every variant per round).
      warmup_rounds: untimed rounds before them.
      first_step_microbatches: microbatch counts of the time-to-first-step test.
      first_step_batch: global batch of that test.
      first_step_repeats: alternated repeats of that test (the fastest counts).
      overhead_repeats: replays of the no-op executor.

    Example:
      >>> BenchSettings(presets=("tiny",)).num_meshes
      4
    """

    presets: Sequence[str] = ("tiny", "small")
    schedules: Sequence[str] = DEFAULT_SCHEDULES
    num_meshes: int = 4
    data: int = 2
    microbatches: int = 8
    batch: int = 64
    seq: int = 32
    rounds: int = 7
    warmup_rounds: int = 1
    first_step_microbatches: Sequence[int] = (4, 32)
    first_step_batch: int = 64
    first_step_repeats: int = 2
    overhead_repeats: int = 20


def _setup_devices(count: int) -> None:
    """Asks for ``count`` simulated CPU devices; works until JAX's backend starts."""
    import jax

    from nnx_mpmd.errors import MeshError

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        if config_value("jax_num_cpu_devices") < count:
            jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # the backend already started: the check below explains
    if jax.device_count() < count:
        raise MeshError(
            f"nnx-mpmd bench needs {count} devices but JAX has {jax.device_count()} "
            f"({jax.default_backend()}); run it in a fresh process (before anything starts "
            "JAX's backend) with at least that many devices."
        )


def _model(preset: str, num_stages: int, n_layers: int, seed: int = 0) -> tuple[Any, Any]:
    import optax
    from flax import nnx

    from nnx_mpmd.models import build_model

    model = build_model(
        "gpt", preset, num_stages=num_stages, rngs=nnx.Rngs(seed), n_layers=n_layers
    )
    return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)


def _batches(settings: BenchSettings, batch: int, count: int, vocab: int) -> list[dict]:
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        tokens = rng.integers(0, vocab, (batch, settings.seq + 1)).astype(np.int32)
        out.append({"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])})
    return out


def _pipelined_fn() -> Callable[..., Any]:
    import nnx_mpmd as mp
    from nnx_mpmd.models import lm_loss

    def train_step(model, optimizer, batch):
        loss, grads = mp.value_and_grad(lm_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    return train_step


def _spmd_step(num_microbatches: int) -> Callable[..., Any]:
    """A fresh ``nnx.jit`` microbatched step (fresh, so nothing is cached)."""
    from flax import nnx

    import nnx_mpmd as mp
    from nnx_mpmd.models import lm_loss

    @nnx.jit
    def train_step(model, optimizer, batch):
        grad_fn = mp.value_and_grad(lm_loss, num_microbatches=num_microbatches)
        loss, grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        return loss

    return train_step


def _mpmd_mesh(settings: BenchSettings) -> Any:
    import jax

    import nnx_mpmd as mp

    devices = jax.devices()[: settings.num_meshes * settings.data]
    mesh = jax.make_mesh((settings.num_meshes, settings.data), ("stage", "data"), devices=devices)
    return mp.MpmdMesh(mesh, "stage")


def _put(tree: Any, sharding: Any) -> Any:
    import jax

    return jax.device_put(tree, sharding)


def _baselines(settings: BenchSettings, preset: str, n_layers: int, batches: list) -> list[Variant]:
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    m = settings.microbatches
    devices = settings.num_meshes * settings.data
    dp_mesh = jax.make_mesh(
        (devices,),
        ("data",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:devices],
    )
    model, opt = _model(preset, 1, n_layers)
    state = _put(nnx.state((model, opt)), NamedSharding(dp_mesh, P()))
    nnx.update((model, opt), state)
    dp_batches = [_put(b, NamedSharding(dp_mesh, P("data"))) for b in batches]
    one_device = jax.devices()[0]
    model1, opt1 = _model(preset, 1, n_layers)
    nnx.update((model1, opt1), _put(nnx.state((model1, opt1)), one_device))
    one_batches = [_put(b, one_device) for b in batches]
    return [
        Variant(f"spmd-dp{devices}", _spmd_step(m), (model, opt), dp_batches),
        Variant("one-device", _spmd_step(m), (model1, opt1), one_batches),
    ]


def _unsupported(error: Exception) -> bool:
    text = str(error).lower()
    return "not" in text and ("support" in text or "does not have" in text)


def _pipelined(settings: BenchSettings, preset: str, name: str, batches: list) -> Any:
    """``(variant, n_layers)`` for schedule ``name``, or a skip note string."""
    import nnx_mpmd as mp
    from nnx_mpmd.models.presets import GPT_PRESETS
    from nnx_mpmd.schedules import get_schedule

    schedule = get_schedule(name)
    num_stages = schedule.default_num_stages(settings.num_meshes)
    n_layers = max(GPT_PRESETS[preset]["n_layers"], num_stages)
    model, opt = _model(preset, num_stages, n_layers)
    step = mp.jit(
        _pipelined_fn(),
        mesh=_mpmd_mesh(settings),
        schedule=schedule,
        num_microbatches=settings.microbatches,
    )
    variant = Variant(name, step, (model, opt), batches)
    try:
        variant.first()
    except mp.MpmdError as e:
        first_line = str(e).splitlines()[0]
        return f"{'skipped' if _unsupported(e) else 'not run'}: {first_line}"
    variant.num_stages = num_stages  # type: ignore[attr-defined]
    return variant, n_layers


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, JAX version and load of this machine, as a JSON-able dict.

    Example:
      >>> "cores" in machine_info()
      True
    """
    import jax

    cpu = platform.processor() or platform.machine()
    memory_gib = float("nan")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory_gib = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    return {
        "hostname": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def _first_step_scaling(settings: BenchSettings, preset: str) -> dict[str, Any]:
    import nnx_mpmd as mp
    from nnx_mpmd.models.presets import GPT_PRESETS

    n_layers = GPT_PRESETS[preset]["n_layers"]
    vocab = GPT_PRESETS[preset]["vocab_size"]
    batches = _batches(settings, settings.first_step_batch, 1, vocab)
    samples: dict[str, list[float]] = {str(m): [] for m in settings.first_step_microbatches}
    # Alternated (4, 32, 4, 32, ...) and the fastest kept: one sample each would
    # compare two moments of a machine whose speed drifts.
    for _ in range(settings.first_step_repeats):
        for m in settings.first_step_microbatches:
            model, opt = _model(preset, settings.num_meshes, n_layers)
            step = mp.jit(
                _pipelined_fn(),
                mesh=_mpmd_mesh(settings),
                schedule=mp.OneFOneB(),
                num_microbatches=m,
            )
            variant = Variant(f"1f1b m={m}", step, (model, opt), batches)
            variant.first()
            samples[str(m)].append(variant.first_step_s)
    out: dict[str, Any] = {m: min(times) for m, times in samples.items()}
    counts = list(samples)
    out["ratio"] = out[counts[-1]] / out[counts[0]]
    out["samples_s"] = samples
    return out


def _out_of_memory(error: Exception) -> bool:
    """Whether ``error`` is XLA running out of device memory (not a bug to raise)."""
    import jax

    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def _probes(variant: Variant, settings: BenchSettings) -> dict[str, Any]:
    """The overhead, memory and bubble probes of one pipelined variant.

    A probe running out of device memory is recorded as ``{"error": ...}`` (shown ``OOM``)
    and the step times kept; other errors are raised.
    """
    probes = {
        "overhead": lambda: measure_overhead(variant, settings.overhead_repeats),
        "memory": lambda: measure_memory(variant),
        "bubble": lambda: measure_bubble(variant),
    }
    out: dict[str, Any] = {}
    for name, probe in probes.items():
        try:
            out[name] = probe()
        except Exception as error:
            if not _out_of_memory(error):
                raise
            out[name] = {"error": str(error).splitlines()[0][:200]}
    return out


def _preset_report(settings: BenchSettings, preset: str, log: Callable[[str], None]) -> dict:
    from nnx_mpmd.models.presets import GPT_PRESETS

    vocab = GPT_PRESETS[preset]["vocab_size"]
    batches = _batches(settings, settings.batch, 3, vocab)
    pipelined: dict[str, Variant] = {}
    notes: dict[str, str] = {}
    layers_of: dict[str, int] = {}
    for name in settings.schedules:
        log(f"[{preset}] compiling {name}")
        result = _pipelined(settings, preset, name, batches)
        if isinstance(result, str):
            notes[name] = result
            log(f"[{preset}] {name}: {result}")
            continue
        pipelined[name], layers_of[name] = result
    baselines: dict[int, list[Variant]] = {}
    for n_layers in sorted(set(layers_of.values())):
        log(f"[{preset}] compiling baselines with {n_layers} layers")
        baselines[n_layers] = _baselines(settings, preset, n_layers, batches)
        for variant in baselines[n_layers]:
            variant.first()
    everything = list(pipelined.values()) + [v for vs in baselines.values() for v in vs]
    # One untimed round first: the second call of a step still allocates its buffers
    # for the first time (and GPipe's first steady step was 1.7x its median).
    for r in range(settings.warmup_rounds + settings.rounds):
        log(f"[{preset}] round {r + 1}/{settings.warmup_rounds + settings.rounds}")
        if r == settings.warmup_rounds:
            for variant in everything:
                variant.clear()
        for variant in everything:
            variant.once(r)
    rows: dict[str, Any] = {}
    for n_layers, (spmd, one) in baselines.items():
        for v in (spmd, one):
            rows[f"{v.name} ({n_layers} layers)"] = {**v.summary(), "n_layers": n_layers}
    for name, v in pipelined.items():
        spmd, one = baselines[layers_of[name]]
        log(f"[{preset}] {name}: overhead, memory, bubble")
        rows[name] = {
            **v.summary(),
            "n_layers": layers_of[name],
            "num_stages": v.num_stages,  # type: ignore[attr-defined]
            "ratio_vs_one_device": median(v.times) / median(one.times),
            "ratio_vs_spmd": median(v.times) / median(spmd.times),
            "first_step_ratio_vs_one_device": v.first_step_s / one.first_step_s,
            **_probes(v, settings),
        }
    log(f"[{preset}] time to first step at {list(settings.first_step_microbatches)} microbatches")
    return {
        "rows": rows,
        "skipped": notes,
        "first_step_scaling": _first_step_scaling(settings, preset),
    }


def run_benchmarks(
    settings: BenchSettings, log: Callable[[str], None] = lambda s: None
) -> dict[str, Any]:
    """Runs every measurement of ``settings``; returns the JSON-able report (``log`` gets progress).

    Example:
      >>> callable(run_benchmarks)
      True
    """
    _setup_devices(settings.num_meshes * settings.data)
    import jax.numpy as jnp

    block(jnp.ones(4) + 1)  # start the backend outside any measurement
    _warm_up(settings)
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_info(),
        "settings": dataclasses.asdict(settings),
        "presets": {},
    }
    for preset in settings.presets:
        report["presets"][preset] = _preset_report(settings, preset, log)
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return report


def _warm_up_settings(settings: BenchSettings) -> BenchSettings:
    """The settings of the warm-up step: sequences no longer than ``tiny``'s ``max_len``.

    Example:
      >>> _warm_up_settings(BenchSettings(seq=256)).seq
      64
    """
    from nnx_mpmd.models.presets import GPT_PRESETS

    return dataclasses.replace(settings, seq=min(settings.seq, GPT_PRESETS["tiny"]["max_len"]))


def _warm_up(settings: BenchSettings) -> None:
    """Runs one tiny pipelined and one tiny ``nnx.jit`` step before measuring.

    JAX and Flax do one-time work on their first trace and compile (lowering
    rule tables, caches); without this, whichever variant is compiled first
    would be charged for it in its time to first step.
    """
    import jax

    import nnx_mpmd as mp

    batch = _batches(_warm_up_settings(settings), 2 * settings.num_meshes, 1, 256)[0]
    model, opt = _model("tiny", settings.num_meshes, max(4, settings.num_meshes))
    step = mp.jit(
        _pipelined_fn(), mesh=_mpmd_mesh(settings), schedule=mp.OneFOneB(), num_microbatches=2
    )
    block((step(model, opt, batch), (model, opt)))
    model, opt = _model("tiny", 1, 4)
    block((_spmd_step(2)(model, opt, _put(batch, jax.devices()[0])), (model, opt)))


def _fmt_bytes(values: Sequence[int]) -> str:
    return "/".join(f"{v / 2**20:.1f}" for v in values)


def _cpu_columns(row: dict[str, Any]) -> str:
    if "host_cpu_ms" not in row:  # a report written before these were measured
        return " | "
    return f"{row['host_cpu_ms']:.0f} | {row['process_cpu_s']:.2f}"


def _probe_columns(row: dict[str, Any]) -> str:
    """The µs/task, dispatch, bubble and activation columns; ``OOM`` where a probe ran out."""
    o, b, mem = row["overhead"], row["bubble"], row["memory"]
    columns = [
        "OOM" if "error" in o else f"{o['us_per_task']:.0f}",
        "OOM" if "error" in o else f"{o['dispatch_us_per_task']:.0f}",
        "OOM" if "error" in b else f"{b['measured_bubble']:.2f}/{b['simulated_bubble']:.2f}",
        "OOM"
        if "error" in mem
        else f"{_fmt_bytes(mem['activation_peak_bytes'])} vs "
        f"{_fmt_bytes(mem['predicted_activation_bytes'])}",
    ]
    return " | ".join(columns)


def format_markdown(report: dict[str, Any]) -> str:
    """A `run_benchmarks` report as Markdown tables (one section per preset).

    Example:
      >>> format_markdown({"machine": {}, "settings": {}, "presets": {}}).startswith("Machine")
      True
    """
    m, s = report["machine"], report["settings"]
    lines = [
        f"Machine: {m.get('cpu')}, {m.get('cores')} cores, {m.get('memory_gib')} GiB, "
        f"jax {m.get('jax')} ({m.get('backend')}, {m.get('devices')} devices); load average "
        f"{m.get('load_average')} before, {report.get('load_average_after')} after.",
        f"Settings: {s.get('num_meshes')} meshes x {s.get('data')} data, "
        f"{s.get('microbatches')} microbatches, batch {s.get('batch')} x {s.get('seq')} tokens, "
        f"{s.get('rounds')} interleaved rounds after {s.get('warmup_rounds', 0)} untimed "
        "(medians).",
        "",
    ]
    for preset, p in report["presets"].items():
        lines += [
            f"#### GPT `{preset}`",
            "",
            "| step | layers | median ms | (a)/(c) | (a)/(b) | first step s | first/(c) "
            "| host CPU ms | CPU s/step | µs/task (no-op) | dispatch µs/task | bubble meas/sim "
            "| act. MiB meas/pred (per mesh) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, r in p["rows"].items():
            if "overhead" not in r:
                lines.append(
                    f"| {name} | {r['n_layers']} | {r['median_s'] * 1e3:.1f} | | | "
                    f"{r['first_step_s']:.2f} | | {_cpu_columns(r)} | | | | |"
                )
                continue
            lines.append(
                f"| {name} | {r['n_layers']} | {r['median_s'] * 1e3:.1f} | "
                f"{r['ratio_vs_one_device']:.2f} | {r['ratio_vs_spmd']:.2f} | "
                f"{r['first_step_s']:.2f} | {r['first_step_ratio_vs_one_device']:.2f} | "
                f"{_cpu_columns(r)} | {_probe_columns(r)} |"
            )
        for name, note in p["skipped"].items():
            lines.append(f"| {name} | | {note} | | | | | | | | | | |")
        fs = p["first_step_scaling"]
        counts = [k for k in fs if k not in ("ratio", "samples_s")]
        lines += [
            "",
            "Time to first step (1F1B, fastest of alternated repeats): "
            + ", ".join(f"m={k}: {fs[k]:.2f} s" for k in counts)
            + f" (ratio {fs['ratio']:.2f}).",
            "",
        ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Reads the command line of ``nnx-mpmd bench`` (the arguments after ``bench``).

    Example:
      >>> parse_args([]).presets
      'tiny,small'
    """
    d = BenchSettings()
    parser = argparse.ArgumentParser(
        prog="nnx-mpmd bench",
        description="Pipelined steps side by side with the SPMD baselines.",
    )
    parser.add_argument("--presets", default=",".join(d.presets), help="GPT presets")
    parser.add_argument("--schedules", default=",".join(d.schedules), help="schedule names")
    parser.add_argument("--num-meshes", type=int, default=d.num_meshes, help="pipeline meshes")
    parser.add_argument("--data", type=int, default=d.data, help="devices per mesh")
    parser.add_argument("--microbatches", type=int, default=d.microbatches)
    parser.add_argument("--batch", type=int, default=d.batch, help="global batch")
    parser.add_argument("--seq", type=int, default=d.seq, help="tokens per sequence")
    parser.add_argument("--rounds", type=int, default=d.rounds, help="timed rounds")
    parser.add_argument(
        "--warmup-rounds", type=int, default=d.warmup_rounds, help="untimed rounds first"
    )
    parser.add_argument(
        "--first-step-microbatches", default=",".join(map(str, d.first_step_microbatches))
    )
    parser.add_argument("--first-step-batch", type=int, default=d.first_step_batch)
    parser.add_argument("--first-step-repeats", type=int, default=d.first_step_repeats)
    parser.add_argument("--overhead-repeats", type=int, default=d.overhead_repeats)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
    parser.add_argument("--markdown", default=None, help="also write the tables to this file")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser.parse_args(list(argv))


def _settings(args: argparse.Namespace) -> BenchSettings:
    def names(text: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in text.split(",") if x.strip())

    return BenchSettings(
        presets=names(args.presets),
        schedules=names(args.schedules),
        num_meshes=args.num_meshes,
        data=args.data,
        microbatches=args.microbatches,
        batch=args.batch,
        seq=args.seq,
        rounds=args.rounds,
        warmup_rounds=args.warmup_rounds,
        first_step_microbatches=tuple(int(x) for x in names(args.first_step_microbatches)),
        first_step_batch=args.first_step_batch,
        first_step_repeats=args.first_step_repeats,
        overhead_repeats=args.overhead_repeats,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``nnx-mpmd bench``: runs, prints the tables, writes JSON; returns the status.

    Example:
      >>> main(["--help"])  # doctest: +SKIP
    """
    args = parse_args(sys.argv[2:] if argv is None else argv)
    settings = _settings(args)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    report = run_benchmarks(settings, log)
    text = format_markdown(report)
    print(text)
    out = args.out
    if out is None:
        host = report["machine"]["hostname"] or "machine"
        out = f"benchmarks/results/{report['date']}-{host}.json"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    log(f"wrote {out}")
    return 0
