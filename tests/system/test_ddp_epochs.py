"""A real DDP job: every rank yields the same number of batches, every epoch.

tests/support/ddp_epoch_job.py runs under torchrun with 2 ranks x 2 DataLoader workers (4
consumers) and steps a ``DistributedDataParallel`` model once per batch, with a 30 s
collective timeout: a rank with fewer batches would leave the other blocked in the gradient
all-reduce until the timeout fails the job. Over shards holding unequal numbers of samples
(and fewer shards than consumers), each epoch must deliver every sample once plus exactly
the repeats the loader's state reports (``remainder="pad"``), or every sample at most once
and exactly the reported number left out (``"drop"``); the batch counts of the ranks must
agree. Over the S3 server, at rank scope, without an index, the first epoch must make at
most shards + caches GETs (each rank learns the sample offsets of its own cache's shards
and the job gathers them) and the second and third none at all: each shard is read by the
same rank's cache every epoch; a second job reuses the index the first kept (in the cache
root, or beside the data), learning nothing. A rank's learning error, or a rank that never
joins, stops every rank with a named error. With a sample index made ahead
(``shardcache index``) and ``shardcache warm --split dataset`` run once per rank, each rank
warms only its own cache's shards and the training sends no request at all.
tests/system/test_slurm_epochs.py runs the same job on two SLURM nodes.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from processes import JOB_TIMEOUT, job_env, torchrun
from repo import SUPPORT
from tars import Files, shard_samples, tar_bytes

from shardcache import ResumableDataset
from shardcache.testing import S3Server

JOB = SUPPORT / "ddp_epoch_job.py"
RANKS, WORKERS = 2, 2
CONSUMERS = RANKS * WORKERS
CLI_TIMEOUT = 60  # a shardcache index / warm command
SEED = 3  # the job's default --seed
UNEQUAL = (40, 157, 71, 103, 58, 126, 89, 44, 140, 93)  # 921 samples: 921 % 4 == 1
FEW = (5, 9, 3)  # 17 samples, 3 shards for 4 consumers: 5 each, 3 repeated
BUCKET = "ddp-epochs"
MARK_BUCKET = "ddp-epoch-marks"  # HEAD /<it>/epoch-<e>: where epoch e ended
pytestmark = pytest.mark.timeout(JOB_TIMEOUT + 100)


def varied_samples(shard: int, count: int) -> list[tuple[str, Files]]:
    """shard_samples' keys, with sample sizes varying from 1 to 700 bytes."""
    return [
        (key, {**files, "bin": files["bin"][:1] * (1 + (i * 37 + shard * 11) % 700)})
        for i, (key, files) in enumerate(shard_samples(shard, count))
    ]


def shard_tars(counts: tuple[int, ...]) -> dict[str, bytes]:
    return {f"train-{s:06d}.tar": tar_bytes(varied_samples(s, n)) for s, n in enumerate(counts)}


def all_keys(counts: tuple[int, ...]) -> list[str]:
    return [key for s, n in enumerate(counts) for key, _ in shard_samples(s, n)]


def local_spec(root: Path, counts: tuple[int, ...]) -> str:
    shards = root / "shards"
    shards.mkdir()
    for name, data in shard_tars(counts).items():
        (shards / name).write_bytes(data)
    return f"{shards}/train-{{000000..{len(counts) - 1:06d}}}.tar"


def run_job(
    root: Path,
    spec: str,
    *extra: str,
    env: dict[str, str] | None = None,
    timeout: float = JOB_TIMEOUT,
) -> float:
    """Run the job to its end (it must exit 0); returns its wall time."""
    environment = job_env(**(env or {}))
    command = torchrun(
        RANKS,
        JOB,
        f"--spec={spec}",
        f"--cache={root / 'cache'}",
        f"--out={root / 'out'}",
        f"--workers={WORKERS}",
        *extra,
    )
    started = time.monotonic()
    done = subprocess.run(
        command,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    (root / "torchrun.stderr").write_text(done.stderr)
    assert done.returncode == 0, _rank_errors(done.stderr)
    return time.monotonic() - started


def _rank_errors(stderr: str) -> str:
    """What the ranks printed before torchrun's own traceback and summary (which say
    little: "exitcode 1")."""
    end = stderr.rfind("Traceback")
    before = stderr[:end] if end > 0 else stderr
    return before[-6000:] if before.strip() else stderr[-6000:]


def requests_by_epoch(
    s3: S3Server, bucket: str = BUCKET, mark_bucket: str = MARK_BUCKET
) -> tuple[list[Counter[str]], list[Counter[str]]]:
    """The server's requests since the last clear, split at the job's epoch marks
    (``--mark-epochs``): per epoch (and a last part after the last mark), the GETs per
    shard key and the requests per method."""
    gets: list[Counter[str]] = [Counter()]
    methods: list[Counter[str]] = [Counter()]  # every request, for the report
    for request in s3.requests():
        if request.bucket == mark_bucket:
            gets.append(Counter())
            methods.append(Counter())
            continue
        assert request.bucket == bucket, request
        methods[-1][request.method] += 1
        if request.method == "GET":
            gets[-1][request.key] += 1
    return gets, methods


def records(root: Path, ranks: int = RANKS, run: str = "") -> dict[int, dict[int, dict[str, Any]]]:
    """rank -> epoch -> that epoch's record (of the job's run ``run``: LOCAL_RUNS)."""
    found: dict[int, dict[int, dict[str, Any]]] = {}
    for rank in range(ranks):
        lines = (root / "out" / run / f"rank-{rank}.jsonl").read_text().splitlines()
        found[rank] = {}
        for record in map(json.loads, lines):
            assert record["epoch"] not in found[rank], "an epoch logged twice"
            found[rank][record["epoch"]] = record
    return found


def check_epoch(
    logged: dict[int, dict[int, dict[str, Any]]],
    epoch: int,
    keys: list[str],
    *,
    batch_size: int,
    remainder: str,
    workers: int = WORKERS,
) -> dict[str, int]:
    """Every check of one epoch over all ranks (those of ``logged``, each with ``workers``
    DataLoader workers); returns the epoch's sizes."""
    ranks = [logged[rank][epoch] for rank in range(len(logged))]
    consumers_count = len(ranks) * workers
    consumers = [c for record in ranks for c in record["consumers"]]
    assert sorted(c["slot"] for c in consumers) == list(range(consumers_count)), consumers
    job_wide = ("samples", "per_consumer", "repeated", "dropped")
    sizes = {name: consumers[0]["sizes"][name] for name in job_wide}
    for consumer in consumers:  # the job-wide figures are the same in every consumer
        assert {n: consumer["sizes"][n] for n in job_wide} == sizes, (epoch, consumers)
    each = sizes["per_consumer"]
    assert sizes["samples"] == len(keys)
    assert [c["sizes"]["own"] for c in consumers] == [each] * consumers_count
    assert sum(c["sizes"]["own_repeated"] for c in consumers) == sizes["repeated"]

    # Equal batches: every worker yields ceil(per_consumer / batch_size) of them.
    batches = [record["batches"] for record in ranks]
    assert batches == [workers * math.ceil(each / batch_size)] * len(ranks), (epoch, batches)
    for record in ranks:  # each rank delivered its consumers' shares, as their states say
        assert len(record["keys"]) == workers * each
        assert sum(c["delivered"] for c in record["consumers"]) == len(record["keys"])

    delivered = Counter(key for record in ranks for key in record["keys"])
    assert delivered.total() == consumers_count * each
    every = Counter(keys)
    extra = delivered - every
    assert set(extra) <= set(every), f"unknown keys delivered: {sorted(set(extra) - set(every))}"
    if remainder == "pad":
        assert sizes["dropped"] == 0
        assert sizes["repeated"] == consumers_count * each - len(keys)
        assert not every - delivered, f"epoch {epoch} missed {sorted(every - delivered)}"
        assert extra.total() == sizes["repeated"], (epoch, extra)
    else:
        assert sizes["repeated"] == 0
        assert sizes["dropped"] == len(keys) - consumers_count * each
        assert not extra, f"epoch {epoch} delivered twice: {sorted(extra)}"
        assert delivered.total() == sizes["samples"] - sizes["dropped"]
    return sizes


# The local-shard cases, run as one job (one torchrun launch, one process group and DDP
# model; each run its own dataset, cache and DataLoader): a run's name -> its options.
LOCAL_RUNS = {
    "pad": {"counts": UNEQUAL, "epochs": 2, "batch_size": 8, "remainder": "pad"},
    "drop": {"counts": UNEQUAL, "epochs": 2, "batch_size": 8, "remainder": "drop"},
    "epoch-size": {"counts": UNEQUAL, "epochs": 3, "batch_size": 8, "epoch_size": 400},
    "few": {"counts": FEW, "epochs": 2, "batch_size": 2},
}


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LOCAL_RUNS' job, run once for the module's tests of it: its out directory holds a
    directory per run (``<out>/<name>/rank-<r>.jsonl``). A failed job fails each of them."""
    root = tmp_path_factory.mktemp("local-runs")
    runs = []
    for name, options in LOCAL_RUNS.items():
        (root / name).mkdir()
        spec = local_spec(root / name, options["counts"])
        runs.append(
            {"name": name, "spec": spec, **{k: v for k, v in options.items() if k != "counts"}}
        )
    run_job(root, runs[0]["spec"], f"--runs={json.dumps(runs)}")
    return root


@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_unequal_local_shards_give_every_rank_the_same_batches(
    local_runs: Path, remainder: str
) -> None:
    logged = records(local_runs, run=remainder)
    for epoch in (0, 1):
        sizes = check_epoch(logged, epoch, all_keys(UNEQUAL), batch_size=8, remainder=remainder)
        if remainder == "pad":
            assert (sizes["per_consumer"], sizes["repeated"]) == (231, 3)
        else:
            assert (sizes["per_consumer"], sizes["dropped"]) == (230, 1)
    orders = [logged[0][e]["keys"] for e in (0, 1)]
    assert orders[0] != orders[1]  # a new order each epoch


def test_an_epoch_size_below_the_samples_cycles_through_them(local_runs: Path) -> None:
    """epoch_size=400 of 921 samples: every epoch 100 per consumer and no sample twice;
    over 3 epochs every sample (each cache cycles through its own)."""
    logged = records(local_runs, run="epoch-size")
    seen: Counter[str] = Counter()
    for epoch in (0, 1, 2):
        # Down-sampled, an epoch checks as a dropping one: the rest waits for later epochs.
        sizes = check_epoch(logged, epoch, all_keys(UNEQUAL), batch_size=8, remainder="drop")
        assert (sizes["per_consumer"], sizes["dropped"]) == (100, 521)
        seen.update(key for rank in logged for key in logged[rank][epoch]["keys"])
    assert set(seen) == set(all_keys(UNEQUAL))
    assert seen.total() == 1200 and max(seen.values()) <= 2


def test_fewer_shards_than_consumers(local_runs: Path) -> None:
    """3 shards, 4 consumers: no rank or worker is left empty. Batches of 2, so that each
    worker's 5 samples make 3 batches."""
    logged = records(local_runs, run="few")
    for epoch in (0, 1):
        sizes = check_epoch(logged, epoch, all_keys(FEW), batch_size=2, remainder="pad")
        assert (sizes["per_consumer"], sizes["repeated"]) == (5, 3)


def shard_gets(gets: Counter[str], tars: dict[str, bytes]) -> Counter[str]:
    """The GETs of shards (not of a kept index beside them)."""
    return Counter({key: n for key, n in gets.items() if key in tars})


def learned_records(cache: Path) -> list[Path]:
    """The sample records a cache wrote while learning offsets (``<scope>/.samples/``)."""
    return sorted(cache.glob("*/.samples/*/*.json"))


def test_later_epochs_make_no_get_at_rank_scope(s3, tmp_path: Path) -> None:
    """One job of 3 epochs over the S3 server, no index given; rank 0 marks each epoch's
    end in the server's log, which splits the GETs by epoch. Learning the offsets reads
    each shard once across the job (each rank its own cache's shards), evening out at most
    one more a cache; then a second job finds the index the first kept and learns nothing."""
    tars = shard_tars(UNEQUAL)
    s3.put_objects(BUCKET, tars)
    s3.clear_requests()
    spec = f"s3://{BUCKET}/train-{{000000..{len(UNEQUAL) - 1:06d}}}.tar"
    marks = f"--mark-epochs={s3.endpoint_url}/{MARK_BUCKET}"
    run_job(tmp_path, spec, "--epochs=3", "--batch-size=8", "--log-info", marks, env=s3.env())
    logged = records(tmp_path)
    for epoch in (0, 1, 2):
        check_epoch(logged, epoch, all_keys(UNEQUAL), batch_size=8, remainder="pad")

    gets, methods = requests_by_epoch(s3)
    assert len(gets) == 4, "the job did not mark the end of each of its 3 epochs"
    first, second, third, after = gets
    # Epoch 0 learns the offsets and reads: every shard, at most shards + caches GETs.
    assert set(first) == set(tars)
    assert first.total() <= len(tars) + RANKS, first
    assert not second, f"epoch 1 made GETs: {dict(second)}"
    assert not third, f"epoch 2 made GETs: {dict(third)}"
    assert not after
    print(f"requests by epoch: {[dict(m) for m in methods[:3]]}")
    stderr = (tmp_path / "torchrun.stderr").read_text()
    assert f"learned the sample offsets of {len(tars)} shards once across the job's 2 ranks" in (
        stderr
    ), stderr[-3000:]
    kept = list((tmp_path / "cache" / ".indexes").glob("*.json"))
    assert len(kept) == 1, kept
    assert f"torch.distributed); kept at {kept[0]} for the next job" in stderr

    # The next job: the kept index, nothing learned (no sample record made), no request.
    for record in learned_records(tmp_path / "cache"):
        record.unlink()
    (tmp_path / "out").rename(tmp_path / "out-1")
    s3.clear_requests()
    run_job(tmp_path, spec, "--epochs=1", "--batch-size=8", "--log-info", marks, env=s3.env())
    check_epoch(records(tmp_path), 0, all_keys(UNEQUAL), batch_size=8, remainder="pad")
    assert f"sample offsets of {len(tars)} shards: the index kept at {kept[0]}" in (
        (tmp_path / "torchrun.stderr").read_text()
    )
    assert not learned_records(tmp_path / "cache")
    assert not [r for r in s3.requests() if r.bucket == BUCKET and r.method == "GET"]


def test_an_index_kept_beside_the_data_serves_a_job_with_new_caches(s3, tmp_path: Path) -> None:
    """keep_index="data": the first job keeps the learned index beside the shards; a job
    with new caches reads it there, learns nothing and reads each of its shards once."""
    tars = shard_tars(UNEQUAL)
    s3.put_objects(BUCKET, tars)
    spec = f"s3://{BUCKET}/train-{{000000..{len(UNEQUAL) - 1:06d}}}.tar"
    job = ("--epochs=1", "--batch-size=8", "--keep-index=data", "--log-info")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run_job(tmp_path / "a", spec, *job, env=s3.env())
    beside = [key for key in s3.boto3_client().list_objects_v2(Bucket=BUCKET)["Contents"]]
    index_keys = [o["Key"] for o in beside if o["Key"] not in tars]
    assert len(index_keys) == 1 and index_keys[0].startswith(".shardcache-index-"), index_keys

    s3.clear_requests()
    run_job(tmp_path / "b", spec, *job, env=s3.env())
    check_epoch(records(tmp_path / "b"), 0, all_keys(UNEQUAL), batch_size=8, remainder="pad")
    stderr = (tmp_path / "b" / "torchrun.stderr").read_text()
    assert f"the index kept at s3://{BUCKET}/{index_keys[0]}" in stderr, stderr[-3000:]
    assert not learned_records(tmp_path / "b" / "cache")
    gets = Counter(r.key for r in s3.requests() if r.method == "GET" and r.bucket == BUCKET)
    assert set(shard_gets(gets, tars)) == set(tars)
    assert shard_gets(gets, tars).total() <= len(tars) + RANKS, gets
    assert gets[index_keys[0]] <= RANKS  # one look beside the data a rank


def test_at_node_scope_the_ranks_of_a_cache_share_its_shards(s3, tmp_path: Path) -> None:
    """SHARDCACHE_SCOPE=node: both ranks read through one cache and share learning its
    shards' offsets (each rank a part, gathered); every shard is fetched once in the job
    and scanned once."""
    tars = shard_tars(UNEQUAL)
    s3.put_objects(BUCKET, tars)
    s3.clear_requests()
    spec = f"s3://{BUCKET}/train-{{000000..{len(UNEQUAL) - 1:06d}}}.tar"
    run_job(
        tmp_path,
        spec,
        "--epochs=1",
        "--batch-size=8",
        "--log-info",
        env={**s3.env(), "SHARDCACHE_SCOPE": "node"},
    )
    check_epoch(records(tmp_path), 0, all_keys(UNEQUAL), batch_size=8, remainder="pad")
    gets = Counter(r.key for r in s3.requests() if r.method == "GET" and r.bucket == BUCKET)
    assert gets == Counter(tars.keys()), gets
    assert "once across the job's 2 ranks" in (tmp_path / "torchrun.stderr").read_text()
    assert len(list((tmp_path / "cache" / "node" / ".samples").glob("*/*.json"))) == len(tars)


def s3_job(s3: S3Server, job: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``job`` under torchrun (2 ranks) against the S3 server, whatever its exit status."""
    return subprocess.run(
        torchrun(RANKS, job, *args),
        env=job_env(**s3.env()),
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT,
        check=False,
    )


def test_a_shard_one_rank_cannot_learn_stops_every_rank_at_once(s3, tmp_path: Path) -> None:
    """A shard missing from the store: the rank learning it fails, and the other rank,
    waiting for its offsets, raises the same error (not the process group's error when
    its peer is gone, nor a wait for the collective timeout)."""
    tars = shard_tars(UNEQUAL)
    del tars["train-000007.tar"]
    s3.put_objects(BUCKET, tars)
    spec = f"s3://{BUCKET}/train-{{000000..{len(UNEQUAL) - 1:06d}}}.tar"
    done = s3_job(s3, JOB, f"--spec={spec}", f"--cache={tmp_path / 'cache'}", f"--out={tmp_path}")
    assert done.returncode != 0
    failed = [line for line in done.stderr.splitlines() if "could not learn" in line]
    assert {line.split(":", 1)[0] for line in failed} == {"[rank0]", "[rank1]"}, done.stderr[-4000:]
    assert all("rank 1 could not learn" in line for line in failed), failed
    assert "train-000007.tar does not exist" in failed[0]


def test_a_rank_that_never_joins_learning_is_named_after_the_timeout(s3, tmp_path: Path) -> None:
    """Only rank 0 uses the dataset: its learning, a collective, fails after the process
    group's 5 s timeout with a SampleIndexError saying every rank must call it (not an
    endless wait, nor torch's bare timeout)."""
    s3.put_objects(BUCKET, shard_tars(FEW))
    spec = f"s3://{BUCKET}/train-{{000000..{len(FEW) - 1:06d}}}.tar"
    done = s3_job(
        s3,
        SUPPORT / "lone_rank_job.py",
        f"--spec={spec}",
        f"--cache={tmp_path / 'cache'}",
        f"--out={tmp_path}",
        "--timeout=5",
    )
    assert done.returncode == 0, _rank_errors(done.stderr)
    outcome = json.loads((tmp_path / "rank-0.json").read_text())
    assert outcome["error"] == "SampleIndexError", outcome
    assert "every rank must call them" in outcome["message"], outcome


def shardcache_cli(*runs: tuple[list[str], dict[str, str]]) -> list[str]:
    """Run ``python -m shardcache ARGS`` once per ``(ARGS, env)``, all at once (bounded);
    each must exit 0. Returns their stdouts."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "shardcache", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args, env in runs
    ]
    deadline = time.monotonic() + CLI_TIMEOUT
    outs = []
    try:
        for proc, (args, _env) in zip(procs, runs, strict=True):
            out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            assert proc.returncode == 0, f"shardcache {' '.join(args)}: {proc.returncode}\n{err}"
            outs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs


def make_index(s3: S3Server, root: Path, spec: str, endpoint_url: str | None = None) -> Path:
    """``shardcache index SPEC -o FILE`` through a cache of its own (not the job's), over
    the server at ``endpoint_url`` (default: its own address)."""
    index = root / "train.index.json"
    shardcache_cli(
        (
            ["index", spec, "-o", str(index), "--cache-dir", str(root / "index-cache")],
            job_env(**s3.env(endpoint_url)),
        )
    )
    return index


def test_warm_then_train_makes_no_get(s3, tmp_path: Path) -> None:
    """``shardcache index``, then ``shardcache warm --split dataset`` once per rank (with
    torchrun's variables for each of the 2 ranks, rank scope), then the DDP job of 2
    epochs with that index: each rank warmed only its own cache's shards, and from the
    start of training to its end the server sees no GET."""
    tars = shard_tars(UNEQUAL)
    s3.put_objects(BUCKET, tars)
    spec = f"s3://{BUCKET}/train-{{000000..{len(UNEQUAL) - 1:06d}}}.tar"
    index = make_index(s3, tmp_path, spec)
    s3.clear_requests()

    cache = tmp_path / "cache"
    warm = ["warm", spec, "--split", "dataset", "--index", str(index), f"--seed={SEED}"]
    launcher = {"WORLD_SIZE": str(RANKS), "LOCAL_WORLD_SIZE": str(RANKS)}
    outs = shardcache_cli(
        *(
            (
                warm,
                job_env(
                    **s3.env(),
                    **launcher,
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    SHARDCACHE_DIR=str(cache),
                ),
            )
            for rank in range(RANKS)
        )
    )
    warm_gets = Counter(r.key for r in s3.requests("GET"))
    # What each rank's cache reads in every epoch: each rank warmed only that.
    expected: Counter[str] = Counter()
    for rank in range(RANKS):
        dataset = ResumableDataset(spec, seed=SEED, index=str(index), rank=rank, world_size=RANKS)
        expected.update(url.rsplit("/", 1)[1] for url in dataset.cache_urls())
        mine = len(dataset.cache_urls())
        assert f"warm: {mine} of {mine} shards ok" in outs[rank], outs
        assert outs[rank].rstrip().endswith(f"cache {cache / f'rank-{rank}'}"), outs
    assert set(warm_gets) == set(tars), "a shard no rank warmed"
    assert warm_gets == expected, (warm_gets, expected)
    assert warm_gets.total() < len(tars) * RANKS, warm_gets
    s3.clear_requests()

    run_job(
        tmp_path,
        spec,
        "--epochs=2",
        "--batch-size=8",
        f"--seed={SEED}",
        f"--index={index}",
        env={**s3.env(), "SHARDCACHE_DIR": str(cache)},
    )
    training = s3.requests()
    logged = records(tmp_path)
    for epoch in (0, 1):
        check_epoch(logged, epoch, all_keys(UNEQUAL), batch_size=8, remainder="pad")
    assert [r for r in training if r.method == "GET"] == [], "training made GETs"
    assert training == [], "training sent requests to S3"
    print(
        f"warm GETs: {warm_gets.total()} ({dict(warm_gets)}), "
        f"training requests: {dict(Counter(r.method for r in training))}"
    )
