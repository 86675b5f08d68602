"""The `ckv-jax` command in a subprocess, as a user runs it."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _run(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    return subprocess.run([sys.executable, "-m", "ckv_jax.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("fmt, attention, runs", [("fp8_ds_mla", "auto", "xla"), ("nvfp4_ds_mla", "xla", "xla"),
                                                   ("fp8_ds_mla", "pallas_triton", "pallas_triton (interpret mode)")])
def test_demo_runs_a_dcp_prefill_and_checks_it(fmt, attention, runs):
    proc = _run("demo", "--format", fmt, "--dcp", "2", "--depth", "1", "--layers", "2", "--context", "96",
                "--chunk", "32", "--requests", "1", "--heads", "2", "--topk", "16", "--block-size", "16",
                "--attention", attention)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"DCP 2 on cpu, depth 1, attention {runs}" in proc.stdout
    assert "2 layers x 3 steps: all steps match" in proc.stdout
    assert proc.stdout.count("depth 1 == depth 0: True") == 3


def test_env_reports_versions_and_lowering():
    proc = _run("env")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import jax
    jax_line = next(line for line in proc.stdout.splitlines() if line.startswith("jax "))
    assert jax_line.split()[-1] == jax.__version__
    assert "pallas triton lowering" in proc.stdout and "dlpack self-check" in proc.stdout


def test_cli_rejects_unknown_command_and_bad_flags():
    assert _run("bogus").returncode == 2
    proc = _run("demo", "--chunk", "0")
    assert proc.returncode == 2 and "--chunk must be positive" in proc.stderr
    proc = _run("demo", "--dcp", "3", "--heads", "8")
    assert proc.returncode == 2 and "--heads 8 must be divisible by --dcp 3" in proc.stderr


def test_bench_writes_json_and_plot_writes_pngs(tmp_path):
    out = tmp_path / "results.json"
    proc = _run("bench", "--ops", "writer,gather,patch,prefill,attention", "--tokens", "128", "--formats", "nvfp4_ds_mla",
                "--patterns", "random", "--chunk", "32", "--prefill-chunk", "32", "--depths", "0,1", "--layers", "1", "--context", "128",
                "--heads", "16,32", "--attention-tokens", "4", "--attention-rows", "256", "--top-k", "32",
                "--keys", "bf16,exact", "--repeats", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json
    data = json.loads(out.read_text())
    assert data["backend"] == "cpu" and data["command"].startswith("ckv-jax bench")
    ops = {r["op"] for r in data["results"]}
    assert ops == {"write_records", "gather_raw", "gather_dequant", "patch", "prefill_step", "attention"}
    assert [(r["heads"], r["implementation"], r["keys"]) for r in data["results"] if r["op"] == "attention"] == [
        (16, "xla", "bf16"), (16, "xla", "exact"), (32, "xla", "bf16"), (32, "xla", "exact")]
    assert all(r["exact"] for r in data["results"])
    steps = [r for r in data["results"] if r["op"] == "prefill_step"]
    assert [r["depth"] for r in steps] == [0, 1]
    for r in steps:                  # the step's shape as asked, its attention as selected, both timings
        assert (r["heads"], r["top_k"], r["attention"], r["chunk"], r["keys"]) == (8, 32, "xla", 32, "bf16"), r
        assert r["us"] > 0 and 0 < r["gather_us"] and r["gather_share_pct"] is not None
    assert steps[0]["gather_share_pct"] == pytest.approx(100 * steps[0]["gather_us"] / steps[0]["us"])
    assert steps[1]["gather_share_pct"] == pytest.approx(
        100 * (steps[1]["us"] - steps[0]["us"] + steps[1]["gather_us"]) / steps[1]["us"])
    proc = _run("plot", str(out), "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("bandwidth.png", "prefill_depth.png", "attention.png"):
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_version_and_helps_document_every_option():
    from ckv_jax import __version__
    proc = _run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"ckv-jax {__version__}"
    for command, options in [("demo", ["--format", "--dcp", "--interleave", "--depth", "--layers", "--context",
                                       "--chunk", "--requests", "--heads", "--d-model", "--topk", "--block-size",
                                       "--attention", "--seed"]),
                             ("bench", ["--ops", "--tokens", "--formats", "--patterns", "--chunk", "--prefill-chunk",
                                        "--prefill-heads", "--prefill-attention", "--keys", "--depths", "--layers",
                                        "--context", "--heads", "--attention-tokens",
                                        "--attention-rows", "--top-k", "--repeats", "--interpret", "--out"]),
                             ("plot", ["--out-dir"])]:
        proc = _run(command, "--help")
        assert proc.returncode == 0, proc.stderr
        entries, current = {}, None
        for line in proc.stdout.splitlines():             # an option's entry runs to the next option
            m = re.match(r"\s{2}(--[\w-]+)", line)
            if m:
                current = m.group(1)
            if current:
                entries[current] = entries.get(current, "") + " " + line.strip()
        for option in options:
            assert option in entries, f"{command} --help lacks {option}"
            if option not in ("--interpret", "--dcp"):
                assert "(default:" in " ".join(entries[option].split()), f"{command} --help: {option} has no default"
    bench_help = " ".join(_run("bench", "--help").stdout.split())
    for op_tag in ("[writer]", "[prefill]", "[attention]", "[writer, gather, patch]"):
        assert op_tag in bench_help


@pytest.mark.parametrize("args, message", [
    (["bench", "--formats", "foo"], "argument --formats: format: unknown record format 'foo'"),
    (["bench", "--tokens", "-5"], "argument --tokens: expected positive integers, got '-5'"),
    (["bench", "--tokens", "0"], "argument --tokens: expected positive integers, got '0'"),
    (["bench", "--ops", "gather", "--tokens", "32"], "--tokens: the gathers move whole 64-record pages"),
    (["bench", "--ops", "prefill", "--prefill-attention", "cuda"], "argument --prefill-attention: invalid choice"),
    (["bench", "--keys", "fp16"], "argument --keys: expected distinct keys among exact, bf16, got 'fp16'"),
    (["demo", "--depth", "10"], "--depth 10: at most --layers - 1 = 3"),
    (["demo", "--context", "100000000"], "needs about"),
    (["demo", "--format", "fp9"], "argument --format: format: unknown record format 'fp9'"),
    (["plot", "/nonexistent/results.json"], "/nonexistent/results.json: No such file or directory"),
])
def test_mistakes_get_one_line_and_exit_code_2(args, message):
    proc = _run(*args, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_plot_of_a_malformed_file_is_a_usage_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = _run("plot", str(bad))
    assert proc.returncode == 2 and "not JSON" in proc.stderr and "Traceback" not in proc.stderr
    bad.write_text('{"rows": []}')
    proc = _run("plot", str(bad))
    assert proc.returncode == 2 and "expected the JSON of `ckv-jax bench`" in proc.stderr


def test_demo_takes_format_aliases_and_interleave_and_counts_steps():
    proc = _run("demo", "--format", "fp8", "--interleave", "2", "--dcp", "2", "--depth", "1", "--layers", "2",
                "--context", "96", "--chunk", "32", "--requests", "1", "--heads", "2", "--topk", "16",
                "--block-size", "16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fp8_ds_mla, DCP 2 on cpu" in proc.stdout and "step 3/3 at" in proc.stdout


def test_cpu_bench_labels_interpret_rows_and_reports_progress(tmp_path):
    out = tmp_path / "r.json"
    proc = _run("bench", "--ops", "writer,gather", "--tokens", "64", "--formats", "fp8", "--patterns", "random",
                "--repeats", "2", "--interpret", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json
    rows = json.loads(out.read_text())["results"]
    interp = [r for r in rows if r.get("mode") == "interpret"]
    assert {r["implementation"] for r in interp} == {"pallas_triton"}
    assert all("pct_of_copy" not in r for r in interp) and all("pct_of_copy" in r for r in rows if r not in interp)
    assert "[2/2] gather fp8_ds_mla 64 tokens" in proc.stderr and "s left" in proc.stderr
    assert " 0 GB/s" not in proc.stdout and "(interpret mode)" in proc.stdout
    # the standalone sweeps take the same output option
    for module in ("writer", "gather"):
        path = tmp_path / f"{module}.json"
        env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
        p = subprocess.run([sys.executable, "-m", f"ckv_jax.benchmarks.{module}", "--tokens", "64", "--formats", "fp8",
                            "--repeats", "2", "--out", str(path)], capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0 and json.loads(path.read_text())["results"], p.stdout + p.stderr


def test_plot_styles_tell_every_series_apart():
    from ckv_jax.benchmarks.plot import line_styles
    keys = [(op, pattern, fmt, impl) for op, pattern in [("write_records", "random"), ("write_records", "sequential"),
                                                         ("gather_raw", ""), ("gather_dequant", ""), ("patch", "")]
            for fmt in ("fp8_ds_mla", "nvfp4_ds_mla", "bf16") for impl in ("pallas_triton", "xla", "torch_index_select")]
    styles = line_styles(keys)
    assert len(set(styles.values())) == len(keys)


def test_cpu_bench_defaults_are_cpu_sized_and_plot_axes_hug_the_data():
    help_text = " ".join(_run("bench", "--help").stdout.split())
    assert "CPU-sized" in help_text and "(default: 4096)" in help_text and "(default: 2048)" in help_text
    from ckv_jax.benchmarks.plot import _limits
    lo, hi = _limits([40.0, 95.0])
    assert 30 < lo < 40 and 95 < hi < 102
    lo, hi = _limits([1.0, 100.0], log=True)
    assert 0.5 < lo < 1.0 and 100 < hi < 200
