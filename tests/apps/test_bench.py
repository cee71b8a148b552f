"""The benchmark runner (tiny settings, no timing asserts) and the memory recorder."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_mpmd as mp
from nnx_mpmd.apps import bench
from nnx_mpmd.models import build_model, lm_loss
from nnx_mpmd.runtime.executor import MemoryRecorder


def _lm_step(schedule, num_microbatches: int, *, batch: int = 32, seq: int = 32):
    model = build_model("gpt", "tiny", num_stages=4, rngs=nnx.Rngs(0))
    # Learning rate 0: every call sees the same parameters, so losses compare exactly.
    opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    mesh = mp.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")

    def train_step(model, optimizer, batch):
        loss, grads = mp.value_and_grad(lm_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    step = mp.jit(train_step, mesh=mesh, schedule=schedule, num_microbatches=num_microbatches)
    tokens = np.random.default_rng(0).integers(0, 256, (batch, seq + 1)).astype(np.int32)
    data = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
    return step, (model, opt, data)


@pytest.fixture(scope="module")
def memory_by_schedule():
    out = {}
    for name, schedule in (("gpipe", mp.GPipe()), ("1f1b", mp.OneFOneB())):
        step, args = _lm_step(schedule, 8)
        recorded = step(*args, memory=True, profile=True)
        out[name] = step.last_memory
        out[name + " losses"] = (float(recorded), float(step(*args)))
        out[name + " profile"] = step.last_profile
    return out


def test_one_f_one_b_holds_fewer_live_bytes_than_gpipe_on_mesh_0(memory_by_schedule):
    gpipe, one_f_one_b = memory_by_schedule["gpipe"], memory_by_schedule["1f1b"]
    assert one_f_one_b["peak_bytes"][0] < gpipe["peak_bytes"][0]
    # Both start from the same placed state.
    assert one_f_one_b["initial_bytes"] == gpipe["initial_bytes"]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_memory_timeline_has_every_mesh_and_peaks_above_start(memory_by_schedule, name):
    memory = memory_by_schedule[name]
    assert len(memory["peak_bytes"]) == 4
    assert all(p >= i > 0 for p, i in zip(memory["peak_bytes"], memory["initial_bytes"]))
    labels = [label for _, label, _ in memory["timeline"]]
    assert labels[0] == "start" and "F0.0" in labels
    # Forward tasks report what they keep (sends and residuals).
    assert any(
        label == "F0.0" and nbytes > 0 for _, label, _, nbytes in memory["task_output_bytes"]
    )


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_memory_mode_gives_the_same_loss_as_the_fast_path(memory_by_schedule, name):
    recorded, fast = memory_by_schedule[name + " losses"]
    assert np.isfinite(recorded)
    np.testing.assert_allclose(fast, recorded, rtol=1e-6)
    assert {r[1] for r in memory_by_schedule[name + " profile"]} >= {"F0.0", "B0.7"}


def test_memory_recorder_counts_each_array_once_per_mesh():
    devices = jax.devices()
    meshes = [jax.make_mesh((2,), ("d",), devices=devices[2 * q : 2 * q + 2]) for q in range(2)]
    sharded = jax.device_put(jnp.zeros((8,), jnp.float32), jax.NamedSharding(meshes[1], jax.P("d")))
    replicated = jax.device_put(jnp.zeros((4,), jnp.float32), jax.NamedSharding(meshes[0], jax.P()))
    recorder = MemoryRecorder(meshes)
    recorder.record(-1, "start", [sharded, (replicated, sharded), None, 3])
    assert recorder.peak_bytes == [16, 16]  # per device: 4 floats replicated, 8 split in 2
    deleted = jax.device_put(jnp.ones((4,), jnp.float32), jax.NamedSharding(meshes[0], jax.P()))
    deleted.delete()
    recorder.record(0, "after", [deleted])
    assert recorder.summary()["timeline"][1][2] == [0, 0]


def test_runner_smoke_writes_json_and_tables(tmp_path, capsys):
    out = tmp_path / "result.json"
    table = tmp_path / "table.md"
    argv = [
        "--presets=tiny",
        "--schedules=1f1b",
        "--microbatches=4",
        "--batch=8",
        "--seq=8",
        "--rounds=2",
        "--warmup-rounds=1",
        "--first-step-microbatches=4",
        "--first-step-batch=8",
        "--first-step-repeats=1",
        "--overhead-repeats=2",
        f"--out={out}",
        f"--markdown={table}",
        "--quiet",
    ]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    preset = report["presets"]["tiny"]
    row = preset["rows"]["1f1b"]
    assert row["overhead"]["stage_tasks"] > 0 and row["overhead"]["us_per_task"] > 0
    assert len(row["memory"]["peak_bytes"]) == 4
    assert len(row["times_s"]) == 2 and report["settings"]["warmup_rounds"] == 1
    assert row["host_cpu_ms"] > 0 and row["process_cpu_s"] > 0
    assert preset["rows"]["one-device (4 layers)"]["host_cpu_ms"] > 0
    assert 0 <= row["bubble"]["simulated_bubble"] < 1
    assert {"spmd-dp8 (4 layers)", "one-device (4 layers)"} <= set(preset["rows"])
    assert set(preset["first_step_scaling"]) == {"4", "ratio", "samples_s"}
    assert "| 1f1b |" in table.read_text() and "#### GPT `tiny`" in capsys.readouterr().out


@pytest.mark.parametrize(
    "text, expected",
    [
        ("task kind BW needs the split-backward runtime, which this build does not have yet", True),
        ("ZeroBubbleV is not supported yet", True),
        ("needs at least 8 microbatches; use more microbatches", False),
    ],
)
def test_unsupported_schedules_are_recognised(text, expected):
    assert bench._unsupported(mp.CompileError(text)) is expected


def test_format_markdown_lists_skipped_schedules():
    report = {
        "machine": {"cpu": "cpu", "cores": 2},
        "settings": {"microbatches": 8},
        "presets": {
            "tiny": {
                "rows": {},
                "skipped": {"zb-v": "skipped: not supported yet"},
                "first_step_scaling": {"4": 1.0, "32": 1.1, "ratio": 1.1},
            }
        },
    }
    text = bench.format_markdown(report)
    assert "| zb-v | | skipped: not supported yet |" in text
    assert "m=32: 1.10 s (ratio 1.10)" in text


def test_setup_devices_refuses_too_many_devices():
    with pytest.raises(mp.MeshError, match="needs 64 devices but JAX has 8"):
        bench._setup_devices(64)


def test_mesh_shape_comes_from_the_command_line():
    settings = bench._settings(bench.parse_args(["--num-meshes=2", "--data=1", "--rounds=3"]))
    assert (settings.num_meshes, settings.data, settings.rounds) == (2, 1, 3)
    assert settings.warmup_rounds == bench.BenchSettings().warmup_rounds


def test_warm_up_uses_sequences_the_tiny_model_accepts():
    # `--seq 256` for a preset with a longer max_len must not break the tiny warm-up step.
    settings = bench._settings(bench.parse_args(["--seq=256", "--presets=gpt2-124m"]))
    assert bench._warm_up_settings(settings).seq == 64
    assert bench._warm_up_settings(bench.BenchSettings(seq=16)).seq == 16


def _probe_settings():
    return bench._settings(bench.parse_args(["--overhead-repeats=1"]))


def test_a_probe_out_of_device_memory_is_recorded_not_raised(monkeypatch):
    def out_of_memory(*args):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 24.00MiB")

    monkeypatch.setattr(bench, "measure_overhead", out_of_memory)
    monkeypatch.setattr(bench, "measure_memory", lambda v: {"m": 1})
    monkeypatch.setattr(bench, "measure_bubble", lambda v: {"b": 2})
    probes = bench._probes(object(), _probe_settings())
    assert probes["overhead"] == {"error": "RESOURCE_EXHAUSTED: Out of memory allocating 24.00MiB"}
    assert probes["memory"] == {"m": 1} and probes["bubble"] == {"b": 2}


def test_a_probe_failing_for_another_reason_raises(monkeypatch):
    def broken(*args):
        raise jax.errors.JaxRuntimeError("INVALID_ARGUMENT: buffer was deleted")

    monkeypatch.setattr(bench, "measure_overhead", broken)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INVALID_ARGUMENT"):
        bench._probes(object(), _probe_settings())


def test_format_markdown_marks_probes_that_ran_out_of_memory():
    row = {
        "n_layers": 12,
        "median_s": 0.15,
        "ratio_vs_one_device": 1.07,
        "ratio_vs_spmd": 1.07,
        "first_step_s": 26.0,
        "first_step_ratio_vs_one_device": 1.69,
        "overhead": {"error": "RESOURCE_EXHAUSTED: Out of memory"},
        "memory": {"activation_peak_bytes": [2**20], "predicted_activation_bytes": [2**20]},
        "bubble": {"error": "RESOURCE_EXHAUSTED: Out of memory"},
    }
    report = {
        "machine": {},
        "settings": {},
        "presets": {
            "gpt2-124m": {
                "rows": {"gpipe": row},
                "skipped": {},
                "first_step_scaling": {"8": 15.4, "ratio": 1.0},
            }
        },
    }
    text = bench.format_markdown(report)
    assert (
        "| gpipe | 12 | 150.0 | 1.07 | 1.07 | 26.00 | 1.69 |  |  | OOM | OOM | OOM | 1.0 vs 1.0 |"
        in text
    )


def _schedule_probe_settings():
    # Two meshes of one device and 4 microbatches: the smallest step every schedule takes.
    argv = ["--num-meshes=2", "--data=1", "--microbatches=4", "--batch=8", "--seq=8"]
    return bench._settings(bench.parse_args([*argv, "--overhead-repeats=1"]))


@pytest.mark.parametrize("name", list(mp.schedules.SCHEDULES))
def test_probes_run_on_every_registered_schedule(name):
    settings = _schedule_probe_settings()
    batches = bench._batches(settings, settings.batch, 1, 256)
    result = bench._pipelined(settings, "tiny", name, batches)
    assert not isinstance(result, str), result
    variant, _ = result
    probes = bench._probes(variant, settings)
    assert probes["overhead"]["stage_tasks"] > 0 and probes["overhead"]["us_per_task"] > 0
    assert len(probes["memory"]["peak_bytes"]) == 2
    assert all(p > 0 for p in probes["memory"]["peak_activations"])
    assert 0 <= probes["bubble"]["measured_bubble"] < 1
    assert 0 <= probes["bubble"]["simulated_bubble"] < 1
    # Every stage's forward and backward (whole, split or inside a pair) has a measured time.
    stages = variant.num_stages
    costs = probes["bubble"]["stage_costs_ms"]
    assert sorted(costs) == [str(s) for s in range(stages)]
    assert all("F" in c and ("B" in c or {"BI", "BW"} <= set(c)) for c in costs.values())


def test_task_durations_split_overlapped_programs_among_their_tasks():
    from nnx_mpmd.apps.bench_probes import task_durations
    from nnx_mpmd.schedules.tasks import Task

    pair = (Task(3, 1, "F", with_next=True), Task(0, 0, "BI", with_next=True), Task(0, 0, "BW"))
    records = [
        (0, "F0.0", Task(0, 0, "F"), 0.0, 1.0),
        (0, "F3.1+BI0.0+BW0.0", pair, 1.0, 4.0),
        (1, "FB1.0", Task(1, 0, "B"), 0.0, 3.0),
        (0, "update", None, 4.0, 5.0),
    ]
    assert task_durations(records) == {
        (0, "F"): [1.0],
        (3, "F"): [1.0],
        (0, "BI"): [1.0],
        (0, "BW"): [1.0],
        (1, "FB"): [3.0],
    }
