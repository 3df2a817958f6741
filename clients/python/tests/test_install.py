"""pyproject.toml installs with pip, offline: nothing to download beyond msgpack (present)."""

import os
import re
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


def test_readme_install_command():
    """The README's install command, run as written from a checkout, installs the client into
    a virtualenv that imports it (Debian's pip refuses a system-wide install)."""
    with open(os.path.join(ROOT, "clients", "python", "README.md")) as f:
        blocks = re.findall(r"```sh\n(.*?)```", f.read(), re.S)
    command = next(b for b in blocks if "pip install" in b).strip()
    tmp = tempfile.mkdtemp(prefix="rls-readme-pip")
    try:
        shutil.copytree(os.path.join(ROOT, "clients", "python"), os.path.join(tmp, "clients", "python"),
                        ignore=shutil.ignore_patterns("tests", "__pycache__", "build", "*.egg-info"))
        # Offline: msgpack and setuptools come from the system's site-packages.
        env = dict(os.environ, PIP_NO_INDEX="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        subprocess.run(["bash", "-ec", command], cwd=tmp, env=env, check=True)
        py = os.path.join(tmp, "venv", "bin", "python")
        assert os.path.exists(py), "the README's command made no ./venv: %s" % command
        out = subprocess.run([py, "-c", "import rlsidecar; print(rlsidecar.__file__)"], cwd=tmp, check=True,
                             capture_output=True, text=True).stdout
        assert out.startswith(os.path.join(tmp, "venv"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
