"""The notebooks in notebooks/ run top to bottom in a real Jupyter kernel.

Each notebook is stored without outputs and executed with nbclient in a fresh kernel
started from this interpreter (``sys.executable -m ipykernel_launcher``, a kernel spec
written to a temp dir, so no installed "python3" kernel is needed and a system Python is
never picked up by mistake). The working directory is a temp dir, so the files a notebook
writes (plans, pictures, traces) never land in the repository. Matplotlib draws with Agg.

Timings are printed per notebook (``pytest -s``), and each one must finish well inside the
kernel timeout; the notebooks are sized to take under a minute on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "piper-sim-tests"
CELL_TIMEOUT_S = 300


def test_notebooks_exist():
    names = [p.stem for p in NOTEBOOKS]
    assert names[:5] == ["01_quickstart", "02_schedule_gallery", "03_composing_strategies",
                         "04_simulated_vs_measured", "05_explore_large_model"], names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, \
                f"{path.name} cell {i} has stored outputs; clear them before committing"
    assert nb.cells[0].cell_type == "markdown", f"{path.name} should open with a markdown cell saying what it teaches"


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory) -> Path:
    """A kernel spec that starts ipykernel with this very interpreter."""
    root = tmp_path_factory.mktemp("kernels")
    spec_dir = root / KERNEL
    spec_dir.mkdir()
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "piper-sim tests", "language": "python",
            "env": {"MPLBACKEND": "Agg", "PYTHONPATH": pythonpath, "PYTHONHASHSEED": "0"}}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return root


def execute(path: Path, workdir: Path, kernel_dir: Path) -> float:
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))
    client = nbclient.NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, allow_errors=False,
                                     resources={"metadata": {"path": str(workdir)}})
    t0 = time.perf_counter()
    client.execute()
    return time.perf_counter() - t0


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p.stem == "published" else p
                                  for p in NOTEBOOKS], ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, kernel_dir, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    before = set(ROOT.joinpath("notebooks").iterdir())
    try:
        elapsed = execute(path, tmp_path, kernel_dir)
    except nbclient.exceptions.CellExecutionError as e:  # the failing cell and its traceback
        pytest.fail(f"{path.name} failed:\n{e}", pytrace=False)
    print(f"\n{path.name}: {elapsed:.1f} s")
    written = set(ROOT.joinpath("notebooks").iterdir()) - before
    assert not written, f"{path.name} wrote into the repository: {sorted(map(str, written))}"
