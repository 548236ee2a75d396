"""What a failed fetch's message tells the user to check: by the kind of the URL, and for
the errors about a whole store (a refused connection, a missing bucket) where requests go."""

from __future__ import annotations

from .._base.url_kinds import LOCAL_PROTOCOLS, local_path, url_protocol


def not_found_advice(url: str) -> str:
    """What to check when ``url`` does not exist, by its kind."""
    protocol = url_protocol(url)
    if protocol in LOCAL_PROTOCOLS:
        return f"Check the path (read as {local_path(url)}) and that the file system is mounted."
    if protocol == "s3":
        return "Check the bucket and key (and the endpoint: AWS_ENDPOINT_URL / storage_options)."
    if protocol in ("gs", "gcs"):
        return "Check the bucket and object name (and endpoint_url in storage_options, if any)."
    if protocol in ("abfs", "abfss", "az"):
        return "Check the container and blob name (and the account in storage_options)."
    return "Check the URL (and the endpoint in storage_options, if any)."


def _endpoint_words(url: str, endpoint: str | None) -> str:
    if endpoint:
        return endpoint
    protocol = url_protocol(url)
    if protocol in ("http", "https"):
        return "the host in the URL"
    return f"{protocol}'s default endpoint (no endpoint is set)"


def refused_text(url: str, what: str, refused_by: str, endpoint: str | None) -> str:
    """The message of a connection ``refused_by`` refused while ``what``-ing ``url``;
    ``endpoint`` says where requests go and what set it (None: the default)."""
    return (
        f"could not {what} {url}: the connection was refused by {refused_by}; requests go "
        f"to {_endpoint_words(url, endpoint)}. Nothing accepts connections there: check that "
        "endpoint's host and port, and that its server is running."
    )


def missing_bucket_text(url: str, cause: str, endpoint: str | None) -> str:
    """The message of ``url``'s bucket (or container) not existing."""
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    return (
        f"{url}: the bucket {bucket!r} does not exist at {_endpoint_words(url, endpoint)} "
        f"({cause}), so no shard in it can be read; failed at once, without retries. Check "
        "the bucket's name in the URL, and "
        "that the endpoint is the store that holds it."
    )
