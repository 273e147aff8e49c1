#!/usr/bin/env python3
"""Every benchmark in one call, one process each (each frees its GPU memory on exit).

    PYTHONPATH=. python3 benchmarks/run_all.py --out $OUT            # --quick runs, about 6 minutes
    PYTHONPATH=. python3 benchmarks/run_all.py --out $OUT --full     # every case (much longer)
    .venv/bin/python benchmarks/run_all.py --smoke --out /tmp/bench-smoke

Each script gets a time budget (rows past it are recorded as skipped) and is stopped 90 s after
it; the markdown tables are printed at the end.
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# script -> budget in seconds for a --quick run
BUDGETS = {"softmax.py": 150, "rope.py": 60, "stick_breaking.py": 80, "sweep_blocks.py": 50}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--smoke", action="store_true", help="pass --smoke to every script (CPU)")
    p.add_argument("--full", action="store_true", help="no --quick, no budgets")
    p.add_argument("--no-sweep", action="store_true", help="leave out sweep_blocks.py")
    args = p.parse_args(argv)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    scripts = [s for s in BUDGETS if not (args.no_sweep and s == "sweep_blocks.py")]
    status = {}
    t0 = time.perf_counter()
    for script in scripts:
        cmd = [sys.executable, os.path.join(HERE, script), "--out", args.out]
        timeout = None
        if args.smoke:
            cmd.append("--smoke")
            timeout = 120
        elif not args.full:
            cmd += ["--quick", "--budget", str(BUDGETS[script])]
            timeout = BUDGETS[script] + 90
        print(f"\n### {' '.join(cmd[1:])}", flush=True)
        t = time.perf_counter()
        try:
            rc = subprocess.run(cmd, env=env, cwd=ROOT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        status[script] = (rc, time.perf_counter() - t)
    print(f"\n### run_all: {time.perf_counter() - t0:.0f} s", flush=True)
    for script, (rc, s) in status.items():
        print(f"- {script}: exit {rc}, {s:.0f} s", flush=True)
    for md in sorted(glob.glob(os.path.join(args.out, "*.md"))):
        if os.path.getmtime(md) >= time.time() - (time.perf_counter() - t0) - 1:
            print(f"\n{open(md).read()}", flush=True)
    return 0 if all(rc == 0 for rc, _ in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
