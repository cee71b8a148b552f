"""`plan`: profile the units on the real devices, search, and return a `Plan`.

A `Plan` is the chosen configuration (schedule, stage count, microbatches,
the stage of every unit, remat per stage), its predicted step time and peak
memory per device, and the runners-up. It saves to JSON (``nnx-mpmd train
--plan FILE`` loads it), applies itself to a model (`Plan.apply`), builds the
schedule (`Plan.schedule`), and `verify` runs the top configurations and
reports predicted against measured (`nnx_mpmd.planner.verification`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
import optax
from flax import nnx

from nnx_mpmd.annotate.scan_stack import ScanStack, stage_ranges
from nnx_mpmd.annotate.stage import Stage
from nnx_mpmd.errors import PlanError
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.planner.profile_units import UnitCosts, profile_units
from nnx_mpmd.planner.search import Candidate, search
from nnx_mpmd.planner.spmd import (
    SPMD_KINDS,
    LinkCosts,
    SpmdCandidate,
    measure_link,
    spmd_candidates,
)
from nnx_mpmd.planner.units import restage
from nnx_mpmd.schedules import Schedule, get_schedule

if TYPE_CHECKING:
    from nnx_mpmd.planner.verification import Verification

__all__ = ["Plan", "plan"]

_FORMAT = "nnx-mpmd-plan/1"


@dataclasses.dataclass(frozen=True)
class Plan:
    """A chosen pipeline configuration, its prediction, and the runners-up.

    Attributes:
      best: the fastest predicted configuration that fits.
      runners_up: the next ones, fastest first.
      unit_paths: the units' paths, in call order (``best.unit_stages`` follows it).
      num_meshes: the meshes it is planned for.
      batch_size: rows per step.
      memory_budget: bytes per device it had to fit (None: no limit).
      costs: the measured unit costs it was planned with.
      measured: measured step seconds of configurations run by `verify`
        (`Plan.with_measurements`), as ``(candidate, seconds)`` pairs.
      calibration: measured / predicted step time, the median over
        ``measured`` (1.0 before any measurement). The simulator assumes
        meshes that do not share compute and a host that is never late; this
        factor is what that costs on this machine.
      donate: whether the predicted peaks assume a step that donates the
        model's and optimizer's state (``mp.jit(donate_argnums=(0, 1))``, as
        ``nnx-mpmd train`` does); `verify` runs the step so.
      model: the class name of the model it was planned for (`Plan.apply`
        refuses another); None in plans written before it was recorded.
      spmd: the SPMD alternatives on the same devices (data parallel and
        FSDP over all of them, with microbatch accumulation), fastest
        predicted first (`nnx_mpmd.planner.spmd`); ranked with the pipelined
        configurations by `ranking`, compared by `verdict`.
      spmd_measured: measured step seconds of SPMD alternatives run by
        `verify`, as ``(candidate, seconds)`` pairs.
      link: the measured cost of a collective over all devices, the SPMD
        predictions' communication (None: not measured).
      spmd_calibration: measured / predicted step time of the SPMD
        alternatives `verify` ran (the median); None: none ran, and their
        predictions are scaled by ``calibration``. The two cost models miss
        different things (a pipeline's dispatch per task, XLA's overlap of
        collectives), so each is calibrated on its own runs.

    Example:
      >>> best = Candidate("1f1b", 2, 4, (0, 1), (False, False), 0.5, (10, 10))
      >>> p = Plan(best, (), ("a", "b"), 2, 8)
      >>> Plan.from_json(p.to_json()) == p, p.schedule()
      (True, OneFOneB())
    """

    best: Candidate
    runners_up: tuple[Candidate, ...]
    unit_paths: tuple[str, ...]
    num_meshes: int
    batch_size: int
    memory_budget: int | None = None
    costs: tuple[UnitCosts, ...] = ()
    measured: tuple[tuple[Candidate, float], ...] = ()
    calibration: float = 1.0
    donate: bool = False
    model: str | None = None
    spmd: tuple[SpmdCandidate, ...] = ()
    spmd_measured: tuple[tuple[SpmdCandidate, float], ...] = ()
    link: LinkCosts | None = None
    spmd_calibration: float | None = None

    @property
    def num_stages(self) -> int:
        """The best configuration's stage count."""
        return self.best.num_stages

    @property
    def num_microbatches(self) -> int:
        """The best configuration's microbatch count."""
        return self.best.num_microbatches

    def schedule(self) -> Schedule:
        """The best configuration's schedule object."""
        return get_schedule(self.best.schedule)

    def apply(self, model: Any, candidate: Candidate | None = None) -> Any:
        """Renumbers ``model``'s `Stage` wrappers (and remat flags) as planned.

        A `ScanStack` at ``path`` stands for the planned units ``path.0``,
        ``path.1``, ...: a plan made on an unrolled model (one `Stage` per
        block) applies to its scanned twin by cutting the stack into the
        planned ranges of layers.

        Args:
          model: a model with the planned units (the same architecture).
          candidate: the configuration to apply (default: ``best``).

        Returns:
          ``model``, changed in place.

        Raises:
          PlanError: the plan was made for another model class, or a planned
            unit path is not a `Stage` of ``model`` (nor a layer of one of its
            `ScanStack`s).
        """
        self.check_model(model)
        chosen = candidate or self.best
        stages = {
            ".".join(map(str, p)): n for p, n in nnx.iter_graph(model) if isinstance(n, Stage)
        }
        stacks = {
            ".".join(map(str, p)): n for p, n in nnx.iter_graph(model) if isinstance(n, ScanStack)
        }
        units: list[tuple[str, Stage]] = []
        unit_stages: list[int] = []
        i = 0
        while i < len(self.unit_paths):
            path = self.unit_paths[i]
            if path in stages:
                units.append((path, stages[path]))
                unit_stages.append(chosen.unit_stages[i])
                i += 1
                continue
            stack_path = self._stack_of(path, stacks, stages, model)
            stack = stacks[stack_path]
            layer_stages = chosen.unit_stages[i : i + stack.num_layers]
            stack.split(stage_ranges(layer_stages))
            for k, chunk in enumerate(stack.chunks):
                chunk = cast(Stage, chunk)  # split: every chunk is a Stage
                units.append((f"{stack_path}.chunks.{k}", chunk))
                unit_stages.append(chunk.stage)
            i += stack.num_layers
        restage(units, unit_stages, chosen.remat)
        return model

    def check_model(self, model: Any) -> None:
        """Refuses ``model`` when the plan was made for another model class.

        A plan with no recorded model is accepted with a warning.

        Args:
          model: the model the plan is about to be applied to.

        Raises:
          PlanError: ``model`` is not of the class the plan was made for.

        Example:
          >>> best = Candidate("1f1b", 1, 1, (0,), (False,), 0.5, (10,))
          >>> Plan(best, (), ("a",), 1, 8, model="GPT").check_model(object())
          Traceback (most recent call last):
          ...
          nnx_mpmd.errors.PlanError: the plan was made for a GPT model, not for object; ...
        """
        name = type(model).__name__
        if self.model is None:
            warnings.warn(
                f"the plan does not say which model it was made for (written by an older "
                f"nnx-mpmd); applying it to {name} unchecked. Plan again to record the model.",
                stacklevel=3,
            )
        elif self.model != name:
            raise PlanError(
                f"the plan was made for a {self.model} model, not for {name}; its split and "
                f"costs do not carry over. Plan the {name} model (`nnx-mpmd plan` with its "
                "--model), or apply the plan to the model it was made for."
            )

    def _stack_of(
        self, path: str, stacks: dict[str, ScanStack], stages: dict[str, Stage], model: Any
    ) -> str:
        """The `ScanStack` whose layers the units from ``path`` on are, or a `PlanError`."""
        stack_path, _, layer = path.rpartition(".")
        stack = stacks.get(stack_path)
        if stack is not None and layer == "0":
            layers = tuple(f"{stack_path}.{j}" for j in range(stack.num_layers))
            start = self.unit_paths.index(path)
            if self.unit_paths[start : start + len(layers)] == layers:
                return stack_path
            raise PlanError(
                f"the plan has the units {list(self.unit_paths[start : start + 3])}..., but "
                f"the ScanStack at {stack_path!r} of {type(model).__name__} has "
                f"{stack.num_layers} layers; plan a model with as many blocks."
            )
        known = sorted(stages) + [f"{p} (ScanStack)" for p in sorted(stacks)]
        raise PlanError(
            f"the plan moves the Stage wrapper {path!r}, which {type(model).__name__} "
            f"does not have (its Stage paths: {known[:6]}); apply the plan to the "
            "model architecture it was made for."
        )

    def ranking(self) -> list[tuple[Candidate | SpmdCandidate, float, bool]]:
        """The pipelined configurations and the SPMD alternatives, ranked together.

        Measured ones (`verify`) first, fastest first; then by calibrated predicted step time.

        Returns:
          ``(candidate, seconds, measured)`` triples: a `Candidate` or an
          `nnx_mpmd.planner.spmd.SpmdCandidate`, its measured or calibrated
          predicted step seconds, and whether they were measured.

        Example:
          >>> best = Candidate("1f1b", 1, 1, (0,), (False,), 0.5, (10,))
          >>> dp = SpmdCandidate("dp", 2, 1, 0.25, (10,))
          >>> [seconds for _, seconds, _ in Plan(best, (), ("a",), 1, 8, spmd=(dp,)).ranking()]
          [0.25, 0.5]
        """
        measured = {**dict(self.measured), **dict(self.spmd_measured)}
        everything = (self.best, *self.runners_up, *self.spmd)
        ran = sorted((c for c in everything if c in measured), key=lambda c: measured[c])
        rest = sorted(
            (
                (c, c.step_s * self._calibration_of(c), False)
                for c in everything
                if c not in measured
            ),
            key=lambda r: r[1],
        )
        return [(c, measured[c], True) for c in ran] + rest

    def _calibration_of(self, c: Candidate | SpmdCandidate) -> float:
        if isinstance(c, SpmdCandidate) and self.spmd_calibration is not None:
            return self.spmd_calibration
        return self.calibration

    def verdict(self) -> str:
        """One line: whether pipelining pays against the best SPMD alternative, and by how much.

        The first pipelined configuration and the first SPMD alternative of
        `ranking` are compared, measured where `verify` ran them.

        Example:
          >>> best = Candidate("1f1b", 4, 8, (0, 1, 2, 3), (False,) * 4, 0.1, (10,) * 4)
          >>> fsdp = SpmdCandidate("fsdp", 8, 2, 0.18, (10,))
          >>> Plan(best, (), ("a", "b", "c", "d"), 4, 32, spmd=(fsdp,)).verdict()
          'pipelining pays: 1f1b with 4 stages, m=8 is 1.80x faster than the best SPMD (FSDP over 8 devices, m=2) (both predicted)'
        """
        ranked = self.ranking()
        pipes = [r for r in ranked if isinstance(r[0], Candidate)]
        alternatives = [r for r in ranked if isinstance(r[0], SpmdCandidate)]
        if not alternatives:
            return (
                "no SPMD alternative was profiled (plan with spmd=True, or nnx-mpmd plan without "
                "--no-spmd, to learn whether pipelining pays)"
            )
        (pipe, pipe_s, pipe_ran), (alt, alt_s, alt_ran) = pipes[0], alternatives[0]
        pipe, alt = cast(Candidate, pipe), cast(SpmdCandidate, alt)  # as filtered above
        basis = {
            (True, True): "both measured",
            (False, False): "both predicted",
            (True, False): "pipeline measured, SPMD predicted",
            (False, True): "pipeline predicted, SPMD measured",
        }[(pipe_ran, alt_ran)]
        if pipe_s <= alt_s:
            return (
                f"pipelining pays: {pipeline_label(pipe)} is {alt_s / pipe_s:.2f}x faster than "
                f"the best SPMD ({alt.label}) ({basis})"
            )
        return (
            f"do not pipeline: {alt.label} is {pipe_s / alt_s:.2f}x faster than the best "
            f"pipeline ({pipeline_label(pipe)}) ({basis})"
        )

    def summary(self) -> str:
        """Every configuration, pipelined and SPMD, as a small table in `ranking` order."""
        measured = {**dict(self.measured), **dict(self.spmd_measured)}
        lines = [
            "| rank | schedule | stages | m | remat stages | predicted ms | calibrated ms "
            "| measured ms | predicted peak MiB/device |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for rank, (c, _, _) in enumerate(self.ranking(), start=1):
            if isinstance(c, SpmdCandidate):
                name, stages, remat = c.label.split(", m=")[0], "-", "-"
            else:
                name, stages = c.schedule, str(c.num_stages)
                remat = ",".join(str(s) for s, r in enumerate(c.remat) if r) or "-"
            ran = f"{1e3 * measured[c]:.2f}" if c in measured else "-"
            lines.append(
                f"| {rank} | {name} | {stages} | {c.num_microbatches} | {remat} | "
                f"{1e3 * c.step_s:.2f} | {1e3 * c.step_s * self._calibration_of(c):.2f} | {ran} | "
                f"{max(c.peak_bytes) / 2**20:.2f} |"
            )
        return "\n".join(lines)

    def with_measurements(self, verifications: Sequence[Verification]) -> Plan:
        """The plan closed over measurements: the fastest *measured* configuration first.

        The pipelined configurations `verify` ran are ranked by their measured
        step time and put first (fastest measured becomes ``best``); the
        others follow in predicted order. The SPMD alternatives it ran are
        kept in ``spmd_measured``, and put first in ``spmd`` likewise. The
        measured times are kept (``measured``); ``calibration`` becomes the
        median of measured / predicted over the pipelined configurations run,
        ``spmd_calibration`` the same over the SPMD alternatives run.

        Args:
          verifications: from `verify`.

        Returns:
          The re-ranked plan.
        """
        ran = sorted(verifications, key=lambda v: v.measured_step_s)
        pipes = [v for v in ran if isinstance(v.candidate, Candidate)]
        alternatives = [v for v in ran if isinstance(v.candidate, SpmdCandidate)]
        order = [v.candidate for v in pipes]
        rest = [c for c in (self.best, *self.runners_up) if c not in order]
        ranked = order + rest
        spmd_order = [v.candidate for v in alternatives]
        spmd = spmd_order + [c for c in self.spmd if c not in spmd_order]
        ratios = _ratios(pipes)
        spmd_ratios = _ratios(alternatives)
        return dataclasses.replace(
            self,
            best=ranked[0],
            runners_up=tuple(ranked[1:]),
            measured=tuple((v.candidate, v.measured_step_s) for v in pipes),
            spmd=tuple(spmd),
            spmd_measured=tuple((v.candidate, v.measured_step_s) for v in alternatives),
            calibration=statistics.median(ratios) if ratios else self.calibration,
            spmd_calibration=(
                statistics.median(spmd_ratios) if spmd_ratios else self.spmd_calibration
            ),
        )

    def to_json(self) -> str:
        """The plan as JSON text (`from_json` reads it back)."""
        data = {
            "format": _FORMAT,
            "best": self.best.to_dict(),
            "runners_up": [c.to_dict() for c in self.runners_up],
            "unit_paths": list(self.unit_paths),
            "num_meshes": self.num_meshes,
            "batch_size": self.batch_size,
            "memory_budget": self.memory_budget,
            "costs": [c.to_dict() for c in self.costs],
            "measured": [[c.to_dict(), seconds] for c, seconds in self.measured],
            "calibration": self.calibration,
            "donate": self.donate,
            "model": self.model,
            "spmd": [c.to_dict() for c in self.spmd],
            "spmd_measured": [[c.to_dict(), seconds] for c, seconds in self.spmd_measured],
            "link": None if self.link is None else self.link.to_dict(),
            "spmd_calibration": self.spmd_calibration,
        }
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Reads `to_json`'s output.

        Raises:
          PlanError: the text is not a plan of this format.
        """
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != _FORMAT:
                raise ValueError(f"not a JSON object with format {_FORMAT!r}")
            plan = cls(
                best=Candidate.from_dict(data["best"]),
                runners_up=tuple(Candidate.from_dict(c) for c in data["runners_up"]),
                unit_paths=tuple(data["unit_paths"]),
                num_meshes=int(data["num_meshes"]),
                batch_size=int(data["batch_size"]),
                memory_budget=data["memory_budget"],
                costs=tuple(UnitCosts.from_dict(c) for c in data["costs"]),
                measured=tuple(
                    (Candidate.from_dict(c), float(t)) for c, t in data.get("measured", [])
                ),
                calibration=float(data.get("calibration", 1.0)),
                donate=bool(data.get("donate", False)),  # plans written before it: no
                model=data.get("model"),  # plans written before it: None
                # Plans written before the SPMD alternatives were profiled have none.
                spmd=tuple(SpmdCandidate.from_dict(c) for c in data.get("spmd", [])),
                spmd_measured=tuple(
                    (SpmdCandidate.from_dict(c), float(t)) for c, t in data.get("spmd_measured", [])
                ),
                link=None if data.get("link") is None else LinkCosts(**data["link"]),
                spmd_calibration=data.get("spmd_calibration"),
            )
            plan.check_types()
            return plan
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise PlanError(
                f"cannot read a plan ({_FORMAT}) from this text: {e}; write it with "
                "Plan.save / `nnx-mpmd plan --out FILE`."
            ) from None

    def check_types(self) -> None:
        """Checks what a hand-edited JSON file could get wrong; raises ValueError.

        Example:
          >>> best = Candidate("1f1b", 1, 1, ("0",), (False,), 0.5, (10,))
          >>> Plan(best, (), ("a",), 1, 8).check_types()
          Traceback (most recent call last):
          ...
          ValueError: best.unit_stages must hold one stage in [0, 1) per unit path ...
        """
        if not all(isinstance(p, str) for p in self.unit_paths):
            raise ValueError("unit_paths must be a list of strings")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model must be a class name, not {self.model!r}")
        for name, c in [("best", self.best)] + [("runners_up", c) for c in self.runners_up]:
            _check_candidate(c, len(self.unit_paths), name)
        for c in (*self.spmd, *(c for c, _ in self.spmd_measured)):
            _check_spmd_candidate(c)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes `to_json` to ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Reads a plan written by `save`.

        Raises:
          PlanError: the file cannot be read or does not hold a plan.
        """
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise PlanError(
                f"cannot read the plan {path} ({getattr(e, 'strerror', None) or e}); write "
                "one with `nnx-mpmd plan --out FILE`."
            ) from None
        try:
            return cls.from_json(text)
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from None


def _check_candidate(c: Candidate, num_units: int, where: str) -> None:
    """Raises ValueError when a configuration read from JSON has fields of the wrong type."""
    counts = (c.num_stages, c.num_microbatches)
    if not isinstance(c.schedule, str) or not all(_is_int(n) and n >= 1 for n in counts):
        raise ValueError(
            f"{where}: schedule must be a name and num_stages, num_microbatches integers >= 1"
        )
    stages = c.unit_stages
    if (
        not isinstance(stages, tuple)
        or len(stages) != num_units
        or not all(_is_int(s) and 0 <= s < c.num_stages for s in stages)
    ):
        raise ValueError(
            f"{where}.unit_stages must hold one stage in [0, {c.num_stages}) per unit path "
            f"({num_units}), not {stages!r}"
        )
    remat = c.remat
    if (
        not isinstance(remat, tuple)
        or len(remat) != c.num_stages
        or not all(isinstance(r, bool) for r in remat)
    ):
        raise ValueError(f"{where}.remat must be {c.num_stages} true/false values, not {remat!r}")


def _ratios(verifications: Sequence[Verification]) -> list[float]:
    """Measured / predicted step time of each verification."""
    return [v.measured_step_s / v.candidate.step_s for v in verifications if v.candidate.step_s > 0]


def _check_spmd_candidate(c: SpmdCandidate) -> None:
    """Raises ValueError when an SPMD alternative read from JSON has fields of the wrong type."""
    counts = (c.num_devices, c.num_microbatches)
    if c.kind not in SPMD_KINDS or not all(_is_int(n) and n >= 1 for n in counts):
        raise ValueError(
            f"spmd: kind must be one of {list(SPMD_KINDS)} and num_devices, num_microbatches "
            f"integers >= 1, not {c!r}"
        )


def pipeline_label(c: Candidate) -> str:
    """A pipelined configuration in words (``1f1b with 4 stages, m=8``)."""
    return f"{c.schedule} with {c.num_stages} stages, m={c.num_microbatches}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _default_microbatches(batch_size: int, num_meshes: int, data: int) -> list[int]:
    counts = [num_meshes * k for k in (1, 2, 4)]
    return [m for m in counts if batch_size % m == 0 and (batch_size // m) % data == 0]


def plan(
    model: Any,
    loss_fn: Callable[[Any, Any], Any],
    batch: Any,
    mesh: MpmdMesh,
    tx: optax.GradientTransformation,
    *,
    schedules: Sequence[str] | None = None,
    num_microbatches: Sequence[int] | None = None,
    memory_budget: int | None = None,
    remat: bool = True,
    keep: int = 5,
    repeats: int = 3,
    donate: bool = False,
    spmd: bool = True,
) -> Plan:
    """Chooses the split, schedule, microbatches and remat for ``model`` on ``mesh``.

    Each unit (a `Stage`, or one layer of a `ScanStack`) is profiled on one submesh
    (`profile_units`), then every configuration is simulated with those costs
    (`search`). The model is not changed: apply the plan with `Plan.apply`.

    Args:
      model: the model; its `Stage` wrappers are the units the plan moves.
      loss_fn: ``loss_fn(model, microbatch) -> loss`` (as for `value_and_grad`).
      batch: one step's batch (leaves split along axis 0).
      mesh: the `MpmdMesh` to plan for.
      tx: the optimizer's transformation (its state counts as memory).
      schedules: registered schedule names to consider (default: all).
      num_microbatches: microbatch counts to consider (default: 1, 2 and 4
        times the number of meshes, where the batch divides).
      memory_budget: bytes per device that each mesh must fit (None: no limit).
      remat: also consider recomputing stages' forwards (needs a second profile).
      keep: how many runners-up to keep.
      repeats: timed runs per profile (medians are kept).
      donate: predict the peaks of a step that donates the model's and
        optimizer's state (``mp.jit(..., donate_argnums=(0, 1))``, as
        ``nnx-mpmd train`` does): more configurations fit a budget.
      spmd: also predict data parallel and FSDP over all devices from the same
        profiles (`Plan.spmd`, `Plan.verdict`).

    Returns:
      The `Plan`.

    Raises:
      PlanError: nothing fits ``memory_budget`` (the message names the smallest
        budget that fits), or no microbatch count divides the batch.

    Example:
      >>> # p = mp.plan(model, loss_fn, batch, mesh, optax.adamw(1e-3)); p.apply(model)
      >>> callable(plan)
      True
    """
    batch_size = int(jax.tree.leaves(batch)[0].shape[0])
    data = int(mesh.submeshes[0].devices.size)
    counts = list(num_microbatches or _default_microbatches(batch_size, mesh.num_meshes, data))
    bad = [m for m in counts if m < 1 or batch_size % m or (batch_size // m) % data]
    if not counts or bad:
        raise PlanError(
            f"no usable microbatch count for a batch of {batch_size} rows on submeshes of "
            f"{data} devices (asked {counts}); give num_microbatches that divide the batch "
            f"into microbatches whose rows divide by {data}."
        )
    layered, renamed = _one_chunk_per_layer(model)
    costs = profile_units(
        layered, loss_fn, batch, mesh, tx,
        microbatch_sizes=sorted({batch_size // m for m in counts}),
        remat=(False, True) if remat else (False,), repeats=repeats,
    )  # fmt: skip
    costs = [dataclasses.replace(c, paths=tuple(renamed.get(p, p) for p in c.paths)) for c in costs]
    found = search(
        costs, mesh.num_meshes, batch_size, schedules=schedules,
        num_microbatches=counts, memory_budget=memory_budget, donate=donate,
    )  # fmt: skip
    link, alternatives = None, []
    if spmd:
        link = measure_link(mesh, sum(costs[0].param_bytes), repeats=max(5, repeats))
        alternatives = spmd_candidates(costs, mesh, batch_size, counts, link, donate=donate)
    return Plan(
        best=found[0],
        runners_up=tuple(found[1 : 1 + keep]),
        unit_paths=costs[0].paths,
        num_meshes=mesh.num_meshes,
        batch_size=batch_size,
        memory_budget=memory_budget,
        costs=tuple(costs),
        donate=donate,
        model=type(model).__name__,
        spmd=tuple(alternatives),
        link=link,
    )


def _one_chunk_per_layer(model: Any) -> tuple[Any, dict[str, str]]:
    """``model``, or a copy whose `ScanStack`s are cut into one chunk per layer.

    Each layer keeps the stage of the chunk it was in. Returns the model to
    profile and ``{chunk unit path: layer unit path}`` (``blocks.chunks.3`` ->
    ``blocks.3``), the names `Plan.apply` cuts a stack by.
    """
    if not any(isinstance(n, ScanStack) for _, n in nnx.iter_graph(model)):
        return model, {}
    copy = nnx.clone(model)
    renamed: dict[str, str] = {}
    found = [(p, n) for p, n in nnx.iter_graph(copy) if isinstance(n, ScanStack)]
    for path, stack in found:
        layer_stages: list[Any] = [
            getattr(chunk, "stage", None)
            for chunk, (lo, hi) in zip(stack.chunks, stack.chunk_ranges(), strict=True)
            for _ in range(lo, hi)
        ]
        if None in layer_stages:
            continue  # an uncut stack has no stage: profiling says what is missing
        stack.split({(i, i + 1): stage for i, stage in enumerate(layer_stages)})
        prefix = ".".join(map(str, path))
        renamed.update({f"{prefix}.chunks.{i}": f"{prefix}.{i}" for i in range(len(layer_stages))})
    return copy, renamed
