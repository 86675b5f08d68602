"""The start every CPU worker of a multi-process test shares: its arguments, as
`helpers.run_workers` passes them, and its join of the run's `jax.distributed`.  A worker sets
JAX_NUM_CPU_DEVICES before it imports this module (which imports jax)."""
import jax


def join(argv) -> tuple[int, int, str]:
    """argv: [script, PROCESS_ID, NUM_PROCESSES, PORT, OUT, ...].  Joins the run with short
    heartbeats: when a peer dies, the survivor's collective fails within seconds.  Returns
    (process id, processes, OUT)."""
    pid, nproc, port, out = int(argv[1]), int(argv[2]), argv[3], argv[4]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                               initialization_timeout=60, heartbeat_timeout_seconds=10)
    return pid, nproc, out
