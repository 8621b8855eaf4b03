"""What the wheel installs: every package under the project's name (the dashboard and the
migrations included, never as top-level ``admin`` / ``migrations``), and a serving import path
that pulls neither the tools nor the training code."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _declared() -> tuple[list[str], dict[str, str]]:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return setuptools["packages"], setuptools["package-dir"]


def test_every_package_in_the_tree_is_declared():
    packages, package_dir = _declared()
    roots = {"sglang_adatree": REPO / "sglang_adatree"}
    roots.update({name: REPO / folder for name, folder in package_dir.items()})
    found = set()
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            relative = init.parent.relative_to(root).parts
            found.add(".".join((name, *relative)))
    # Alembic's versions folder is data read by path, a package without __init__.py.
    found.add("sglang_adatree.migrations.versions")
    assert set(packages) == found
    assert not any(p.split(".")[0] in ("admin", "migrations") for p in packages)


def test_serving_imports_neither_tools_nor_training():
    code = (
        "import sys\n"
        "from sglang_adatree.sglang import plugin\n"
        "plugin.register()\n"
        "import sglang_adatree.sglang.worker, sglang_adatree.sglang.serving\n"
        "print(sorted(m for m in sys.modules if m.startswith('sglang_adatree')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert done.returncode == 0, done.stderr
    loaded = eval(done.stdout.strip().splitlines()[-1])  # a printed list of module names
    assert "sglang_adatree.core.controller" in loaded
    off_path = ("sglang_adatree.models", "sglang_adatree.tools", "sglang_adatree.admin")
    assert [m for m in loaded if m.startswith(off_path)] == []


@pytest.mark.slow
def test_the_wheel_serves_the_dashboard_and_migrates_without_top_level_packages(tmp_path):
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dist), str(REPO)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    [wheel] = dist.glob("sglang_adatree-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert {n.split("/")[0] for n in names} <= {
        "sglang_adatree",
        wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info",
    }
    assert "sglang_adatree/admin/templates/base.html" in names
    assert "sglang_adatree/migrations/script.py.mako" in names
    # A fresh environment with the wheel; its dependencies are this environment's packages,
    # put on the path without their .pth files (so the editable install stays out).
    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    fresh_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(fresh_site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp_path / "elsewhere"
    work.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(python), *args], capture_output=True, text=True, timeout=300, cwd=work
        )

    for name in ("admin", "migrations"):
        assert run("-c", f"import {name}").returncode != 0
    where = run("-c", "import sglang_adatree; print(sglang_adatree.__file__)")
    assert where.stdout.startswith(fresh_site), where.stdout
    url = f"sqlite:///{tmp_path / 'fresh.sqlite'}"
    upgraded = subprocess.run(
        [str(env_dir / "bin" / "adatree"), "db", "upgrade", "--db", url],
        capture_output=True, text=True, timeout=300, cwd=work,
    )  # fmt: skip
    assert upgraded.returncode == 0 and "(head)" in upgraded.stdout, upgraded.stderr
    dashboard = run(
        "-c",
        "import json\n"
        "from sglang_adatree.admin import create_app\n"
        f"settings = {{'ADATREE_DB_URL': {url!r}, 'ADATREE_ADMIN_TOKEN': 'operator-token'}}\n"
        "app = create_app(settings)\n"
        "client = app.test_client()\n"
        "pages = [client.get(p) for p in ('/login', '/static/app.js', '/static/style.css')]\n"
        "print(json.dumps([p.status_code for p in pages]))\n",
    )
    assert dashboard.returncode == 0, dashboard.stderr
    assert json.loads(dashboard.stdout.strip().splitlines()[-1]) == [200, 200, 200]
