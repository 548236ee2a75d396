"""Each optional part without its extra fails with MissingExtraError naming the extra,
never a bare ModuleNotFoundError. Here a module is made absent by a ``None`` in
``sys.modules`` (as ``import`` treats it); scripts/check-dist does the same with a wheel
installed into a venv that really lacks the extras."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

import shardcache
from shardcache import MissingExtraError, job_state
from shardcache._cli.main import main
from shardcache._datasets.resume_state import MIXTURE_FORMAT
from shardcache._ops.demo import run_demo
from shardcache.testing import S3Server

TORCH = r"pip install 'shardcache\[torch\]'"


def _absent(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    # webdataset defines stand-ins of torch's classes for good when it is first imported
    # without torch: import it before torch is hidden, so later tests get the real ones.
    import webdataset  # noqa: F401

    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.parametrize("name", ["ResumableDataset", "MixtureDataset", "Source"])
def test_torch_classes_import_without_torch_and_fail_when_used(name, monkeypatch) -> None:
    _absent(monkeypatch, "torch")
    cls = getattr(shardcache, name)  # importing the name never fails
    assert cls is getattr(shardcache, name)
    assert cls.__module__ == "shardcache" and cls.__name__ == name
    with pytest.raises(MissingExtraError, match=TORCH) as info:
        cls(["s3://bucket/a.tar"])
    assert info.value.extra == "torch" and info.value.modules == ["torch"]
    assert isinstance(info.value, ImportError)
    assert str(info.value).startswith(f"shardcache.{name} needs torch, which is not installed")
    with pytest.raises(MissingExtraError, match=TORCH):
        cls.state_dict  # noqa: B018 - a class attribute, read
    copy = pickle.loads(pickle.dumps(info.value))
    assert (type(copy), str(copy), copy.extra) == (MissingExtraError, str(info.value), "torch")


def test_subclass_of_a_stand_in_fails_when_made(monkeypatch) -> None:
    _absent(monkeypatch, "torch")

    class Mine(shardcache.ResumableDataset):  # type: ignore[misc,name-defined]
        pass

    with pytest.raises(MissingExtraError, match=TORCH):
        Mine()


def test_star_import_works_without_torch(monkeypatch) -> None:
    _absent(monkeypatch, "torch")
    names: dict[str, object] = {}
    exec("from shardcache import *", names)
    assert set(shardcache.__all__) <= set(names)


def test_torch_classes_are_the_real_ones_with_torch() -> None:
    pytest.importorskip("torch")  # scripts/check-dist runs this file without torch too
    from shardcache._datasets.resumable import ResumableDataset

    assert shardcache.ResumableDataset is ResumableDataset


def test_mixture_job_state_without_torch(monkeypatch) -> None:
    _absent(monkeypatch, "torch")
    with pytest.raises(MissingExtraError, match=TORCH):
        job_state({"format": MIXTURE_FORMAT})


def test_s3server_without_the_testing_extra(monkeypatch) -> None:
    _absent(monkeypatch, "moto")
    with pytest.raises(MissingExtraError, match=r"pip install 'shardcache\[testing\]'") as info:
        S3Server().start()
    assert info.value.extra == "testing" and info.value.modules == ["moto"]


def test_demo_names_every_missing_extra(monkeypatch, tmp_path: Path) -> None:
    _absent(monkeypatch, "torch", "boto3")
    with pytest.raises(MissingExtraError) as info:
        run_demo(cache_dir=tmp_path)
    assert str(info.value) == (
        "shardcache demo needs torch, boto3, which are not installed: "
        "pip install 'shardcache[torch,testing]'"
    )
    assert info.value.extra == "torch,testing"
    with pytest.raises(MissingExtraError, match=TORCH):  # real data: no embedded S3 needed
        run_demo(source=str(tmp_path / "a.tar"), cache_dir=tmp_path)


@pytest.mark.parametrize(
    ("argv", "absent", "extra"),
    [
        (["demo"], ("torch", "moto"), "torch,testing"),
        (["warm", "a.tar", "--split", "dataset", "--index", "i.json"], ("torch",), "torch"),
    ],
)
def test_cli_without_an_extra_says_what_to_install(
    argv, absent, extra, monkeypatch, tmp_path: Path, capsys
) -> None:
    _absent(monkeypatch, *absent)
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--cache-dir", str(tmp_path / "cache")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardcache: MissingExtraError: ")
    assert f"pip install 'shardcache[{extra}]'" in err
    assert len(err.splitlines()) == 1
