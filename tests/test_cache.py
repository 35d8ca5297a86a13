from __future__ import annotations

from pathlib import Path

import pytest

from lightning_fastdata.store.cache import cache_root, converted_path, default_cache_dir


def test_converted_path_keeps_the_slot_names_of_earlier_versions():
    """The slot of a source is a fixed function of its path and settings: a changed name would convert again."""
    assert converted_path(Path("/data/pets"), Path("/cache"), 256, 90, "jpeg") == Path("/cache/pets-0fb5ace5b9.lmdb")
    slots = {
        converted_path(Path("/data/pets"), Path("/cache"), *settings)
        for settings in ((256, 90, "jpeg"), (None, 90, "jpeg"), (256, 80, "jpeg"), (256, 90, "raw"))
    }
    assert len(slots) == 4


def test_cache_root_is_cache_dir_else_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``cache_dir`` wins (``~`` expanded); without it ``$LIGHTNING_FASTDATA_CACHE``, else ``~/.cache``."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("LIGHTNING_FASTDATA_CACHE", raising=False)
    assert cache_root("~/mine") == tmp_path / "mine"
    assert cache_root(None) == default_cache_dir() == tmp_path / ".cache" / "lightning_fastdata"
    monkeypatch.setenv("LIGHTNING_FASTDATA_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
