"""``rlmath --version`` and the version the package reports."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import _rlmath_cli
import rlmath
from rlmath import _version, cli


def test_version_flag_prints_the_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out == f"rlmath {rlmath.__version__}\n"
    assert re.fullmatch(r"rlmath \d+\.\d+\.\d+\S*\n", out)


def test_the_package_version_is_the_version_file():
    assert rlmath.__version__ == _version.__version__ == cli.version()
    assert _rlmath_cli.version() == rlmath.__version__


@pytest.mark.integration
def test_console_script_version_does_not_import_torch():
    """The console script's entry point answers --version without importing rlmath or torch."""
    code = (
        "import sys\n"
        "from _rlmath_cli import main\n"
        "status = main(['--version'])\n"
        "heavy = sorted(m for m in ('torch', 'rlmath', 'numpy') if m in sys.modules)\n"
        "print('imported:', heavy)\n"
        "sys.exit(status)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"rlmath {rlmath.__version__}\nimported: []\n"


def test_console_script_hands_other_commands_to_the_cli(monkeypatch):
    seen = {}

    def fake(argv, *, started):
        seen.update(argv=argv, started=started)
        return 7

    monkeypatch.setattr(cli, "main", fake)
    assert _rlmath_cli.main(["bench", "--quick"]) == 7
    assert seen["argv"] == ["bench", "--quick"]
    assert seen["started"] <= __import__("time").time()


def test_process_start_is_in_the_past():
    import time

    assert 0.0 <= time.time() - cli._process_start() < 24 * 3600


@pytest.mark.integration
def test_console_script_without_numpy_prints_no_numpy_warning():
    """A plain `pip install rlmath` has no numpy: torch's warning about it is not shown."""
    code = (
        "import sys\n"
        "sys.modules['numpy'] = None  # as if numpy were not installed\n"
        "from _rlmath_cli import main\n"
        "sys.exit(main(['demo', '--help']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage: rlmath demo" in proc.stdout
    assert "NumPy" not in proc.stderr, proc.stderr
