"""ablation.sh's own checks of its input, which run before anything is installed or started."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args, env, message", [
    (["--sweep=0.5,2"], {}, "--sweep: 2 is not a λ in [0, 1]"),
    (["--fast"], {}, "usage: bash ablation.sh"),
    ([], {"SEED": "1x"}, "SEED=1x: the seed is a non-negative integer"),
])
def test_bad_input_stops_the_run_before_it_installs_anything(args, env, message):
    # input let through would start the install (minutes): the 30 s timeout fails the test then
    run = subprocess.run(["bash", str(ROOT / "ablation.sh"), *args], capture_output=True, text=True, timeout=30,
                         env={**os.environ, **env})
    assert run.returncode == 2 and message in run.stderr, run.stderr
