"""The torch adapter's host-time tools (maintainer tools, not installed): the per-name medians
of a traced gather, their table across rounds, the per-thread CPU accounting, and the timing of
`begin_step`'s host pieces."""
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
import adapter_host_drift  # noqa: E402
import adapter_host_timeline  # noqa: E402
import step_host_pieces  # noqa: E402
import step_shapes  # noqa: E402


def test_per_name_sums_each_gathers_pieces_and_counts_nested_repeats_once():
    us = 1000                                                  # events are in ns
    events = sorted([
        (0, 100 * us, "layer.gather"),
        (10 * us, 60 * us, "PjitFunction(layer_program)"),
        (11 * us, 58 * us, "PjitFunction(layer_program)"),    # jit's nested twin: counted once
        (20 * us, 5 * us, "cuLaunchKernelEx"),
        (40 * us, 7 * us, "cuLaunchKernelEx"),                 # two launches in one gather: summed
        (150 * us, 3 * us, "cuLaunchKernelEx"),                # between the gathers: no gather's
        (200 * us, 80 * us, "layer.gather"),
        (210 * us, 9 * us, "cuLaunchKernelEx"),
        (300 * us, 50 * us, "layer.set_current_chunk"),        # outside every gather
    ])
    per = adapter_host_timeline.per_name(events)
    assert per["= layer.gather"] == [100.0, 80.0]
    assert per["PjitFunction(layer_program)"] == [60.0]
    assert per["cuLaunchKernelEx"] == [12.0, 9.0]
    assert "layer.set_current_chunk" not in per


def test_rounds_table_lists_the_pieces_above_the_floor_in_any_round():
    rounds = [{"= layer.gather": [200.0, 210.0], "ffi_call": [4.0, 6.0], "tiny": [1.0]},
              {"= layer.gather": [390.0], "ffi_call": [8.0], "tiny": [2.0], "late": [3.5]}]
    lines = adapter_host_timeline.rounds_table(rounds).splitlines()
    assert lines[1].split() == ["205.0", "390.0", "=", "layer.gather"]     # the largest first
    assert lines[2].split() == ["5.0", "8.0", "ffi_call"]
    assert lines[3].split() == ["nan", "3.5", "late"]                        # missing in round 0
    assert not any(line.endswith("tiny") for line in lines)                  # under 3 us in every round


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread accounting reads Linux's /proc")
def test_cpu_account_charges_the_spinning_thread():
    account = adapter_host_drift.CpuAccount()

    def spin():
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            pass
        return "done"
    assert account.span(spin) == "done"
    name, _ = adapter_host_drift.thread_cpu_ns()[threading.get_native_id()]
    assert name == Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
    # the spinning thread was on a CPU for most of the span, even on a loaded 2-core machine
    assert 0.2 * account.wall_ns < account.by_name[name] < 2 * account.wall_ns
    assert account.wall_ns >= 0.3e9 and account.steal >= 0
    assert account.summary().startswith(f"threads on a CPU: {name} ")


def test_sample_shares_classifies_the_adapters_samples_and_leaves_compiles_out():
    gather = "TorchCkvAdapter.gather (interop/adapter.py:308)"
    program = "PrefetchOrchestrator._dispatch.<locals>.program (ckv_jax/prefetch.py:382)"
    raw = [
        f"<module> (host.py:3);{gather};{program};PjitFunction_tp_vectorcall (jaxlib/libjax_common.so);"
        "pjrt::PJRT_LoadedExecutable_Execute (xla_cuda13/xla_cuda_plugin.so) 6\n",
        f"<module> (host.py:3);{gather};{program};PjitFunction_tp_vectorcall (jaxlib/libjax_common.so);"
        "jax::ParseArguments (jaxlib/libjax_common.so) 2\n",
        f"<module> (host.py:3);{gather};TorchCkvAdapter._rebind (interop/adapter.py:319);"
        "ArrayImpl.addressable_data (jax/_src/array.py:511) 1\n",
        "<module> (host.py:3);TorchCkvAdapter.set_current_chunk (interop/adapter.py:271);"
        "StreamEvents.mark_latents (interop/stream_handoff.py:148);THCPEvent_record (libtorch_python.so) 1\n",
        f"<module> (host.py:3);{gather};PrefetchOrchestrator._layer_call (ckv_jax/prefetch.py:336) 2\n",
        f"<module> (host.py:3);{gather};{program};_cpp_pjit.<locals>.cache_miss (jax/_src/pjit.py:1);"
        "MeshComputation.compile (jax/_src/interpreters/pxla.py:2) 50\n",        # a compile: left out
        "<module> (host.py:3);Workload.begin_step (interop/bench.py:123) 30\n",   # outside the calls
    ]
    lines = adapter_host_timeline.sample_shares(raw).splitlines()
    assert lines[0].startswith("12 samples inside the adapter's calls")
    shares = {line.split("%", 1)[1].strip(): float(line.split("%")[0]) for line in lines[1:6]}
    assert shares == {"PJRT execute of the program": 50.0, "JAX jit call around it": 16.7,      # 6 and 2 of 12
                      "other JAX calls": 8.3, "torch calls": 8.3, "ckv-jax Python": 16.7}
    assert lines[6] == "the deepest ckv-jax line of each sample, by share:"
    assert lines[7].split() == ["66.7%", *program.split()]         # both jit samples end in the closure
    assert adapter_host_timeline.sample_shares(raw[-2:]) == "no samples inside the adapter's calls"


def test_the_host_pieces_of_begin_step_are_timed_for_a_step_of_several_ranks():
    got = step_host_pieces.pieces(world_size=2, requests=3, history=1000, chunk=96, calls=2, rounds=1)
    assert list(got) == ["build_step_plan", "check_block_table", "host_step_arrays", "topk_tables"]
    assert all(us > 0 for us in got.values())


@pytest.mark.parametrize("table", ["exact", "fixed"])
def test_a_prefill_counts_its_shapes_and_padding(table):
    # 2,048 tokens in chunks of 64 at D = 2 (block size 64): the exact P takes 1 to 16 units of
    # 64 rows, each for two steps, and so does the exact table's width; 4 shapes a doubling keep
    # 1 to 8 units and round 9 to 16 up to even ones: 12 shapes, rows padded by under a quarter
    steps, shapes, rows, exact = step_shapes.prefill_shapes(2048, 64, 2, 4, table)
    assert (steps, shapes) == (32, 12) and exact < rows < exact * 5 / 4
    exact_steps, exact_shapes, exact_rows, same = step_shapes.prefill_shapes(2048, 64, 2, 0, table)
    assert (exact_steps, exact_shapes) == (32, 16) and exact_rows == same == exact
