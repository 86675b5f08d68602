"""`python -m interop.bench`'s host-side pieces that run without a GPU: the printed row and the
compute's marks option (the matrix itself runs on a GPU)."""
import pytest

from interop import bench


def _row(depth, step_ms, hidden_pct, **extra):
    row = dict(compute_kind="sleep", torch_stream="side", cache_write="adapter", history=262144,
               compute_ms_per_layer=1.0, gather_ms_per_layer=0.132, compute_only_ms=8.0,
               compute_only_spread_pct=0.3, depth=depth, step_ms=step_ms, hidden_pct=hidden_pct,
               exposed_us_per_layer=1e3 * (step_ms - 8.0) / 8,
               host_us_per_layer=190.0, spread_pct=0.1, host_probe_jax_us=35.0, host_probe_torch_us=9.0,
               replayed_steps=None)
    return {**row, **extra}


def test_line_shows_the_exposed_time_marks_hidden_shares_above_100_and_shows_the_baselines_spread():
    line = bench._line([_row(0, 9.1, 0.0), _row(1, 8.06, 94.5), _row(2, 7.99, 100.9)])
    cells = line.split("  d")
    assert cells[0].endswith("8.00 ( 0.3) d0    9.10 (  0.0%, 137.5,  190, 0.1)")   # the compute alone, its spread
    assert cells[1] == "1    8.06 ( 94.5%,   7.5,  190, 0.1)"                        # at or under 100: no mark
    assert cells[2].startswith("2    7.99 (100.9%*,  -1.2,  190, 0.1)")              # the baseline moved more
    assert line.endswith("probe 35/9 us")


def test_line_shows_a_step_programs_replays():
    line = bench._line([_row(0, 9.1, 0.0, replayed_steps="5/7"), _row(1, 8.06, 94.5, replayed_steps="0/7")])
    assert "d0    9.10 (  0.0%, 137.5,  190, 0.1, replayed 5/7)" in line
    assert "( 94.5%,   7.5,  190, 0.1, replayed 0/7)" in line


def test_marks_leave_the_kernels_as_they_are_when_none_and_name_the_choices_otherwise():
    kernels = {"sleep": lambda: None}
    assert bench._with_marks(kernels, "none") is kernels
    with pytest.raises(ValueError, match=r"marks: expected one of \('none', 'before', 'after'\), got 'around'"):
        bench._with_marks(kernels, "around")


def test_a_step_program_run_takes_one_cache_writer_and_says_so(capsys):
    with pytest.raises(ValueError, match=r"cache-writes: with ordering 'step-program' .* expected one writer, got "
                                         r"engine,adapter"):
        bench.run([262144], 4096, 2, [0, 1], [1.0], ["sleep"], ["side"], 3, cache_writes=("engine", "adapter"),
                  ordering="step-program")
    assert bench.main(["--ordering", "step-program", "--cache-writes", "engine,adapter"]) == 2
    assert capsys.readouterr().err.startswith("--cache-writes: with ordering 'step-program'")
