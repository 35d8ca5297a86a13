"""The old module paths (``convert``, ``dataset``, ``_format``) forward to ``store``, warning once a name."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import lightning_fastdata
from lightning_fastdata.store import cache, conversion, encode, format, reader, sources, summary, writer

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("old", "name", "new", "where"),
    [
        ("lightning_fastdata.convert", "convert", conversion, "lightning_fastdata"),
        ("lightning_fastdata.convert", "convert_dataset", conversion, "lightning_fastdata"),
        ("lightning_fastdata.convert", "ConversionSummary", summary, "lightning_fastdata"),
        ("lightning_fastdata.convert", "image_folder", sources, "lightning_fastdata.store.sources"),
        ("lightning_fastdata.convert", "train_folder", sources, "lightning_fastdata.store.sources"),
        ("lightning_fastdata.convert", "IMG_EXTENSIONS", sources, "lightning_fastdata.store.sources"),
        ("lightning_fastdata.convert", "clean_stale_conversions", writer, "lightning_fastdata.store.writer"),
        ("lightning_fastdata.convert", "Encoding", encode, "lightning_fastdata.store.encode"),
        ("lightning_fastdata.dataset", "LmdbImageDataset", reader, "lightning_fastdata"),
        ("lightning_fastdata.dataset", "collate_labels", reader, "lightning_fastdata.store.reader"),
        ("lightning_fastdata._format", "read_meta", format, "lightning_fastdata"),
        ("lightning_fastdata._format", "pack_record", format, "lightning_fastdata.store.format"),
        ("lightning_fastdata._format", "HEADER", format, "lightning_fastdata.store.format"),
        ("lightning_fastdata._format", "default_cache_dir", cache, "lightning_fastdata.store.cache"),
    ],
)
def test_an_old_path_gives_the_same_object_with_one_warning_naming_its_home(old, name, new, where):
    """Each name of a shim is its new home's object, with one one-line DeprecationWarning saying where it lives."""
    module = importlib.import_module(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(module, name)
    assert value is getattr(new, name)
    assert [w.category for w in caught] == [DeprecationWarning]
    message = str(caught[0].message)
    assert message == f"`{old}` is deprecated: import `{name}` from `{where}` instead."
    assert caught[0].filename == __file__  # points at the code to change, not at the shim


def test_from_import_of_an_old_path_warns():
    """``from lightning_fastdata.convert import image_folder`` (the usual form) warns and gives the new object."""
    with pytest.warns(DeprecationWarning, match=r"import `image_folder` from `lightning_fastdata\.store\.sources`"):
        from lightning_fastdata.convert import image_folder
    assert image_folder is sources.image_folder


def test_a_shim_forwards_no_unknown_or_dunder_name():
    """A name no new home defines is an AttributeError; ``__all__`` and friends are not borrowed from a home."""
    shim = importlib.import_module("lightning_fastdata.convert")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
            _ = shim.no_such_name
        assert not hasattr(shim, "__all__")


def test_convert_is_still_the_function_after_importing_the_old_module():
    """In a fresh interpreter, importing the submodule ``convert`` keeps ``lightning_fastdata.convert`` the function."""
    code = (
        "import importlib, types, warnings\n"
        "warnings.simplefilter('error')\n"  # importing the shim itself warns about nothing
        "import lightning_fastdata.convert as m\n"
        "module = importlib.import_module('lightning_fastdata.convert')\n"
        "warnings.simplefilter('ignore')\n"
        "from lightning_fastdata.convert import image_folder\n"
        "import lightning_fastdata\n"
        "from lightning_fastdata.store.conversion import convert\n"
        "assert isinstance(module, types.ModuleType), module\n"
        "assert lightning_fastdata.convert is convert and callable(lightning_fastdata.convert)\n"
        "assert m is convert\n"  # `import a.b as m` reads the attribute `b` of `a`: the function
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr


def test_the_package_exports_the_new_homes():
    """The public API names the objects in ``store``; nothing imported from the package warns."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lightning_fastdata.convert is conversion.convert
        assert lightning_fastdata.convert_dataset is conversion.convert_dataset
        assert lightning_fastdata.LmdbImageDataset is reader.LmdbImageDataset
        assert lightning_fastdata.read_meta is format.read_meta
        assert lightning_fastdata.read_sources is format.read_sources
        assert lightning_fastdata.SkippedFile is summary.SkippedFile


SHARED = ("short_side", "quality", "keep_original", "encoding", "num_workers", "strict", "force", "progress")


@pytest.mark.parametrize("name", [*SHARED, "initial_map_size"])
def test_convert_and_convert_dataset_share_each_option(name):
    """The shared options have one default, one type and one description, shown in full by both functions."""
    one, other = inspect.signature(conversion.convert), inspect.signature(conversion.convert_dataset)
    assert one.parameters[name].default == other.parameters[name].default
    assert one.parameters[name].annotation == other.parameters[name].annotation
    entry = next(line for line in conversion._OPTIONS_DOC.splitlines() if line.startswith(f"{name}: "))
    for func in (conversion.convert, conversion.convert_dataset):
        dst = next(line for line in func.__doc__.splitlines() if line.lstrip().startswith("dst: "))
        indent = dst[: len(dst) - len(dst.lstrip())]  # 8 spaces, or 4 where Python 3.13 dedents docstrings
        assert f"\n{indent}{entry}\n" in func.__doc__
        assert "{options}" not in func.__doc__
        assert "as in :func:`convert`" not in func.__doc__
