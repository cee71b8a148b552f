"""`make bench-peers`: nnx_mpmd, JaxPP and a hand-written floor side by side.

For each row of `peers_models.ROWS` (compute-bound MLP, overhead-bound MLP,
interleaved with 2 virtual stages, data parallel inside stages, GPT-like
transformer) it runs every peer in a fresh process, the peers' order rotating
each round, so load from the rest of the machine hits them alike:

* ``one-device``: the microbatched step under one ``jax.jit`` (the denominator);
* ``nnx_mpmd``: `nnx_mpmd.jit` with 1F1B (interleaved 1F1B on that row);
* ``floor``: the same schedule by hand, ``jax.jit`` per stage task and
  ``jax.device_put`` between meshes (`peers_floor.py`);
* ``jaxpp``: JaxPP in its own venv (`peers_jaxpp.py`), when that venv exists.

Every process starts cold (no persistent compilation cache). Reported: the
median step time over all rounds' timed steps, the fastest first step
(trace + compile + run), both as ratios to the one-device jit, and the first
step's loss against the one-device jit's (a peer computing other work shows a
difference far above float rounding). Writes a Markdown table and JSON to
``benchmarks/results/<date>-peers.{md,json}``.

Run: ``make bench-peers`` or
``.venv/bin/python benchmarks/peers_bench.py --rows overhead,gpt --rounds 2 --steps 5``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_ROWS = ("compute", "overhead", "interleaved", "dp", "gpt")
DEFAULT_JAXPP = ROOT / ".peers" / "jaxpp-venv" / "bin" / "python"
BUILD_JAXPP = "bash ../shared/peers/setup_jaxpp.sh .peers/jaxpp-venv"
PEERS = ("one-device", "nnx_mpmd", "floor", "jaxpp")
#: Relative loss difference above which a peer is flagged as computing other work.
LOSS_TOLERANCE = 1e-4


def worker_command(peer: str, row: str, args: argparse.Namespace) -> list[str]:
    """The command line of one peer's process on one row."""
    timing = ["--row", row, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if peer == "jaxpp":
        return [str(args.jaxpp_python), str(HERE / "peers_jaxpp.py"), *timing]
    return [sys.executable, str(HERE / "peers_worker.py"), "--peer", peer, *timing]


def run_worker(command: list[str], timeout_s: float) -> dict:
    """Runs one worker; its ``PEERS_RESULT`` JSON, or ``{"error": ...}``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", NNX_MPMD_COMPILE_CACHE="off")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=HERE
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("PEERS_RESULT "):
            return json.loads(line[len("PEERS_RESULT ") :])
    tail = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["no output"]
    return {"error": f"exit {done.returncode}: {tail[0][:300]}"}


def summarize(samples: list[dict]) -> dict:
    """One peer on one row over the rounds: median step, fastest first step, first loss."""
    ok = [s for s in samples if "error" not in s]
    if not ok:
        return {"error": samples[-1]["error"] if samples else "not run"}
    steps = [t for s in ok for t in s["step_s"]]
    return {
        "median_s": statistics.median(steps) if steps else float("nan"),
        "first_step_s": min(s["first_step_s"] for s in ok),
        "first_loss": ok[0]["losses"][0],
        "rounds": len(ok),
        "jax": ok[0].get("jax"),
    }


def add_ratios(row_summary: dict[str, dict]) -> None:
    """Ratios to the one-device jit, and the first loss's relative difference from it."""
    base = row_summary.get("one-device", {})
    for summary in row_summary.values():
        if "error" in summary or "error" in base:
            continue
        summary["step_ratio"] = summary["median_s"] / base["median_s"]
        summary["first_ratio"] = summary["first_step_s"] / base["first_step_s"]
        diff = abs(summary["first_loss"] - base["first_loss"])
        summary["loss_rel_diff"] = diff / max(abs(base["first_loss"]), 1e-30)


def verdict(row_summary: dict[str, dict]) -> str:
    """Where nnx_mpmd's step stands against JaxPP and the floor on one row."""
    ours = row_summary.get("nnx_mpmd", {})
    if "median_s" not in ours:
        return "nnx_mpmd did not run"
    parts = []
    for peer in ("jaxpp", "floor"):
        other = row_summary.get(peer, {})
        if "median_s" in other:
            ratio = ours["median_s"] / other["median_s"]
            parts.append(f"{ratio:.2f}× {peer}")
    return ", ".join(parts)


def markdown(results: dict, notes: dict[str, str]) -> str:
    """The results as one Markdown table, one line per row and peer."""
    lines = [
        "| row | peer | step ms | step / 1-dev | first s | first / 1-dev | loss Δ (rel) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row, peers in results["rows"].items():
        for peer, s in peers.items():
            if "error" in s:
                lines.append(f"| {row} | {peer} | – | – | – | – | {s['error']} |")
                continue
            flag = "" if s.get("loss_rel_diff", 0.0) <= LOSS_TOLERANCE else " **differs**"
            lines.append(
                f"| {row} | {peer} | {s['median_s'] * 1e3:.1f} | {s.get('step_ratio', float('nan')):.2f}"
                f" | {s['first_step_s']:.2f} | {s.get('first_ratio', float('nan')):.2f}"
                f" | {s.get('loss_rel_diff', float('nan')):.1e}{flag} |"
            )
    lines.append("")
    for row, peers in results["rows"].items():
        lines.append(f"- **{row}** ({notes[row]}): nnx_mpmd step = {verdict(peers)}")
    return "\n".join(lines)


def machine() -> dict:
    """CPU model, cores and load, without starting JAX."""
    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "load_average": list(os.getloadavg())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS))
    parser.add_argument("--rounds", type=int, default=2, help="processes per peer and row")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after the first")
    parser.add_argument("--jaxpp-python", type=Path, default=DEFAULT_JAXPP)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per process")
    parser.add_argument("--out", type=Path, default=None, help="path stem of the .md/.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    sys.path.insert(0, str(HERE))
    import peers_models as pm

    args = parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in pm.ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from {', '.join(pm.ROWS)}")
    peers = list(PEERS)
    if not args.jaxpp_python.exists():
        print(f"JaxPP: not run ({args.jaxpp_python} is missing); build its venv: {BUILD_JAXPP}")
        peers.remove("jaxpp")
    samples: dict[str, dict[str, list]] = {r: {p: [] for p in peers} for r in rows}
    started = machine()
    for round_index in range(args.rounds):
        order = peers[round_index % len(peers) :] + peers[: round_index % len(peers)]
        for row in rows:
            for peer in order:
                result = run_worker(worker_command(peer, row, args), args.timeout)
                samples[row][peer].append(result)
                shown = result.get("error") or f"median {result['median_s'] * 1e3:.1f} ms"
                print(f"round {round_index + 1} {row:12s} {peer:10s} {shown}", flush=True)
    results = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine_start": started,
        "machine_end": machine(),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "rows": {},
        "samples": samples,
    }
    for row in rows:
        summary = {peer: summarize(samples[row][peer]) for peer in peers}
        if "jaxpp" not in peers:
            summary["jaxpp"] = {"error": f"not run: build its venv with `{BUILD_JAXPP}`"}
        add_ratios(summary)
        results["rows"][row] = summary
    table = markdown(results, {r: pm.ROWS[r].note for r in rows})
    print(table)
    stem = args.out or HERE / "results" / f"{datetime.date.today().isoformat()}-peers"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
    stem.with_suffix(".md").write_text(table + "\n")
    print(f"wrote {stem}.json and {stem}.md")
    return results


if __name__ == "__main__":
    main()
