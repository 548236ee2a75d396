"""Every code example of the documentation (docs/**/*.md and README.md) runs.

A page's ```python blocks run in order in one fresh Python process (later blocks see
earlier blocks' names), in an empty working directory, with ``SHARDCACHE_DIR`` inside it and
one rank of torchrun's variables (so ``dist.init_process_group`` works). Markers, each an
HTML comment (invisible on the site) on the line right before a block or anywhere on a page:

- ``<!-- not run: REASON -->`` before a python block: not run; listed with its reason by
  ``test_opted_out_examples_are_few_and_say_why`` (run pytest with ``-s`` to see them).
- ``<!-- run -->`` before a bash block: run with ``bash -e`` in the page's directory, after
  the page's python blocks before it (other bash blocks are not run).
- ``<!-- example data: S3SPEC... [index=URL] -->`` on a page: before its blocks, the moto S3
  server (the ``s3`` fixture, its ``AWS_*`` variables set for the blocks) holds those
  shards (12 samples each: a small ``.jpg`` and a ``.cls``), and with ``index=`` the sample
  index of the first spec (made by ``shardcache index``).

Every ``shardcache <command>`` named in any block must be a command ``shardcache --help``
lists.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from ports import reserved_port
from repo import ROOT

from shardcache import expand_urls

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->")
RUN = re.compile(r"<!--\s*run\s*-->")
DATA = re.compile(r"<!--\s*example data:\s*(.*?)\s*-->")
COMMAND = re.compile(r"(?:^|[\s$(`])shardcache ([a-z][a-z-]*)\b", re.M)
# The most examples that may opt out: raise it only with a reason a reader would accept.
MAX_OPTED_OUT = 6


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    code: str
    marker: str  # the HTML comment on the line before, if any

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(page, line, match.group(1), match.group(2), before))
    return found


ALL = [block for page in PAGES for block in blocks(page)]
PYTHON = [b for b in ALL if b.lang == "python"]
OPTED_OUT = [b for b in PYTHON if NOT_RUN.fullmatch(b.marker)]
RUN_PAGES = sorted(
    {b.page for b in ALL if (b.lang == "python" and b not in OPTED_OUT) or RUN.fullmatch(b.marker)}
)


def test_the_docs_have_examples() -> None:
    assert len(PYTHON) >= 15, [b.where for b in PYTHON]
    assert ROOT / "docs" / "quickstart.md" in RUN_PAGES


def test_opted_out_examples_are_few_and_say_why() -> None:
    print("\ncode examples not run by the test suite:")
    for block in OPTED_OUT:
        reason = NOT_RUN.fullmatch(block.marker)[1]  # type: ignore[index]
        print(f"  {block.where}: {reason}")
        assert len(reason) > 10, f"{block.where}: say why it is not run"
    assert len(OPTED_OUT) <= MAX_OPTED_OUT


def test_every_shardcache_command_named_exists() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shardcache", "--help"], capture_output=True, text=True, check=True
    ).stdout
    listed = re.search(r"\{([a-z,-]+)\}", out)
    assert listed, out
    commands = set(listed[1].split(","))
    named = {}
    for block in ALL:
        if block.lang in ("bash", "sh", "console"):
            commands_text = block.code
        elif block.lang in ("", "text"):  # a transcript: only the lines typed at a prompt
            commands_text = "\n".join(
                line for line in block.code.splitlines() if line.startswith(("$ ", "# "))
            )
        else:
            continue
        for name in COMMAND.findall(commands_text):
            named.setdefault(name, block.where)
    unknown = {name: where for name, where in named.items() if name not in commands}
    assert not unknown, f"not shardcache commands: {unknown} (known: {sorted(commands)})"
    assert len(named) >= 6, named


def test_readme_links_do_not_break_on_pypi() -> None:
    """PyPI shows README.md without the repository around it: no relative link or image."""
    readme = (ROOT / "README.md").read_text()
    relative = [t for t in re.findall(r"\]\(([^)]+)\)", readme) if "://" not in t]
    assert not relative, relative


def _jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buf, format="JPEG")
    return buf.getvalue()


def _shard(index: int, jpeg: bytes) -> bytes:
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(12):
            for suffix, data in (("jpg", jpeg), ("cls", b"%d" % (i % 10))):
                member = tarfile.TarInfo(f"s{index:04d}_{i:03d}.{suffix}")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
    return buf.getvalue()


def _example_data(request: pytest.FixtureRequest, spec_text: str, env: dict[str, str]) -> None:
    s3 = request.getfixturevalue("s3")
    env.update(s3.env())
    jpeg = _jpeg()
    specs, index = [], None
    for word in spec_text.split():
        if word.startswith("index="):
            index = word.removeprefix("index=")
        else:
            specs.append(word)
    for spec in specs:
        for number, url in enumerate(expand_urls(spec)):
            bucket, key = url.removeprefix("s3://").split("/", 1)
            s3.put_objects(bucket, {key: _shard(number, jpeg)})
    if index:
        cache_dir = env["SHARDCACHE_DIR"] + "-index"
        subprocess.run(
            [sys.executable, "-m", "shardcache", "index", specs[0], "-o", index],
            env={**env, "SHARDCACHE_DIR": cache_dir},
            check=True,
            capture_output=True,
        )


RUNNER = """
import json, subprocess, sys, traceback
namespace = {"__name__": "__main__"}
for step in json.load(open(sys.argv[1])):
    print(f"--- {step['where']} ({step['lang']})", flush=True)
    if step["lang"] == "python":
        try:
            exec(compile(step["code"], step["where"], "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            sys.exit(f"the example at {step['where']} failed")
    else:
        done = subprocess.run(["bash", "-e", "-c", step["code"]])
        if done.returncode:
            sys.exit(f"the example at {step['where']} exited {done.returncode}")
"""


@pytest.fixture
def master_port() -> Iterator[int]:
    """A port for an example's ``init_process_group``, reserved while it runs."""
    with reserved_port() as port:
        yield port


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run(
    page: Path, tmp_path: Path, request: pytest.FixtureRequest, master_port: int
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        "SHARDCACHE_DIR": str(tmp_path / "cache"),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    data = DATA.search(page.read_text())
    if data:
        _example_data(request, data[1], env)
    steps = [
        {"where": b.where, "lang": b.lang, "code": b.code}
        for b in blocks(page)
        if (b.lang == "python" and not NOT_RUN.fullmatch(b.marker))
        or (b.lang == "bash" and RUN.fullmatch(b.marker))
    ]
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    (tmp_path / "runner.py").write_text(RUNNER)
    done = subprocess.run(
        [sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "steps.json")],
        cwd=work,
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
