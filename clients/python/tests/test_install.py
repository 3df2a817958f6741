"""pyproject.toml installs with pip, offline: nothing to download beyond msgpack (present)."""

import os
import shutil
import subprocess
import sys
import tempfile

from conftest import ROOT


def test_pip_install_offline():
    tmp = tempfile.mkdtemp(prefix="rls-pip")
    try:
        src = os.path.join(tmp, "src")
        shutil.copytree(os.path.join(ROOT, "clients", "python"), src,
                        ignore=shutil.ignore_patterns("tests", "__pycache__", "build", "*.egg-info"))
        venv = os.path.join(tmp, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
        py = os.path.join(venv, "bin", "python")
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation", src], check=True)
        out = subprocess.run([py, "-c", "import rlsidecar; print(rlsidecar.__file__)"], cwd=tmp, check=True,
                             capture_output=True, text=True).stdout
        assert out.startswith(venv)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
