"""The start every worker of a multi-process test shares: its arguments, as
`helpers.run_workers` passes them, and its join of the run's `jax.distributed`.  A worker sets
JAX_NUM_CPU_DEVICES before it imports this module (which imports jax)."""
import jax


def join(argv, *, local_device_ids=None) -> tuple[int, int, list[str]]:
    """argv: [script, PROCESS_ID, NUM_PROCESSES, PORT, ...].  Joins the run with short
    heartbeats: when a peer dies, the survivor's collective fails within seconds.
    local_device_ids: this process's devices (a GPU worker's one GPU; None: all it sees).
    Returns (process id, processes, the worker's own arguments after PORT)."""
    pid, nproc, port = int(argv[1]), int(argv[2]), argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                               local_device_ids=local_device_ids, initialization_timeout=60,
                               heartbeat_timeout_seconds=10)
    return pid, nproc, argv[4:]
