"""Variables of other libraries that shardcache honours as they do: botocore's S3 endpoint
(``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``: which store a key names), gcsfs's switch of
its bucket-type look-ups (``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT``) and webdataset's cache and
security switches (``WDS_CACHE``, ``WDS_CACHE_SIZE``, ``WDS_SECURE``).

Read here, with the settings, so that no other module reads the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def s3_endpoint(env: Mapping[str, str] | None = None) -> str | None:
    """The S3 endpoint botocore would use when none is passed in code, or None (AWS)."""
    found = s3_endpoint_variable(env)
    return None if found is None else found[1]


def s3_endpoint_variable(env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """The variable that sets the S3 endpoint (botocore's order) and its value, or None."""
    env = os.environ if env is None else env
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if env.get(name):
            return name, env[name]
    return None


def gcsfs_extended(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` is set to true (``true`` or ``1``, as
    gcsfs reads it): only then does shardcache use gcsfs's extended file system, which asks
    a gRPC API for each bucket's type (zonal and hierarchical-namespace buckets). Unset,
    gcsfs would make that look-up too, which fails against emulators and private endpoints
    after tens of seconds, every time; shardcache then uses the plain file system."""
    env = os.environ if env is None else env
    return env.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "").strip().lower() in ("true", "1")


def webdataset_cache(env: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """``WDS_CACHE`` and ``WDS_CACHE_SIZE`` as set (None where unset), unparsed: the
    WebDataset class judges them with the arguments they override."""
    env = os.environ if env is None else env
    return env.get("WDS_CACHE"), env.get("WDS_CACHE_SIZE")


def webdataset_secure(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``WDS_SECURE`` turns webdataset's security on (set, and neither empty nor 0),
    as webdataset reads it when it is imported."""
    env = os.environ if env is None else env
    return env.get("WDS_SECURE", "0").strip() not in ("", "0")
