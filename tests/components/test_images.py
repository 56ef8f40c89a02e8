"""``components.images``: image references come from components/images.env and nowhere else."""

from __future__ import annotations

from pathlib import Path

import pytest

from components import images as settings


def test_reads_the_images_file() -> None:
    images = settings.read_images()
    assert set(images) >= {"TRACE_IMAGE", "TRACE_GPU_IMAGE"}
    assert settings.image("TRACE_IMAGE") == images["TRACE_IMAGE"]


def test_errors_name_the_file_and_the_line(tmp_path: Path) -> None:
    path = tmp_path / "images.env"
    path.write_text("# comment\nTRACE_IMAGE=ghcr.io/x/trace:1\nnot a line\n")
    with pytest.raises(ValueError, match=r"images\.env, line 3"):
        settings.read_images(path)
    with pytest.raises(FileNotFoundError, match=r"missing\.env"):
        settings.read_images(tmp_path / "missing.env")
    with pytest.raises(KeyError, match="no NOPE="):
        settings.image("NOPE")
