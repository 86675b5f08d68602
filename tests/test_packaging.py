"""What a user of a plain install meets: extras named where something is missing, the license."""
import os
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_interop_without_torch_names_the_extra():
    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n    import interop\nexcept ModuleNotFoundError as e:\n    print(e.name, '|', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "torch | interop needs torch: pip install 'ckv-jax[torch]'"


def test_env_report_names_the_extra_of_a_missing_module():
    from ckv_jax import env_report
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for module, extra in env_report.EXTRAS.items():
        assert extra in extras, f"{module}: extra {extra!r} is not declared"
        assert any(dep.replace("-", "_").lower().startswith(module.replace("-", "_"))
                   or dep.lower().startswith(module + "-") for dep in extras[extra]), (module, extras[extra])
        why = f"ModuleNotFoundError: No module named '{module}'"
        assert env_report._extra_for(why) == f"; pip install 'ckv-jax[{extra}]' provides {module}"
    assert env_report._extra_for("needs a GPU") == ""


def test_license_is_an_spdx_string():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert project["project"]["license"] == "Apache-2.0"
    assert any(req.startswith("setuptools>=77") for req in project["build-system"]["requires"])
