"""The package, its constants and the CLI."""
import subprocess
import sys

from click.testing import CliRunner

import mlx_open1b
from mlx_open1b import contract
from mlx_open1b.cli.main import cli
from mlx_open1b.cpu_ref import _lib


def test_python_constants_equal_the_c_reference():
    # the same constant written twice (Python and C) must agree, or a backend would diverge
    assert _lib.contract_version_c() == contract.CONTRACT_VERSION
    assert _lib.declare("o1b_attn_block", restype=_lib.c_int)() == contract.ATTN_BLOCK
    assert _lib.declare("o1b_xent_chunk", restype=_lib.c_int)() == contract.XENT_CHUNK
    assert _lib.declare("o1b_norm_block", restype=_lib.c_i64)() == contract.NORM_BLOCK


def test_cli_version_and_info():
    r = CliRunner().invoke(cli, ["--version"])
    assert r.exit_code == 0 and mlx_open1b.__version__ in r.output
    r = CliRunner().invoke(cli, ["info"])
    assert r.exit_code == 0, r.output
    assert f"contract v{contract.CONTRACT_VERSION}" in r.output
    assert "cpu_ref  available" in r.output
    for name in ("metal", "cuda", "numpy", "cpu features"):
        assert name in r.output
    assert "default (--backend auto): " in r.output


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "mlx_open1b.cli.main", "info"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "backends:" in r.stdout


def test_unknown_command_fails():
    r = CliRunner().invoke(cli, ["nope"])
    assert r.exit_code == 2
