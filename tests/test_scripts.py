"""The set-up scripts: ``setup.sh`` installs into ``.venv`` only; the browser is opt-in.

``scripts/setup.sh`` (run by the demo and the test commands) must change nothing outside the
project's virtual environment. ``scripts/install_browser.sh`` installs a system-wide browser for
the schedule page's browser test, and only when asked (``--yes`` or
``CAPTUREPASS_INSTALL_BROWSER=1``); otherwise it says what it would install. It runs here with a
``PATH`` of stand-ins (a recording ``apt-get``, an ``id`` that answers root), so the test
installs nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "install_browser.sh")


def _commands(path: str) -> str:
    """The script's text without its comments."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return "\n".join(line.split("#", 1)[0] for line in f)


@pytest.mark.parametrize("path", ["scripts/setup.sh", "scripts/demo.sh", "scripts/test.sh"])
def test_setup_demo_and_test_install_nothing_outside_the_venv(path):
    text = _commands(path)
    for word in ("apt-get", "apt ", "sudo", "chromium", "install_browser", "--user", "/usr/", "dpkg"):
        assert word not in text, f"{path} runs {word!r}"
    for line in text.splitlines():
        if "pip install" in line:  # only into the project's venv
            assert ".venv/bin/python -m pip install" in line, line


def _fake_path(tmp_path, *, browser: bool) -> tuple[dict, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "apt.log"
    for tool in ("mktemp", "tail", "sed", "cat"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    (bin_dir / "id").write_text("#!/bin/sh\necho 0\n")
    (bin_dir / "apt-get").write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    if browser:
        (bin_dir / "chromium").write_text("#!/bin/sh\nexit 0\n")
    for f in bin_dir.iterdir():
        if not f.is_symlink():
            f.chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    return env, str(log)


def _run(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("bash"), SCRIPT, *args], capture_output=True, text=True, env=env, timeout=60)


def test_install_browser_without_consent_says_what_and_installs_nothing(tmp_path):
    env, log = _fake_path(tmp_path, browser=False)
    proc = _run(env)
    assert proc.returncode == 0, proc.stderr
    assert "Debian's 'chromium' package" in proc.stdout and "system-wide" in proc.stdout
    assert "nothing installed" in proc.stdout and "--yes" in proc.stdout
    assert not os.path.exists(log)


@pytest.mark.parametrize("consent", [["--yes"], ["CAPTUREPASS_INSTALL_BROWSER=1"]])
def test_install_browser_with_consent_runs_apt_get(tmp_path, consent):
    env, log = _fake_path(tmp_path, browser=False)
    args = []
    for c in consent:
        if "=" in c:
            key, value = c.split("=")
            env[key] = value
        else:
            args.append(c)
    proc = _run(env, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(log) as f:
        assert f.read().splitlines() == ["update -qq", "install -y -qq chromium"]


def test_install_browser_does_nothing_when_one_is_there(tmp_path):
    env, log = _fake_path(tmp_path, browser=True)
    proc = _run(env, "--yes")
    assert proc.returncode == 0 and "already installed; nothing to do" in proc.stdout
    assert not os.path.exists(log)


def test_install_browser_refuses_an_unknown_argument(tmp_path):
    env, _ = _fake_path(tmp_path, browser=False)
    proc = _run(env, "--force")
    assert proc.returncode == 2 and "unknown argument --force" in proc.stderr
