"""The server's own ceiling, measured before the scenarios: every report states it."""

from __future__ import annotations

import os
from typing import Any

from bench.support.common import Bench, summarise, timed
from bench.support.infra import BUCKET, put


def server_ceiling(b: Bench) -> dict[str, Any]:
    """What moto serves unshaped: whole-object GETs from 4 client threads."""
    from concurrent.futures import ThreadPoolExecutor

    count, size = b.cfg["ceiling"]
    objects = {f"ceil-{i}.bin": os.urandom(size) for i in range(count)}
    put(b.s3, objects)
    client = b.s3.boto3_client()

    def get(key: str) -> int:
        return len(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())

    runs = []
    for _ in range(b.cfg["reps"]):
        with ThreadPoolExecutor(4) as pool:
            runs.append(timed(lambda: sum(pool.map(get, objects)), {"server": b.server_pid}))
    return summarise(runs, count * size)
