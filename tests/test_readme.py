"""Every ```python block of the README, in order, in one fresh process on the CPU: the README
cannot drift from what the library does."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_python_blocks_run_as_written(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    assert len(blocks) >= 4, "the README's examples were not found"
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks))
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(300, 8, 512) (300, 8)" in proc.stdout
