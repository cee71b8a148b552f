"""Draws the schedule pictures and prints the schedule table of docs/concepts.md.

Run it after changing a schedule generator or the simulator, then commit the
PNGs under docs/img/ and paste the printed table into docs/concepts.md
(tests/project/test_docs.py checks that the table there matches what this prints).
mkdocs never runs this script.

Usage:
    python docs/gen_pictures.py            # write docs/img/*.png, print the table
    python docs/gen_pictures.py --table    # print the table only

Example:
    >>> rows = schedule_rows()
    >>> rows[0][0], rows[0][2]
    ('gpipe', 4)
"""

from __future__ import annotations

import argparse
import pathlib

from nnx_mpmd import schedules

NUM_MESHES = 4
NUM_MICROBATCHES = 8
IMG_DIR = pathlib.Path(__file__).resolve().parent / "img"

# (registry name, display name). Every schedule at p=4 meshes and m=8 microbatches.
SCHEDULES: tuple[tuple[str, str], ...] = (
    ("gpipe", "GPipe"),
    ("1f1b", "1F1B"),
    ("eager-1f1b", "Eager 1F1B"),
    ("interleaved", "Interleaved 1F1B"),
    ("looped-bfs", "Looped BFS"),
    ("zb-h1", "ZB-H1"),
    ("zb-h2", "ZB-H2"),
    ("zb-v", "ZB-V"),
    ("dualpipev", "DualPipeV"),
)


def costs_for(num_stages: int, num_meshes: int) -> schedules.Costs:
    """Task costs that keep the model's total work fixed, whatever the stage count.

    With one stage per mesh a forward costs 1 and a backward 2 (1 + 1 when
    split). With ``k`` stages per mesh each stage is ``1/k`` of the layers, so
    every task costs ``1/k`` as much.

    Args:
      num_stages: the number of stages.
      num_meshes: the number of meshes.

    Returns:
      The costs to simulate with.

    Example:
      >>> costs_for(8, 4).F
      0.5
    """
    scale = num_meshes / num_stages
    return schedules.Costs(F=scale, B=2 * scale, BI=scale, BW=scale)


def schedule_rows() -> list[tuple[str, str, int, float, float, tuple[int, ...]]]:
    """Simulates every schedule in `SCHEDULES`.

    Returns:
      ``(name, display name, stages, makespan, bubble fraction, peak activations)``
      for each schedule.

    Example:
      >>> [row[2] for row in schedule_rows()]
      [4, 4, 8, 8, 4, 8, 8]
    """
    rows = []
    for name, title in SCHEDULES:
        schedule = schedules.get_schedule(name)
        num_stages = schedule.default_num_stages(NUM_MESHES)
        tasks = schedule.tasks(num_stages, NUM_MESHES, NUM_MICROBATCHES)
        timeline = schedules.simulate(tasks, costs_for(num_stages, NUM_MESHES))
        rows.append(
            (
                name,
                title,
                num_stages,
                timeline.makespan,
                timeline.bubble_fraction,
                timeline.peak_activations,
            )
        )
    return rows


def markdown_table() -> str:
    """The schedule table of docs/concepts.md, as Markdown.

    Returns:
      The table, one row per schedule.

    Example:
      >>> markdown_table().splitlines()[0]
      '| schedule | `name` | stages | makespan | bubble | peak activations per mesh |'
    """
    lines = [
        "| schedule | `name` | stages | makespan | bubble | peak activations per mesh |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, title, num_stages, makespan, bubble, peaks in schedule_rows():
        peak_text = ", ".join(str(p) for p in peaks)
        lines.append(
            f"| {title} | `{name}` | {num_stages} | {makespan:g} | {100 * bubble:.1f} % "
            f"| {peak_text} |"
        )
    return "\n".join(lines)


def draw_all(directory: pathlib.Path = IMG_DIR) -> list[pathlib.Path]:
    """Saves a Gantt chart of every schedule as ``schedule-<name>.png``.

    Args:
      directory: where to write the pictures.

    Returns:
      The paths written.

    Example:
      >>> import tempfile
      >>> len(draw_all(pathlib.Path(tempfile.mkdtemp())))
      7
    """
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, title in SCHEDULES:
        schedule = schedules.get_schedule(name)
        num_stages = schedule.default_num_stages(NUM_MESHES)
        tasks = schedule.tasks(num_stages, NUM_MESHES, NUM_MICROBATCHES)
        timeline = schedules.simulate(tasks, costs_for(num_stages, NUM_MESHES))
        path = directory / f"schedule-{name}.png"
        heading = (
            f"{title}: {NUM_MESHES} meshes, {num_stages} stages, {NUM_MICROBATCHES} "
            f"microbatches, bubble {100 * timeline.bubble_fraction:.1f} %"
        )
        schedules.plot_gantt(timeline, path, title=heading)
        written.append(path)
    return written


def main() -> None:
    """Writes the pictures (unless ``--table``) and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true", help="print the table only")
    args = parser.parse_args()
    if not args.table:
        for path in draw_all():
            print(f"wrote {path}")
    print(markdown_table())


if __name__ == "__main__":
    main()
