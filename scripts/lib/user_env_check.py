"""shardcache installed into a user's own training environment (run by scripts/check-dist
with the Python of a venv that held torch before the wheel was installed with its torch
extra, from outside the source tree).

Checks what a user meets on their first day:

1. the environment's torch is the one it had (``--torch VERSION``, at the same path):
   installing shardcache with its ``torch`` extra never replaces it;
2. a ``MissingExtraError``'s hint works as printed for this install (a wheel or a clone,
   not a package index): the ``pip install`` it names is run verbatim and the part then
   works;
3. the quickstart (docs/quickstart.md: its python blocks in order in one process, then
   its ``<!-- run -->`` bash blocks) runs in an empty directory. A block marked
   ``<!-- needs extra: NAME -->`` is skipped: this environment has only the torch extra
   (tests/integration/docs runs it with every extra).

Exits non-zero with every failed check listed.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
HINT = re.compile(r"pip install ('[^']+'|\S+)")
failures: list[str] = []


def check(what: str, ok: bool, detail: object = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {what}{f': {detail}' if detail and not ok else ''}")
    if not ok:
        failures.append(what)


def torch_is_kept(version: str, path: str) -> None:
    import torch

    check(f"torch is still {version}", torch.__version__ == version, torch.__version__)
    check(f"torch is still at {path}", torch.__file__ == path, torch.__file__)
    import torchdata  # the torch extra's other part, installed beside the user's torch

    check("the torch extra installed torchdata", bool(torchdata.__file__))


def prometheus_sink_error() -> str | None:
    """The MissingExtraError's message of a PrometheusSink, None if it was made."""
    code = "import shardcache; shardcache.PrometheusSink(port=0).close()"
    made = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    return None if made.returncode == 0 else made.stderr


def hint_works() -> None:
    error = prometheus_sink_error()
    check("PrometheusSink without its extra raises MissingExtraError", error is not None)
    hint = HINT.search(error or "")
    check("the error names a pip install", hint is not None, error)
    if hint is None:
        return
    command = [sys.executable, "-m", "pip", "install", "--quiet", *shlex.split(hint.group(1))]
    ran = subprocess.run(command, check=False, capture_output=True, text=True)
    check(
        f"the hint as printed installs: pip install {hint.group(1)}",
        ran.returncode == 0,
        ran.stderr[-2000:],
    )
    check(
        "PrometheusSink works after the hint",
        prometheus_sink_error() is None,
        prometheus_sink_error(),
    )


def quickstart_runs(page: Path) -> None:
    text = page.read_text()
    python, bash = [], []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        if match.group(1) == "python" and not before.startswith("<!-- needs extra:"):
            python.append(match.group(2))
        elif match.group(1) == "bash" and before == "<!-- run -->":
            bash.append(match.group(2))
    check("the quickstart has python and bash examples", bool(python) and bool(bash))
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    with tempfile.TemporaryDirectory(prefix="shardcache-quickstart-") as empty:
        env["SHARDCACHE_DIR"] = str(Path(empty) / "cache-root")
        steps = [[sys.executable, "-c", "\n".join(python)]]
        steps += [["bash", "-e", "-c", block] for block in bash]
        for step in steps:
            ran = subprocess.run(
                step, check=False, cwd=empty, env=env, capture_output=True, text=True, timeout=300
            )
            check(
                f"quickstart: {step[0]} block runs",
                ran.returncode == 0,
                (ran.stdout + ran.stderr)[-3000:],
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", required=True, help="the torch version the venv held")
    parser.add_argument("--torch-path", required=True, help="its torch/__init__.py")
    parser.add_argument("--quickstart", required=True, type=Path)
    args = parser.parse_args()
    torch_is_kept(args.torch, args.torch_path)
    hint_works()
    quickstart_runs(args.quickstart)
    sys.exit(f"{len(failures)} check(s) failed: {failures}" if failures else None)


if __name__ == "__main__":
    main()
