"""Test and demo infrastructure: a real S3 server (moto) on loopback and a fault proxy.

``S3Server`` needs the ``testing`` extra (``pip install 'shardcache[testing]'``: moto's
server and boto3); ``FaultProxy`` needs nothing more.
"""

from shardcache.testing.faultproxy import (
    FaultProxy,
    FaultRule,
    FaultRules,
    InjectedFault,
    ProxyStats,
)
from shardcache.testing.s3server import Request, S3Server

__all__ = [
    "FaultProxy",
    "FaultRule",
    "FaultRules",
    "InjectedFault",
    "ProxyStats",
    "Request",
    "S3Server",
]
