"""``studio --version``."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest

from studio import __version__
from studio.cli import main, studio_version


def test_version_prints_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"studio {studio_version()}"
    try:
        installed = version("studio")
    except PackageNotFoundError:
        installed = None  # a checkout on PYTHONPATH: the package's own version
    assert studio_version() == (installed or __version__)
