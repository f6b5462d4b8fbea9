"""Checkpoint tests: the leg that resumes from a checkpoint runs in a fresh process (tests/run/),
and its record must equal, bitwise, what the uninterrupted run recorded from the save on."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

RUN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "run")


def run_fresh(script: str, *args, env=None, timeout: int = 600) -> None:
    """``python tests/run/<script> args...`` in a fresh process; its stderr tail on failure."""
    done = subprocess.run([sys.executable, os.path.join(RUN, script), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


def assert_resumed_run_equals_the_whole(whole: dict, resumed: dict, saved_at: int, last: int) -> None:
    """The run restored from the step-``saved_at`` checkpoint recorded bitwise what the
    uninterrupted run recorded from that step on (losses, states, final weights), and the run is
    not trivial: scales moved after the save, and overflows were counted after it."""
    keys = [k for k in whole if not k.startswith(("loss/", "state/")) or int(k.split("/")[1]) >= saved_at]
    assert sorted(keys) == sorted(resumed), set(keys) ^ set(resumed)
    differ = [k for k in keys if np.asarray(whole[k]).tobytes() != np.asarray(resumed[k]).tobytes()]
    assert not differ, differ[:10]
    scales = [whole[f"state/{s}/0/scale"] for s in (saved_at, last)]
    assert scales[0].tobytes() != scales[1].tobytes()
    over = [sum(float(whole[f"state/{s}/{k}/overflows"].sum()) for k in range(4)) for s in (saved_at, last)]
    assert over[1] > over[0] > 0
