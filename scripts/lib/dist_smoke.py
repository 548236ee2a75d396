"""What a user gets from ``pip install shardcache`` (run by scripts/check-dist with the
Python of a venv holding the installed wheel, from outside the source tree).

Checks that shardcache is the installed copy at the version its metadata gives, that
``shardcache --version`` prints it, that the core works on a local shard (ShardCache, the
WebDataset stage and class, ``shardcache warm``), and that every optional part whose extra
is not installed raises MissingExtraError naming that extra. ``--extras testing`` says
which extras the venv has (they are then checked to be there). Exits non-zero with every
failed check listed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

EXTRA_MODULES = {
    "torch": "torch",
    "testing": "moto",
    "prometheus": "prometheus_client",
    "plot": "matplotlib",
    "tensorboard": "tensorboard",
}
failures: list[str] = []


def check(what: str, ok: bool, detail: object = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {what}{f': {detail}' if detail and not ok else ''}")
    if not ok:
        failures.append(what)


def raises_missing(what: str, extra: str, call: Callable[[], object]) -> None:
    """``call()`` must raise MissingExtraError whose extra is ``extra``."""
    from shardcache import MissingExtraError

    try:
        call()
    except MissingExtraError as exc:
        check(f"{what}: MissingExtraError [{extra}]", exc.extra == extra, exc)
    except BaseException as exc:  # any other outcome is the failure reported
        check(f"{what}: MissingExtraError [{extra}]", False, f"{type(exc).__name__}: {exc}")
    else:
        check(f"{what}: MissingExtraError [{extra}]", False, "nothing raised")


def cli(bindir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(bindir / "shardcache"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )


def make_shard(path: Path, samples: int = 4) -> None:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(samples):
            data = b"%d" % i
            info = tarfile.TarInfo(f"s{i:03d}.cls")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def check_core(bindir: Path, tmp: Path, version: str) -> Path:
    """The import, the version, and the core on a local shard; returns the metrics
    directory ``shardcache warm`` wrote to."""
    import shardcache

    where = Path(shardcache.__file__).resolve()
    check("shardcache is the installed copy", Path(sys.prefix).resolve() in where.parents, where)
    check(
        "__version__ is the metadata's and the wheel's",
        shardcache.__version__ == importlib.metadata.version("shardcache") == version,
        f"{shardcache.__version__} / {importlib.metadata.version('shardcache')}",
    )
    printed = cli(bindir, "--version")
    check("shardcache --version", printed.stdout == f"shardcache {version}\n", printed)
    names: dict[str, object] = {}
    exec("from shardcache import *", names)
    check("from shardcache import *", set(shardcache.__all__) <= set(names))

    shard = tmp / "train-000000.tar"
    make_shard(shard)
    cache = shardcache.ShardCache(tmp / "cache")
    check("ShardCache.fetch", cache.fetch(str(shard)).read_bytes() == shard.read_bytes())
    stage = shardcache.tarfile_to_samples(cache=cache)
    check("tarfile_to_samples", len(list(stage([{"url": str(shard)}]))) == 4)
    wds_cache = tmp / "wds-cache"
    wds_cache.mkdir()
    dataset = shardcache.WebDataset([str(shard)], cache_dir=str(wds_cache), shardshuffle=False)
    check("shardcache.WebDataset", [s["cls"] for s in dataset] == [b"0", b"1", b"2", b"3"])
    metrics = tmp / "metrics"
    env = {"SHARDCACHE_DIR": str(tmp / "cli-cache"), "SHARDCACHE_METRICS": str(metrics)}
    warm = cli(bindir, "warm", str(shard), env=env)
    check("shardcache warm", warm.returncode == 0 and "1 of 1 shards ok" in warm.stdout, warm)
    return metrics


def check_missing(bindir: Path, tmp: Path, have: set[str], metrics: Path) -> None:
    """Every optional part whose extra is not in ``have`` raises MissingExtraError."""
    import shardcache

    cli_checks: list[tuple[str, list[str]]] = []
    if "torch" not in have:
        for name in ("ResumableDataset", "MixtureDataset", "Source"):
            raises_missing(f"shardcache.{name}", "torch", lambda n=name: getattr(shardcache, n)([]))
        raises_missing(
            "job_state of a mixture",
            "torch",
            lambda: shardcache.job_state({"format": "shardcache.mixture"}),
        )
        shard = str(tmp / "train-000000.tar")
        cli_checks.append(("torch", ["warm", shard, "--split", "dataset", "--index", "i.json"]))
    if "testing" not in have:
        from shardcache.testing import S3Server

        raises_missing("S3Server().start()", "testing", lambda: S3Server().start())
    missing = ",".join(e for e in ("torch", "testing") if e not in have)
    if missing:
        cli_checks.append((missing, ["demo", "--cache-dir", str(tmp / "demo")]))
    if "prometheus" not in have:
        raises_missing("PrometheusSink()", "prometheus", shardcache.PrometheusSink)
    if "plot" not in have:
        cli_checks.append(("plot", ["report", str(metrics), "--plot", str(tmp / "w.png")]))
    for extra, argv in cli_checks:
        run = cli(bindir, *argv, env={"SHARDCACHE_DIR": str(tmp / "cli-cache")})
        check(
            f"shardcache {argv[0]} ...: MissingExtraError [{extra}]",
            run.returncode == 1 and f"pip install 'shardcache[{extra}]'" in run.stderr,
            run,
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--extras", default="", help="comma-separated extras installed")
    parser.add_argument("--version", required=True, help="the version the wheel must have")
    args = parser.parse_args()
    have = {e for e in args.extras.split(",") if e}
    for extra, module in EXTRA_MODULES.items():
        present = importlib.util.find_spec(module) is not None
        check(f"{module} {'installed' if extra in have else 'absent'}", present == (extra in have))
    bindir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        metrics = check_core(bindir, tmp, args.version)
        check_missing(bindir, tmp, have, metrics)
    print(f"{len(failures)} failed" if failures else "every check passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
