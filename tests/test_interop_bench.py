"""`python -m interop.bench`'s host-side pieces that run without a GPU: the printed row, the
compute's marks option, a rank's workload and the merge of a run of several processes (the
matrix itself runs on GPUs)."""
import numpy as np
import pytest
import torch

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


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_workload_writes_the_chunk_tokens_it_owns_into_its_own_slots(rank):
    """`--processes 2`: each rank's engine write stores the records of the chunk tokens whose
    global position p it owns (p % 2 == rank) at block table[p // 2 // 16], row p // 2 % 16 of
    its cache, the same table on both ranks, and leaves every other row as it was."""
    history, chunk, block = 200, 37, 16
    work = bench.Workload(history, chunk, 1, block_size=block, world_size=2, rank=rank, device="cpu")
    other = bench.Workload(history, chunk, 1, block_size=block, world_size=2, rank=1 - rank, device="cpu")
    assert torch.equal(work.table, other.table)
    assert work.local_len == sum(1 for p in range(history + chunk) if p % 2 == rank)
    before = work.caches[0].clone().view(-1, bench.FMT.record_bytes)
    work.write(0)
    after = work.caches[0].view(-1, bench.FMT.record_bytes)
    table = work.table[0].numpy()
    written = set()
    for token, p in enumerate(range(history, history + chunk)):
        if p % 2 != rank:
            continue
        local = p // 2
        slot = int(table[local // block]) * block + local % block
        assert torch.equal(after[slot], work.records[token]), (token, p, slot)
        written.add(slot)
    assert len(written) == sum(1 for p in range(history, history + chunk) if p % 2 == rank)
    untouched = np.setdiff1d(np.arange(after.shape[0]), sorted(written))
    assert torch.equal(after[untouched], before[untouched])


def test_a_workload_names_a_rank_outside_the_ranks():
    with pytest.raises(ValueError, match=r"rank: expected 0 <= rank < world_size = 2, got 2"):
        bench.Workload(64, 8, 1, block_size=16, world_size=2, rank=2, device="cpu")


def test_the_ranks_json_merge_into_one_in_rank_order():
    parts = [dict(device="GPU", jax="0", torch="0", command=f"rank {r}", pack=[dict(us=r)],
                  rows=[_row(0, 9.0, 0.0, rank=r, world_size=2), _row(1, 8.1, 90.0, rank=r, world_size=2)])
             for r in range(2)]
    merged = bench.merge_ranks(parts, "python -m interop.bench --processes 2")
    assert merged["processes"] == 2 and merged["command"] == "python -m interop.bench --processes 2"
    assert merged["pack"] == {"0": [dict(us=0)], "1": [dict(us=1)]}
    assert [(r["rank"], r["depth"]) for r in merged["rows"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert merged["device"] == "GPU"
    with pytest.raises(ValueError, match=r"parts: expected the ranks 0..1 in order, got rows of ranks \[1, 0\]"):
        bench.merge_ranks(parts[::-1], "")
    assert bench.rank_out("runs/interop.json", 1) == "runs/interop.rank1.json"
    assert bench._line(parts[1]["rows"]).startswith("rank 1:  sleep")


def test_a_run_of_several_processes_names_what_it_needs(capsys):
    assert bench.main(["--processes", "0"]) == 2
    assert capsys.readouterr().err.startswith("--processes: expected a positive number of processes, got 0")
    assert bench.main(["--processes", "2", "--process-id", "2", "--coordinator", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.startswith("--process-id: expected 0 <= id < --processes = 2")
    assert bench.main(["--processes", "64"]) == 2
    assert "--processes: expected at most the" in capsys.readouterr().err


@pytest.mark.slow
def test_the_launcher_stops_every_process_once_one_fails(monkeypatch, tmp_path, capsys):
    """`--processes 2` where the processes cannot run the bench (they find no GPU): the launcher
    starts both as real processes, sees one exit with an error, stops any still running (it
    would wait for its peer) and fails, writing no JSON."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    out = tmp_path / "interop.json"
    assert bench.main(["--processes", "2", "--out", str(out)]) == 1
    assert "the others were stopped" in capsys.readouterr().err
    assert not out.exists()
