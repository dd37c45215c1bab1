"""A plain (non-editable) wheel install into a fresh virtual environment imports and works."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_installs_namespaced_and_runs(tmp_path: Path) -> None:
    wheel_dir = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(wheel_dir), str(REPO)], check=True
    )
    wheel = next(wheel_dir.glob("gradq-*.whl"))
    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--quiet", str(wheel)], check=True)
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    top_level = {path.name for path in site.iterdir()}
    assert "gradq" in top_level
    assert not top_level & {"qcore", "server", "client", "proto", "cli"}
    # Dependencies come from this test environment: a .pth puts its site-packages
    # behind the fresh one (.pth files there are not processed, so the editable
    # gradq stays invisible).
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = (
        "import numpy as np, gradq.qcore as q, gradq.server.app, gradq.client, gradq.proto.v1.aggregator_pb2;"
        "x = np.linspace(-1, 1, 1000, dtype=np.float32);"
        "assert abs(q.fake_quantize(x, q.QuantConfig()) - x).max() < 0.01;"
        "print(q.__file__)"
    )
    location = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True).stdout
    assert str(site) in location
    help_text = subprocess.run(
        [str(env_dir / "bin" / "gradq"), "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--round-timeout" in help_text
    assert (site / "gradq" / "proto" / "v1" / "aggregator.proto").exists()
