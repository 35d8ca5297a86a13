from __future__ import annotations

import ast
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_fastdata import LmdbImageDataset, __version__, convert, make_image_folder, read_meta
from lightning_fastdata.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _convert_args(src, dst, *extra: str) -> list[str]:
    return ["convert", str(src), str(dst), "--quiet", "--workers", "0", *extra]


def test_convert_prints_the_summary_and_returns_0(split_folder, tmp_path, capsys):
    """``convert`` writes the database, prints the summary on stdout and exits 0."""
    dst = tmp_path / "db"
    assert main(_convert_args(split_folder, dst, "--short-side", "64", "--quality", "80")) == 0
    out = capsys.readouterr().out
    assert f"wrote 33 images (train=24, val=9) to {dst}" in out
    assert "skipped   0" in out
    assert read_meta(dst)["encoding"] == {"short_side": 64, "quality": 80, "keep_original": False, "encoding": "jpeg"}


def test_convert_rerun_and_force(split_folder, tmp_path, capsys):
    """A second identical ``convert`` reports up to date; ``--force`` converts again."""
    dst = tmp_path / "db"
    assert main(_convert_args(split_folder, dst)) == 0
    capsys.readouterr()
    assert main(_convert_args(split_folder, dst)) == 0
    assert "up to date (33 images); nothing to do" in capsys.readouterr().out
    assert main(_convert_args(split_folder, dst, "--force")) == 0
    assert "wrote 33 images" in capsys.readouterr().out


def test_convert_short_side_zero_and_keep_original(split_folder, tmp_path, capsys):
    """``--short-side 0`` keeps sizes; ``--keep-original`` is passed through to the stored options."""
    dst = tmp_path / "db"
    assert main(_convert_args(split_folder, dst, "--short-side", "0", "--keep-original")) == 0
    assert read_meta(dst)["encoding"] == {"short_side": None, "quality": 90, "keep_original": True, "encoding": "jpeg"}
    source = sorted((split_folder / "val").glob("*/*.jpg"))[0]
    assert LmdbImageDataset(dst, "val").read_record(0)[1] == source.read_bytes()


def test_convert_missing_src_returns_2(tmp_path, capsys):
    """A missing source exits 2 with ``error:`` and the layout help on stderr, and writes nothing."""
    assert main(_convert_args(tmp_path / "missing", tmp_path / "db")) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ")
    assert "does not exist" in captured.err
    assert "SRC/<class_a>/<image>.jpg" in captured.err
    assert captured.out == ""
    assert not (tmp_path / "db").exists()


def test_convert_bad_option_value_returns_2(split_folder, tmp_path, capsys):
    """An out-of-range option value exits 2 with ``error:`` naming it."""
    assert main(_convert_args(split_folder, tmp_path / "db", "--quality", "0")) == 2
    assert "error: `quality` must be in 1..100" in capsys.readouterr().err


def test_convert_strict_with_bad_file_returns_1(tmp_path, capsys):
    """``--strict`` with a file that cannot be converted exits 1, naming the file, and writes nothing."""
    src = tmp_path / "src" / "cat"
    src.mkdir(parents=True)
    (src / "broken.jpg").write_text("not an image")
    (src / "empty.png").write_bytes(b"")
    assert main(_convert_args(tmp_path / "src", tmp_path / "db", "--strict")) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert "strict" in err
    assert "broken.jpg" in err
    assert not (tmp_path / "db").exists()


def test_convert_without_strict_skips_and_lists_bad_files(split_folder_copy, tmp_path, capsys):
    """Without ``--strict`` a bad file is skipped and listed in the printed summary."""
    bad = split_folder_copy / "train" / "class_0" / "zz_broken.jpg"
    bad.write_text("not an image")
    assert main(_convert_args(split_folder_copy, tmp_path / "db")) == 0
    out = capsys.readouterr().out
    assert "skipped   1" in out
    assert f"skipped {bad}: not an image" in out


def test_convert_keyboard_interrupt_returns_130(split_folder, tmp_path, capsys, monkeypatch):
    """Ctrl-C during ``convert`` exits 130 with a message that nothing was published."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("lightning_fastdata.store.conversion.convert", interrupted)
    assert main(_convert_args(split_folder, tmp_path / "db")) == 130
    assert "nothing was published" in capsys.readouterr().err


def test_convert_into_foreign_folder_returns_2(split_folder, tmp_path, capsys):
    """A ``dst`` that holds other files is bad input: exit 2, and it is left alone."""
    dst = tmp_path / "mine"
    dst.mkdir()
    (dst / "keep.txt").write_text("keep")
    assert main(_convert_args(split_folder, dst)) == 2
    assert "refusing to replace it" in capsys.readouterr().err
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]


def test_synth_writes_the_folder(tmp_path, capsys):
    """``synth`` writes ``train/`` and ``val/`` class folders with the requested counts and converts cleanly."""
    dst = tmp_path / "synth"
    args = ["synth", str(dst), "--classes", "3", "--train", "4", "--val", "2", "--min-size", "20", "--max-size", "30"]
    assert main(args) == 0
    assert f"wrote 18 synthetic JPEGs in 3 classes to {dst}" in capsys.readouterr().out
    assert sorted(p.name for p in dst.iterdir()) == ["train", "val"]
    assert sorted(p.name for p in (dst / "train").iterdir()) == ["class_0", "class_1", "class_2"]
    assert len(list((dst / "train").glob("*/*.jpg"))) == 12
    assert len(list((dst / "val").glob("*/*.jpg"))) == 6
    summary = convert(dst, tmp_path / "db", num_workers=0, progress=False)
    assert summary.splits == {"train": 12, "val": 6}


def test_synth_val_zero_writes_a_plain_image_folder(tmp_path, capsys):
    """``synth --val 0`` writes a plain ImageFolder."""
    dst = tmp_path / "flat"
    assert (
        main(
            ["synth", str(dst), "--classes", "2", "--train", "3", "--val", "0", "--min-size", "16", "--max-size", "24"]
        )
        == 0
    )
    assert sorted(p.name for p in dst.iterdir()) == ["class_0", "class_1"]
    assert len(list(dst.glob("*/*.jpg"))) == 6


def test_synth_into_a_folder_that_holds_files_needs_force(tmp_path, capsys):
    """``synth`` into a non-empty folder (a user's dataset) exits 2 with one line and writes nothing; ``--force``
    writes into it. An empty folder, or one holding only hidden files, is written without asking."""
    dst = tmp_path / "mine"
    (dst / "cat").mkdir(parents=True)
    (dst / "cat" / "1.jpg").write_bytes(b"mine")
    (dst / "dog").mkdir()
    small = ["--classes", "2", "--train", "1", "--val", "0", "--min-size", "16", "--max-size", "16"]
    assert main(["synth", str(dst), *small]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: `dst` {str(dst)!r} is not empty (it holds 2 entries: cat, dog); synth would add its classes to them"
        " and overwrite same-named images. Pick a new folder, or pass --force to write into it anyway."
    ]
    assert sorted(p.name for p in dst.iterdir()) == ["cat", "dog"]
    assert main(["synth", str(dst), *small, "--force"]) == 0
    assert sorted(p.name for p in dst.iterdir()) == ["cat", "class_0", "class_1", "dog"]
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / ".DS_Store").write_bytes(b"")
    assert main(["synth", str(hidden), *small]) == 0


def test_synth_invalid_counts_return_2(tmp_path, capsys):
    """Invalid ``synth`` arguments exit 2 with ``error:``."""
    assert main(["synth", str(tmp_path / "x"), "--classes", "0"]) == 2
    assert "error:" in capsys.readouterr().err


def test_version_and_usage_errors(capsys):
    """``--version`` prints the version; a missing or unknown command is an argparse usage error (exit 2)."""
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert __version__ in capsys.readouterr().out
    for argv in ([], ["frobnicate"], ["convert"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2


def test_convert_onto_another_sources_database_returns_2(split_folder, tmp_path, capsys):
    """Converting another folder onto a database exits 2 saying ``--force`` replaces it; with it, exit 0."""
    other = tmp_path / "other"
    make_image_folder(other, num_classes=2, train_per_class=2, val_per_class=0, min_size=16, max_size=24)
    dst = tmp_path / "db"
    assert main(_convert_args(split_folder, dst)) == 0
    capsys.readouterr()
    assert main(_convert_args(other, dst)) == 2
    err = capsys.readouterr().err
    assert f"holds a database converted from {str(split_folder)!r}" in err
    assert "--force" in err
    assert main(_convert_args(other, dst, "--force")) == 0


def test_convert_waits_for_a_held_lock_and_says_so(split_folder, tmp_path, caplog):
    """A second conversion to the same ``dst`` logs that it waits for the first, then completes."""
    import fcntl
    import threading

    dst = tmp_path / "db"
    with open(tmp_path / ".db.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        threading.Timer(0.5, fcntl.flock, (held, fcntl.LOCK_UN)).start()
        with caplog.at_level("WARNING", logger="lightning_fastdata.store.writer"):
            summary = convert(split_folder, dst, num_workers=0, progress=False)
    assert summary.written == 33
    assert f"waiting for another conversion to {dst} to finish" in caplog.text


def _main_in_a_new_process(*args: str) -> tuple[str, list[str]]:
    """``main(args)`` in a new interpreter: what it printed, and which of torch, Lightning, torchvision it imported."""
    code = (
        "import sys\n"
        "from lightning_fastdata.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as done:\n    assert done.code in (0, None)\n"
        "print(sorted(m for m in ('torch', 'lightning', 'torchvision') if m in sys.modules), file=sys.stderr)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=True)
    return proc.stdout, ast.literal_eval(proc.stderr.strip().splitlines()[-1])


def test_help_imports_neither_torch_nor_lightning():
    """``lightning-fastdata --help`` starts without importing torch or Lightning (they cost seconds)."""
    out, imported = _main_in_a_new_process("--help")
    assert "convert" in out
    assert imported == []


def test_fit_from_the_console_does_not_warn_about_args(monkeypatch, recwarn):
    """``lightning-fastdata fit`` hands LightningCLI no ``args`` of its own: no "args parameter" warning."""
    monkeypatch.setattr(sys, "argv", ["lightning-fastdata", "fit", "--help"])
    with pytest.raises(SystemExit):
        main()
    assert not [w for w in recwarn if "args parameter is intended" in str(w.message)]


def test_convert_under_a_file_returns_2_with_one_line(split_folder, tmp_path, capsys):
    """A ``dst`` whose parent is a file: one ``error:`` line naming that file, exit 2."""
    blocker = tmp_path / "afile"
    blocker.write_text("a file")
    assert main(_convert_args(split_folder, blocker / "db.lmdb")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: `dst` {str(blocker / 'db.lmdb')!r} cannot be created: {str(blocker)!r} is a file")
    assert len(err.strip().splitlines()) == 1


_MAIN = "import sys\nfrom lightning_fastdata.cli import main\nsys.exit(main(sys.argv[1:]))"


def test_convert_into_a_read_only_folder_returns_2_with_one_line(split_folder, tmp_path, read_only_python):
    """A new conversion on a read-only file system: one ``error:`` line naming `dst` and its folder, exit 2."""
    out = tmp_path / "ro"
    out.mkdir()
    dst = out / "db.lmdb"
    proc = read_only_python([out], _MAIN, "convert", str(split_folder), str(dst), "--workers", "0", "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: `dst` {str(dst)!r} cannot be written: its folder {str(out)!r} is read-only (Read-only file system)."
        " Convert into a writable folder, or convert there first and make it read-only afterwards."
    ]
    assert sorted(out.iterdir()) == []


def test_convert_of_an_up_to_date_database_in_a_read_only_folder_returns_0(split_folder, tmp_path, read_only_python):
    """An up-to-date database on a read-only file system is reported up to date (no lock file is needed)."""
    out = tmp_path / "ro"
    dst = out / "db.lmdb"
    assert main(_convert_args(split_folder, dst)) == 0
    proc = read_only_python([out], _MAIN, "convert", str(split_folder), str(dst), "--workers", "0", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{dst} is up to date (33 images); nothing to do. Use --force to rebuild."


def test_convert_into_a_closed_pipe_exits_quietly(split_folder, tmp_path):
    """``convert ... | head -1``: the reader is gone before the summary is printed; no traceback, exit 141."""
    dst = tmp_path / "db"
    cmd = [sys.executable, "-m", "lightning_fastdata.cli", *_convert_args(split_folder, dst)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # as `head -1` does once it has its line; here before anything is written
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""
    assert read_meta(dst)["complete"] is True


def test_top_level_help_lists_the_lightning_commands(capsys):
    """``lightning-fastdata --help`` lists fit, validate, test and predict as commands, with what each does."""
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("fit", "validate", "test", "predict", "convert", "bench"):
        assert re.search(rf"^ {{4}}{command} +\S", out, re.MULTILINE), out
    assert "{convert,synth,bench,profile,fit,validate,test,predict}" in out or "COMMAND" in out


def test_fit_help_a_second_time_imports_neither_torch_nor_lightning(tmp_path, monkeypatch, capsys):
    """``fit --help`` is LightningCLI's text; kept in the cache, a later call prints it without importing Lightning."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # where --help is cached
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(sys, "argv", ["lightning-fastdata"])  # pytest's own arguments are not the CLI's
    with pytest.raises(SystemExit) as info:
        main(["fit", "--help"])
    assert info.value.code == 0
    first = capsys.readouterr().out
    assert first.startswith("usage: lightning-fastdata [options] fit")
    assert "--trainer.max_epochs" in first
    out, imported = _main_in_a_new_process("fit", "--help")
    assert imported == []
    assert out == first


def test_cache_help_ahead_makes_the_first_call_quick_in_any_wide_terminal(tmp_path, monkeypatch):
    """``cache_help()`` (what ``make`` runs after installing) renders the help where there is no terminal; the first
    ``fit --help`` in a wider terminal then prints it without importing torch or Lightning."""
    from lightning_fastdata.cli import HELP_COLUMNS, cache_help

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # where --help is cached
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "argv", ["lightning-fastdata"])
    (path,) = cache_help(["fit"])
    assert "COLUMNS" not in os.environ  # put back as it was
    text = path.read_text()
    assert text.startswith("usage: lightning-fastdata [options] fit")
    # the options' descriptions are wrapped to the width (the usage's `[--option METAVAR]` are never broken)
    described = [line for line in text.splitlines() if line.startswith(" " * 24) and line.lstrip()[:1] != "["]
    assert len(described) > 100
    assert max(map(len, described)) <= HELP_COLUMNS
    monkeypatch.setenv("COLUMNS", "200")
    out, imported = _main_in_a_new_process("fit", "--help")
    assert imported == []
    assert out == text
    with pytest.raises(ValueError, match="'fitt' is not one of LightningCLI's commands"):
        cache_help(["fitt"])


def test_fit_help_cache_is_keyed_by_the_subpackages_too(tmp_path, monkeypatch):
    """An edited module of ``store/`` or ``monitor/`` changes where ``--help`` is cached, so stale text is not shown."""
    from lightning_fastdata.cli import help_cache
    from lightning_fastdata.monitor import verdict

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # where --help is cached
    before = help_cache.help_path("fit")
    source = Path(verdict.__file__)
    stat = source.stat()
    try:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
        assert help_cache.help_path("fit") != before
    finally:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert help_cache.help_path("fit") == before


def test_the_help_cache_does_not_move_with_the_data_cache(tmp_path, monkeypatch):
    """``--help`` is cached in the user's cache folder, not ``$LIGHTNING_FASTDATA_CACHE``: pointing the databases
    elsewhere (a job's scratch disk) does not make the first ``fit --help`` import Lightning again (it took 16 s)."""
    from lightning_fastdata.cli import cache_help

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("LIGHTNING_FASTDATA_CACHE", str(tmp_path / "databases"))
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "argv", ["lightning-fastdata"])
    (path,) = cache_help(["fit"])
    assert path.is_relative_to(tmp_path / "xdg")
    monkeypatch.setenv("LIGHTNING_FASTDATA_CACHE", str(tmp_path / "scratch"))
    out, imported = _main_in_a_new_process("fit", "--help")
    assert imported == []
    assert out == path.read_text()


def test_a_user_without_a_home_gets_no_help_cache_and_the_full_parser(monkeypatch, capsys):
    """A container's arbitrary uid has no home (``Path.home()`` raises): nothing is cached, and a command still runs
    to the full parser's answer instead of a traceback."""
    from lightning_fastdata.cli import cache_help, help_cache

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert help_cache.help_dir() is None
    assert cache_help(["fit"]) == []
    assert help_cache.quick_usage_error("fit", ["--trainer.max_epohcs=3"]) is None
    assert main(["fit", "--trainer.max_epohcs=3"]) != 0
    assert "error:" in capsys.readouterr().err


_TYPO = (
    "import sys\n"
    "from lightning_fastdata.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print(code, sorted(m for m in ('torch', 'lightning', 'torchvision') if m in sys.modules), file=sys.stderr)"
)


def test_a_misspelled_trainer_key_is_told_without_importing_lightning(tmp_path, monkeypatch):
    """With ``fit --help`` cached, ``trainer: {max_epoch: 2}`` in a config is the parser's one ``error:`` line, exit 2,
    without importing torch or Lightning (it took 10-14 s)."""
    from lightning_fastdata.cli import cache_help

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "argv", ["lightning-fastdata"])
    cache_help(["fit"])
    config = tmp_path / "trainer.yaml"
    config.write_text("trainer:\n  max_epoch: 2\n")
    proc = subprocess.run(
        [sys.executable, "-c", _TYPO, "fit", "--config", "examples/configs/cpu.yaml", "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")},
        check=True,
    )
    *lines, last = proc.stderr.strip().splitlines()
    assert lines == ["error: unknown key `trainer.max_epoch`; did you mean `trainer.max_epochs`?"]
    assert last == "2 []"


_TYPOS = {
    "trainer.yaml": "trainer:\n  max_epochs: 1\n  acelerator: cpu\n",
    "top.yaml": "trainr:\n  max_epochs: 2\n  accelerator: cpu\n",
    "seed.yaml": "seed_everythin: 1\n",
    "optimizer.yaml": "optimzer:\n  class_path: torch.optim.SGD\n  init_args:\n    lr: 0.1\n",
    "nothing_near.yaml": "zzz: 1\n",
}


@pytest.mark.usefixtures("in_repo")
@pytest.mark.parametrize(
    ("extra", "told"),
    [
        (["--config", "trainer.yaml"], True),
        (["--config=top.yaml"], True),
        (["-c", "seed.yaml"], True),
        (["--config", "optimizer.yaml"], False),  # jsonargparse names a class's argument: `optimzer.init_args.lr`
        (["--config", "nothing_near.yaml"], False),
        (["--trainer.max_epochz", "1"], True),
        (["--trainer.acelerator=cpu"], True),
        (["--trainr.max_epochs", "1"], True),
        (["--ckpt_pth", "x"], True),
        (["--zzz", "1"], False),
        (["--data.init_args.data_dri", "x"], False),
        (["--trainer.logger.init_args.save_dirr", "x"], False),
        (["--trainer.callbacks+=LoaderMonitr"], False),
    ],
)
def test_a_typo_told_from_the_cached_help_is_what_the_parser_says(tmp_path, monkeypatch, capsys, extra, told):
    """Each misspelling the cached ``--help`` text can tell is reported as LightningCLI's parser reports it; the others
    (a class's arguments, no close key) are left to the parser."""
    from lightning_fastdata.cli import cache_help, fit, help_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache_help(["fit"])
    for name, text in _TYPOS.items():
        (tmp_path / name).write_text(text)
    extra = [str(tmp_path / arg) if arg in _TYPOS else arg.replace("=top", f"={tmp_path}/top") for arg in extra]
    argv = ["fit", "--config", "examples/configs/cpu.yaml", *extra]
    quick = help_cache.quick_usage_error("fit", argv[1:])
    assert (quick is not None) is told, quick
    monkeypatch.setattr(fit, "quick_usage_error", lambda command, args: None)
    assert main(argv) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert quick is None or said == [f"error: {quick}"]


@pytest.mark.usefixtures("in_repo")
def test_the_quick_typo_check_passes_every_valid_argument(tmp_path, monkeypatch):
    """The example configs with options of every form (abbreviated, appended to, a class's, nested) are no typo."""
    from lightning_fastdata.cli import cache_help, help_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache_help()
    options = [
        *("--trainer.callbacks+=lightning_fastdata.LoaderMonitor", "--trainer.callbacks+", "LoaderMonitor"),
        *("--trainer.logger", "false", "--trainer.logger.init_args.save_dir", "z", "--trainer.devices+", "1"),
        *("--data.init_args.data_dir", "x", "--data.data_dir", "y", "--model", "tiny.Tested", "--model.lr", "0.1"),
        *("--optimizer", "SGD", "--optimizer.lr", "0.1", "--lr_scheduler", "StepLR", "--seed_everything", "1"),
        *("--trainer.max_epoch", "1", "--trainer.enable_progress_bar=false", "--ckpt_path", "c", "--print_config"),
    ]
    for config in sorted((ROOT / "examples" / "configs").glob("*.yaml")):
        for command in ("fit", "validate", "test", "predict"):
            assert help_cache.quick_usage_error(command, ["--config", str(config), *options]) is None, (config, command)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["convert", "src", "dst", "--short-size", "128"],
            "unrecognized arguments: --short-size 128; did you mean --short-side?",
        ),
        (
            ["convert", "src", "dst", "--short-size=128"],
            "unrecognized arguments: --short-size=128; did you mean --short-side?",
        ),
        (["profile", "data", "--sampels", "4"], "unrecognized arguments: --sampels 4; did you mean --samples?"),
        (["convert", "src", "dst", "--zzz"], "unrecognized arguments: --zzz"),
    ],
)
def test_a_misspelled_option_of_our_commands_names_the_nearest(argv, expected, capsys):
    """``convert --short-size``: exit 2 with the command's usage and "did you mean --short-side?"."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: lightning-fastdata {argv[0]} ")
    assert err.strip().splitlines()[-1] == f"lightning-fastdata {argv[0]}: error: {expected}"


@pytest.fixture
def in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from the repository root, so the example configs' `fastdata_examples.*` class paths import."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setattr(sys, "argv", ["lightning-fastdata"])  # pytest's own arguments are not the CLI's
    # log handlers made during an earlier test (`main`'s logging.basicConfig, Lightning's own on first import) write
    # to that test's captured stderr, closed since: this test's instead
    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    for handler in (h for logger in loggers for h in logger.handlers if isinstance(h, logging.StreamHandler)):
        if getattr(handler.stream, "closed", False):
            monkeypatch.setattr(handler, "stream", sys.stderr)


def _error_line(err: str) -> str:
    """The single ``error:`` line of stderr; no traceback, no usage dump."""
    assert "Traceback" not in err, err
    assert "usage:" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.usefixtures("in_repo")
def test_a_misspelled_callback_class_path_names_the_nearest_class(tmp_path, capsys):
    """``lightning_fastdata.LoaderMonitr`` in ``--trainer.callbacks`` or a config's list, or ``LoaderMonitr`` alone:
    one ``error:`` line with "did you mean `lightning_fastdata.LoaderMonitor`?", exit 2."""
    config = tmp_path / "callbacks.yaml"
    config.write_text("trainer:\n  callbacks:\n    - class_path: lightning_fastdata.LoaderMonitr\n")
    typo = "'lightning_fastdata.LoaderMonitr': module 'lightning_fastdata' has no attribute 'LoaderMonitr'"
    hint = "; did you mean `lightning_fastdata.LoaderMonitor`?"
    cases = [
        (["--trainer.callbacks+=lightning_fastdata.LoaderMonitr"], f"`trainer.callbacks.class_path` {typo}{hint}"),
        (["--config", str(config)], f"`trainer.callbacks.class_path` {typo}{hint}"),
        (
            ["--trainer.callbacks+=LoaderMonitr"],
            f"`trainer.callbacks`: 'LoaderMonitr' is not a class jsonargparse knows{hint}",
        ),
        (
            ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpont"],
            "`trainer.callbacks.class_path` 'lightning.pytorch.callbacks.ModelCheckpont': module"
            " 'lightning.pytorch.callbacks' has no attribute 'ModelCheckpont'; did you mean"
            " `lightning.pytorch.callbacks.ModelCheckpoint`?",
        ),
    ]
    for extra, expected in cases:
        assert main(["fit", "--config", "examples/configs/cpu.yaml", *extra]) == 2
        assert _error_line(capsys.readouterr().err) == f"error: {expected}"


@pytest.mark.usefixtures("in_repo")
def test_the_monitor_is_a_callback_known_by_its_name(monkeypatch):
    """``--trainer.callbacks+=LoaderMonitor`` (no module) parses to ``lightning_fastdata.LoaderMonitor``."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_fastdata.cli import lightning_cli

    monkeypatch.setattr(LightningCLI, "instantiate_classes", lambda self: None)
    config = lightning_cli(["--config", "examples/configs/cpu.yaml", "--trainer.callbacks+=LoaderMonitor"], run=False)
    assert [c.class_path for c in config.config.trainer.callbacks] == ["lightning_fastdata.LoaderMonitor"]


def test_fit_help_says_how_to_see_the_datamodules_arguments(tmp_path, monkeypatch, capsys):
    """``fit --help`` ends saying that ``fit --data.help FastImageDataModule`` lists the DataModule's arguments,
    and that command lists them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # where --help is cached
    monkeypatch.setattr(sys, "argv", ["lightning-fastdata"])
    with pytest.raises(SystemExit) as info:
        main(["fit", "--help"])
    assert info.value.code == 0
    tail = " ".join(capsys.readouterr().out.split()[-80:])  # the epilog, unwrapped
    assert (
        "The DataModule's arguments (data_dir, batch_size, num_workers, cache_dir, ...) are not listed above:" in tail
    )
    assert "`lightning-fastdata fit --data.help FastImageDataModule` lists them" in tail
    with pytest.raises(SystemExit) as info:
        main(["fit", "--data.help", "FastImageDataModule"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--data.data_dir DATA_DIR" in out
    assert "--data.cache_dir CACHE_DIR" in out


def _refuse_mkdir_under(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """``os.mkdir`` of a folder in ``folder`` fails with EACCES, as in a read-only folder (which root could write)."""
    import errno

    mkdir = os.mkdir

    def refuse(path, *args, **kwargs):
        if Path(path).parent == folder:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refuse)


def test_convert_under_a_read_only_parent_names_that_parent(split_folder, tmp_path, monkeypatch, capsys):
    """``dst`` in a folder that does not exist, under a read-only one: the error names the read-only folder."""
    parent = tmp_path / "ro"
    parent.mkdir()
    _refuse_mkdir_under(monkeypatch, parent)
    dst = parent / "new" / "db.lmdb"
    assert main(_convert_args(split_folder, dst)) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: `dst` {str(dst)!r} cannot be written: its folder {str(dst.parent)!r} does not exist and cannot be"
        f" made in {str(parent)!r}, which is read-only (Permission denied). Convert into a writable folder, or"
        " convert there first and make it read-only afterwards."
    ]
    assert sorted(parent.iterdir()) == []


@pytest.mark.usefixtures("in_repo")
def test_fit_with_a_cache_dir_under_a_read_only_parent_names_that_parent(split_folder, tmp_path, monkeypatch, capsys):
    """``--data.cache_dir /ro/parent/cache`` with ``/ro/parent`` read-only: one line naming ``/ro/parent`` as
    read-only and saying how to choose another cache (``--data.cache_dir``, ``LIGHTNING_FASTDATA_CACHE``)."""
    parent = tmp_path / "parent"
    parent.mkdir()
    _refuse_mkdir_under(monkeypatch, parent)
    cache = parent / "cache"
    args = ["--data.data_dir", str(split_folder), "--data.cache_dir", str(cache), "--trainer.logger", "false"]
    args += ["--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", str(tmp_path / "out")]
    assert main(["fit", "--config", "examples/configs/cpu.yaml", *args]) == 2
    assert _error_line(capsys.readouterr().err) == (
        f"error: `cache_dir` {str(cache)!r} does not exist and cannot be made in {str(parent)!r}, which is read-only,"
        f" so `data_dir` {str(split_folder)!r} cannot be converted into it (Permission denied). Pass `cache_dir=` a"
        " writable folder (`--data.cache_dir` on the command line) or set LIGHTNING_FASTDATA_CACHE to one, or convert"
        " once where it is writable (`lightning-fastdata convert`) and pass the database as `data_dir`."
    )


def test_a_cache_dir_under_a_read_only_file_system_names_the_read_only_folder(split_folder, tmp_path, read_only_python):
    """On a really read-only file system (a read-only bind mount): the cache's read-only parent is named."""
    parent = tmp_path / "parent"
    parent.mkdir()
    cache = parent / "cache"
    code = (
        "import sys\nfrom lightning_fastdata import FastImageDataModule, ReadOnlyDestinationError\n"
        "try:\n    FastImageDataModule(sys.argv[1], cache_dir=sys.argv[2]).prepare_data()\n"
        "except ReadOnlyDestinationError as err:\n    print(err.folder)\n    print(err)\n"
    )
    proc = read_only_python([parent], code, str(split_folder), str(cache))
    assert proc.returncode == 0, proc.stderr
    folder, message = proc.stdout.strip().splitlines()
    assert folder == str(parent)
    assert message.startswith(
        f"`cache_dir` {str(cache)!r} does not exist and cannot be made in {str(parent)!r}, which is read-only, so"
        f" `data_dir` {str(split_folder)!r} cannot be converted into it (Read-only file system). Pass `cache_dir=`"
    )
    assert sorted(parent.iterdir()) == []


def _lightning_fastdata(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The real ``lightning-fastdata`` command (its entry point, ``lightning_fastdata.cli:main``) in a new process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "lightning_fastdata.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def _list_images(folder: Path, count: int) -> list[str]:
    """Write ``count`` small generated JPEGs into ``folder``; their names."""
    make_image_folder(folder / "src", num_classes=1, train_per_class=count, val_per_class=0, min_size=20, max_size=30,
                      num_workers=1)  # fmt: skip
    return sorted(p.relative_to(folder).as_posix() for p in (folder / "src").rglob("*.jpg"))


@pytest.mark.parametrize(
    ("labels", "kind"),
    [
        (["0.374", "1.25", "0.5"], "float"),
        (['"[cat, dog]"', "[cat]", "[dog]"], "multilabel"),
        (["a|b", "b", "a"], "multilabel"),
    ],
)
def test_convert_refuses_labels_of_another_kind_in_one_line_naming_targets(tmp_path, labels, kind):
    """Float labels, list labels and separated labels: exit 2, one line naming ``--targets``, nothing written."""
    names = _list_images(tmp_path, 3)
    (tmp_path / "list.csv").write_text(
        "path,label\n" + "".join(f"{n},{v}\n" for n, v in zip(names, labels, strict=True))
    )
    proc = _lightning_fastdata("convert", "list.csv", "db", "--quiet", "--workers", "0", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error: `src` ")
    assert f"`--targets {kind}`" in proc.stderr
    assert not (tmp_path / "db").exists()


def test_convert_targets_multilabel_of_separated_labels(tmp_path):
    """``convert list.csv db --targets multilabel``: ``a|b`` labels are each sample's classes, named in the summary."""
    names = _list_images(tmp_path, 3)
    (tmp_path / "list.csv").write_text(f"path,label\n{names[0]},cat|dog\n{names[1]},dog\n{names[2]},\n")
    proc = _lightning_fastdata("convert", "list.csv", "db", "--quiet", "--workers", "0", "--targets", "multilabel",
                               cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "  targets   multilabel (2 classes)\n  samples naming each class: dog 2, cat 1\n" in proc.stdout
    ds = LmdbImageDataset(tmp_path / "db")
    assert (ds.classes, ds.targets) == (["cat", "dog"], [[0, 1], [1], []])
    proc = _lightning_fastdata("convert", "list.csv", "db", "--quiet", "--workers", "0", "--targets", "multilabel",
                               "--label-sep", ";", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "up to date" not in proc.stdout  # another separator reads other classes: converted again
    assert LmdbImageDataset(tmp_path / "db").classes == ["cat|dog", "dog"]


def test_convert_targets_float_of_value_columns(tmp_path):
    """``convert list.tsv db --targets float`` with ``path x y`` columns: values named x and y, their min/mean/max in
    the summary; a row whose value is not a number is skipped and listed."""
    names = _list_images(tmp_path, 3)
    (tmp_path / "list.tsv").write_text(f"path\tx\ty\n{names[0]}\t1\t-2\n{names[1]}\t3\t4.5\n{names[2]}\t?\t0\n")
    args = ("convert", "list.tsv", "db", "--quiet", "--workers", "0")
    refused = _lightning_fastdata(*args, cwd=tmp_path)
    assert refused.returncode == 2
    assert "`--targets float`" in refused.stderr
    proc = _lightning_fastdata(*args, "--targets", "float", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (
        "  targets   float (2 values: x, y)\n  x: min 1  mean 2  max 3\n  y: min -2  mean 1.25  max 4.5\n"
        in proc.stdout
    )
    assert "row 3: float target: '?' is not a number" in proc.stdout
    report = json.loads((tmp_path / "db" / "convert_report.json").read_text())
    assert report["targets"]["kind"] == "float"
    assert report["target_stats"]["y"] == {"min": -2.0, "mean": 1.25, "max": 4.5}
    assert LmdbImageDataset(tmp_path / "db").targets == [[1.0, -2.0], [3.0, 4.5]]
    again = _lightning_fastdata(*args, "--targets", "float", cwd=tmp_path)
    assert "is up to date (2 images)" in again.stdout
