"""autopar.outputs and autopar.yamlload in-process (fast): the write contract's corner cases that the
CLI table (test_failure_contract.py) does not spend a subprocess on."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from autopar.errors import AutoparError
from autopar.outputs import OutputError, check_output_dir, check_output_file, write_text_atomic
from autopar.plan import parse_plan


def test_symlink_target_replaced_link_kept(tmp_path: Path) -> None:
    real = tmp_path / "real.txt"
    real.write_text("old")
    os.chmod(real, 0o640)
    link = tmp_path / "link.txt"
    link.symlink_to(real)
    write_text_atomic(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
    assert stat.S_IMODE(real.stat().st_mode) == 0o640  # an existing file keeps its mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.txt", "real.txt"]  # no temp file left


def test_symlink_to_fifo_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "fifo")
    with pytest.raises(OutputError, match="is a FIFO"):
        write_text_atomic(tmp_path / "link", "x")
    assert stat.S_ISFIFO(os.stat(tmp_path / "fifo").st_mode)


def test_character_device_is_refused_before_any_write() -> None:
    # check only (never write): os.devnull is a character device on every POSIX system
    with pytest.raises(OutputError, match="character device"):
        check_output_file(os.devnull, "-o")


def test_directory_checks(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="not a directory"):
        check_output_dir(tmp_path / "f", "--checkpoint-dir")
    with pytest.raises(OutputError, match="not a directory"):
        check_output_dir(tmp_path / "f" / "sub", "--checkpoint-dir")
    assert check_output_dir(tmp_path / "new" / "deeper", "--checkpoint-dir") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()  # a check creates nothing


def test_duplicate_keys_name_both_lines() -> None:
    with pytest.raises(AutoparError, match=r"line 3: duplicate key 'dp' \(first at line 2\)"):
        parse_plan("parallel:\n  dp: 1\n  dp: 2\n", "p.yaml")
