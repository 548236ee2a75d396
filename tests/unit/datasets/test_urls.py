"""expand_urls: brace expansion, lists, manifests, and every UrlError case."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from shardcache import expand_urls
from shardcache._base.errors import UrlError
from shardcache._base.url_kinds import url_protocol
from shardcache._datasets.url_braces import MAX_EXPANSION
from shardcache._datasets.urls import read_manifest

# --------------------------------------------------------------------------- expansion


def test_range_zero_padded_in_order() -> None:
    urls = expand_urls("s3://b/train-{000000..000003}.tar")
    assert urls == [f"s3://b/train-00000{i}.tar" for i in range(4)]


def test_large_range_order_and_padding() -> None:
    urls = expand_urls("s3://b/train-{000000..000999}.tar")
    assert len(urls) == 1000
    assert urls[0] == "s3://b/train-000000.tar"
    assert urls[-1] == "s3://b/train-000999.tar"
    assert urls == sorted(urls)


def test_lists_nested_and_steps() -> None:
    assert expand_urls("gs://b/{a,b}/x{1..3..2}.tar") == [
        "gs://b/a/x1.tar",
        "gs://b/a/x3.tar",
        "gs://b/b/x1.tar",
        "gs://b/b/x3.tar",
    ]
    assert expand_urls("s3://b/{x{1..2},y}.tar") == [
        "s3://b/x1.tar",
        "s3://b/x2.tar",
        "s3://b/y.tar",
    ]


def test_descending_and_char_ranges() -> None:
    assert expand_urls("s3://b/{3..1}.tar") == ["s3://b/3.tar", "s3://b/2.tar", "s3://b/1.tar"]
    assert expand_urls("s3://b/{a..c}.tar") == ["s3://b/a.tar", "s3://b/b.tar", "s3://b/c.tar"]


def test_escaped_braces_are_literal() -> None:
    assert expand_urls(r"s3://b/x\{1\}.tar") == ["s3://b/x{1}.tar"]


def test_no_braces_and_local_paths_kept_as_given() -> None:
    assert expand_urls("s3://b/one.tar") == ["s3://b/one.tar"]
    assert expand_urls("/data/shard-{0..1}.tar") == ["/data/shard-0.tar", "/data/shard-1.tar"]
    assert expand_urls("rel/x.tar") == ["rel/x.tar"]
    assert expand_urls("file:///data/x.tar") == ["file:///data/x.tar"]


def test_lists_concatenate_in_order() -> None:
    urls = expand_urls(["s3://b/a-{0..1}.tar", "https://h/x.tar", Path("/d/{p,q}.tar")])
    assert urls == [
        "s3://b/a-0.tar",
        "s3://b/a-1.tar",
        "https://h/x.tar",
        "/d/p.tar",
        "/d/q.tar",
    ]
    assert expand_urls(u for u in ("s3://b/1.tar", "s3://b/2.tar")) == [
        "s3://b/1.tar",
        "s3://b/2.tar",
    ]


def test_double_colon_separates_specs_like_webdataset() -> None:
    assert expand_urls("s3://a/{0..1}.tar::s3://b/x.tar") == [
        "s3://a/0.tar",
        "s3://a/1.tar",
        "s3://b/x.tar",
    ]


def test_url_protocol() -> None:
    assert url_protocol("s3://b/k") == "s3"
    assert url_protocol("GS://b/k") == "gs"
    assert url_protocol("https://h/k") == "https"
    assert url_protocol("/abs/path.tar") == "file"
    assert url_protocol("rel/path.tar") == "file"
    assert url_protocol("file:///x") == "file"


# ---------------------------------------------------------------------------- manifests


def test_text_manifest(tmp_path: Path) -> None:
    manifest = tmp_path / "shards.txt"
    manifest.write_text(
        "# training shards\n"
        "\n"
        "s3://b/train-{00..02}.tar\n"
        "   s3://b/extra.tar   \r\n"
        "  # indented comment\n"
        f"{tmp_path}/local.tar\n"
    )
    expected = [
        "s3://b/train-00.tar",
        "s3://b/train-01.tar",
        "s3://b/train-02.tar",
        "s3://b/extra.tar",
        f"{tmp_path}/local.tar",
    ]
    assert expand_urls(f"@{manifest}") == expected
    assert expand_urls(str(manifest)) == expected  # an existing .txt path is a manifest
    assert expand_urls(manifest) == expected


def test_dot_manifest_suffix_is_text(tmp_path: Path) -> None:
    manifest = tmp_path / "shards.manifest"
    manifest.write_text("s3://b/a.tar\ns3://b/b.tar\n")
    assert expand_urls(str(manifest)) == ["s3://b/a.tar", "s3://b/b.tar"]


@pytest.mark.parametrize(
    "payload",
    [
        ["s3://b/a.tar", "s3://b/c-{0..1}.tar"],
        [{"url": "s3://b/a.tar"}, "s3://b/c-{0..1}.tar"],
        {"shards": ["s3://b/a.tar", {"url": "s3://b/c-0.tar"}, {"url": "s3://b/c-1.tar"}]},
    ],
)
def test_json_manifest(tmp_path: Path, payload: object) -> None:
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps(payload))
    expected = ["s3://b/a.tar", "s3://b/c-0.tar", "s3://b/c-1.tar"]
    assert expand_urls(f"@{manifest}") == expected
    assert expand_urls(str(manifest)) == expected


def test_json_object_entries_keep_metadata_unexpanded(tmp_path: Path) -> None:
    manifest = tmp_path / "m.json"
    entry = {"url": "s3://b/{literal}.tar", "size": 10, "sha256": "ab"}
    manifest.write_text(json.dumps({"shards": [entry]}))
    [read] = read_manifest(manifest)
    assert read.url == "s3://b/{literal}.tar"
    assert read.meta == {"size": 10, "sha256": "ab"}


def test_manifest_inside_list(tmp_path: Path) -> None:
    manifest = tmp_path / "m.txt"
    manifest.write_text("s3://b/m.tar\n")
    assert expand_urls(["s3://b/first.tar", f"@{manifest}"]) == ["s3://b/first.tar", "s3://b/m.tar"]


def test_missing_txt_path_is_not_a_manifest(tmp_path: Path) -> None:
    # Only an existing local file is read as a manifest; anything else is a URL.
    assert expand_urls(str(tmp_path / "nope.txt")) == [str(tmp_path / "nope.txt")]


# ------------------------------------------------------------------------------ errors


def _error(spec: object) -> UrlError:
    with pytest.raises(UrlError) as info:
        expand_urls(spec)  # type: ignore[arg-type]
    return info.value


@pytest.mark.parametrize(
    ("spec", "expected_words"),
    [
        ("s3://b/x-{0..3.tar", ["Unbalanced", "unclosed"]),
        ("{a,b", ["Unbalanced"]),
        ("}", ["Unbalanced", "stray"]),
        ("s3://b/}{0..1}", ["Unbalanced", "stray"]),
        ("s3://b/{a,b}}.tar", ["Unbalanced"]),
        ("s3://b/{abc}.tar", ["Malformed brace"]),
        ("s3://b/{0...9}.tar", ["Malformed brace"]),
        ("s3://b/{}.tar", ["Malformed brace"]),
        ("s3://b/x-{0..10000000}.tar", ["too large", "10,000,001"]),
        ("s3://b/{0..9999}/{0..9999}.tar", ["too large", "100,000,000"]),
        ("s3://b/a\x00b.tar", ["NUL"]),
        ("s3://b/a\nb.tar", ["newline"]),
        ("s3://b/a\rb.tar", ["carriage return"]),
        ("nosuchproto://b/a.tar", ["Unknown URL protocol", "nosuchproto"]),
        ("s3:/b/a.tar", ["Malformed URL scheme"]),
        ("simplecache::s3://b/a.tar", ["chaining"]),
        ("", ["Empty"]),
        ("s3://b/a.tar::", ["Empty"]),
    ],
)
def test_url_errors_name_spec_and_hint(spec: str, expected_words: list[str]) -> None:
    exc = _error(spec)
    message = str(exc)
    assert repr(spec) in message  # the offending spec, repr'd
    for word in expected_words:
        assert word in message
    assert "Expected" in message and "got" in message
    assert exc.hint and exc.hint in message  # what to do
    assert isinstance(exc, ValueError)


def test_huge_range_is_refused_without_expanding() -> None:
    # braceexpand would materialise 10**15 items; the count is computed first.
    exc = _error("s3://b/{000000000000000..999999999999999}.tar")
    assert exc.count == 10**15
    assert f"{MAX_EXPANSION:,}" in str(exc)


def test_too_long_url_message_is_truncated() -> None:
    url = "s3://b/" + "a" * 9000
    exc = _error(url)
    message = str(exc)
    assert "too long" in message
    assert "9007 bytes" in message
    assert len(message) < 1000
    assert "(9007 characters)" in message


def test_empty_list_and_bad_types() -> None:
    assert "Empty" in str(_error([]))
    assert "Bad shard spec" in str(_error(b"s3://b/a.tar"))
    assert "Bad shard spec" in str(_error(42))
    assert "Bad shard spec" in str(_error({"shards": ["s3://b/a.tar"]}))
    exc = _error(["s3://b/a.tar", 7])
    assert "(item 1)" in str(exc)


def test_error_for_generator_spec_pickles() -> None:
    exc = _error(u for u in ())
    assert "Empty" in str(exc)
    assert str(pickle.loads(pickle.dumps(exc))) == str(exc)


def test_list_item_error_names_item() -> None:
    exc = _error(["s3://b/a.tar", "s3://b/{0..2.tar"])
    assert "(item 1)" in str(exc)
    assert "'s3://b/{0..2.tar'" in str(exc)


def test_error_pickles() -> None:
    exc = _error("s3://b/{0..2.tar")
    clone = pickle.loads(pickle.dumps(exc))
    assert type(clone) is UrlError
    assert str(clone) == str(exc)
    assert clone.spec == "s3://b/{0..2.tar"


@pytest.mark.parametrize(
    ("name", "content", "expected_words"),
    [
        ("empty.txt", "", ["Empty manifest"]),
        ("comments.txt", "# nothing\n\n   \n", ["Empty manifest"]),
        ("empty.json", "[]", ["Empty manifest"]),
        ("bad.json", '["s3://b/a.tar",\n  oops]', ["Cannot parse JSON", "line 2"]),
        ("shape.json", '{"files": []}', ["Unexpected JSON manifest layout", "shards"]),
        ("scalar.json", '"s3://b/a.tar"', ["Unexpected JSON manifest layout"]),
        ("entry.json", '[{"path": "s3://b/a.tar"}]', ["Bad JSON manifest entry", "entry 0"]),
        ("rel.txt", "s3://b/a.tar\nrelative/x.tar\n", ["Relative entry", "line 2"]),
        ("rel.json", '["s3://b/a.tar", "x.tar"]', ["Relative entry", "entry 1"]),
        ("brace.txt", "s3://b/a.tar\n\ns3://b/{0..1.tar\n", ["Unbalanced", "line 3"]),
        ("proto.txt", "zzz://b/a.tar\n", ["Unknown URL protocol", "line 1", "zzz"]),
        ("cr.txt", "s3://b/a\rb.tar\n", ["carriage return", "line 1"]),
        ("nested.txt", "@/other.txt\n", ["Relative entry", "line 1"]),
    ],
)
def test_manifest_errors(
    tmp_path: Path, name: str, content: str, expected_words: list[str]
) -> None:
    manifest = tmp_path / name
    manifest.write_text(content, newline="")
    exc = _error(f"@{manifest}")
    message = str(exc)
    assert str(manifest) in message
    for word in expected_words:
        assert word in message, message
    assert exc.hint in message


def test_unreadable_manifest(tmp_path: Path) -> None:
    exc = _error(f"@{tmp_path}/missing.txt")
    assert "Cannot read manifest" in str(exc)
    assert "missing.txt" in str(exc)
    not_utf8 = tmp_path / "bin.txt"
    not_utf8.write_bytes(b"\xff\xfe\x00garbage")
    assert "Cannot read manifest" in str(_error(f"@{not_utf8}"))
