"""`policies/` ships as `tiercache.policies` (and `bench/` as `tiercache.bench`), both from an
editable install and from a built wheel; `import tiercache` has no side effects."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ("import sys, tiercache.policies, tiercache.bench, tiercache.config as c; "
         "print(tiercache.policies.__file__); print(sorted(tiercache.policies.EVICTION_POLICIES)); "
         "print('torch' in sys.modules)")


def _probe(cwd, env=None):
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_editable_install_maps_policies_into_the_package(tmp_path):
    path, names, torch_loaded = _probe(tmp_path)
    assert Path(path).resolve() == ROOT / "policies" / "__init__.py"
    assert "lru" in names
    assert torch_loaded == "False"  # importing the config and policies does not load torch


def test_built_wheel_contains_and_imports_the_subpackages(tmp_path):
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(dist), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    (wheel,) = dist.glob("tiercache-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "tiercache/policies/__init__.py" in names and "tiercache/bench/decode.py" in names
    assert not any(n.startswith("policies/") for n in names)
    target = tmp_path / "site"
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert inst.returncode == 0, inst.stderr
    env = dict(os.environ, PYTHONPATH=str(target))
    path, names, _ = _probe(tmp_path, env)
    assert Path(path).resolve() == (target / "tiercache" / "policies" / "__init__.py").resolve()
    assert "fifo" in names
    console = subprocess.run([sys.executable, "-c", "import tiercache.cli as c; raise SystemExit(c.main(['--help']))"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert console.returncode == 0 and "generate" in console.stdout


def test_sdist_carries_what_the_tests_read_and_the_license(tmp_path):
    """The sdist lacked examples/, docs/, Makefile and bench/gpu_check.sh (its own tests open
    the first two) and a LICENSE for the Apache-2.0 that pyproject declares."""
    import tarfile

    import pytest

    pytest.importorskip("build")
    build = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--skip-dependency-check",
                            "-o", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    (sdist,) = tmp_path.glob("tiercache-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        pkg_info = tar.extractfile(next(n for n in tar.getnames() if n.endswith("/PKG-INFO")
                                        and n.count("/") == 1)).read().decode()
        license_text = tar.extractfile(next(n for n in tar.getnames() if n.endswith("/LICENSE"))).read().decode()
    for path in ("LICENSE", "README.md", "Makefile", "bench/gpu_check.sh", "examples/long_context.py",
                 "examples/wrap_model.py", "examples/grafana-dashboard.json", "docs/bench-policies.json",
                 "docs/metrics.md", "tests/conftest.py", "tests/test_packaging.py", "policies/__init__.py"):
        assert path in names, path
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    assert "License-Expression: Apache-2.0" in pkg_info and "License-File: LICENSE" in pkg_info
    assert "Apache License\n                           Version 2.0, January 2004" in license_text
