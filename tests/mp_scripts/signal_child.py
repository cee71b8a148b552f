"""A stand-in for a launched training process, for the launcher's signal tests (spawned by tests).

Usage: ``python signal_child.py MODE DIR``. Writes its pid to ``DIR/<process id>.pid``,
prints a Gloo connection line (noise the launcher hides without ``--verbose``) and
``ready``, then sleeps. MODE ``graceful``: on SIGTERM or SIGINT it prints
``got <signal>`` and exits with ``128 + signal`` half a second later (as
``nnx-mpmd train`` does after its checkpoint); ``stubborn``: it ignores both.
"""

from __future__ import annotations

import os
import signal
import sys
import time

MODE, DIRECTORY = sys.argv[1], sys.argv[2]
PROCESS = os.environ["NNX_MPMD_PROCESS_ID"]


def _graceful(signum, frame):
    print(f"got {signal.Signals(signum).name}", flush=True)
    time.sleep(0.5)
    sys.exit(128 + signum)


handler = _graceful if MODE == "graceful" else signal.SIG_IGN
signal.signal(signal.SIGTERM, handler)
signal.signal(signal.SIGINT, handler)
print("[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1")
print("ready", flush=True)
with open(os.path.join(DIRECTORY, f"{PROCESS}.pid.part"), "w") as f:
    f.write(str(os.getpid()))
os.replace(
    os.path.join(DIRECTORY, f"{PROCESS}.pid.part"), os.path.join(DIRECTORY, f"{PROCESS}.pid")
)
time.sleep(120)
