"""Bad-input paths of a command line, many cases in one fresh Python process (each process start
costs seconds here): every case runs `main(args)` in its own working directory and
$TRAINING_BASE_DIR, with its exit code, stdout and stderr captured; an exception that escapes
`main` is printed to the case's stderr as a traceback, as the command would print it. After each
case the probe records whether Ray has been imported: once a case imports it, that case and every
later one report it (the first such case is the culprit)."""

import json
import subprocess
import sys

from conftest import REPO

PROBE = """
import contextlib, importlib, io, json, os, sys, traceback
main = importlib.import_module(sys.argv[1]).main
results = []
for case in json.load(sys.stdin):
    os.chdir(case["cwd"])
    os.environ["TRAINING_BASE_DIR"] = case["cwd"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(case["args"])
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                    "ray_imported": "ray" in sys.modules})
print("", json.dumps(results), sep=os.linesep, file=sys.__stdout__)
"""


def run_cases(cli_module: str, cases: list[dict]) -> list[dict]:
    """cases: [{"args": [...], "cwd": "/a/dir"}, ...] -> one result dict per case, in order."""
    done = subprocess.run([sys.executable, "-c", PROBE, cli_module], input=json.dumps(cases), capture_output=True,
                          text=True, cwd=REPO, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"},
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    return results
