"""The `ckv-jax` command: `env`, `demo`, `bench`, `plot`."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="ckv-jax", description="CKV cache records for sparse-MLA models under DCP")
    if argv[:1] in (["--version"], ["-V"]):
        from ckv_jax import __version__
        print(f"ckv-jax {__version__}")
        return 0
    ap.add_argument("--version", "-V", action="store_true", help="print the version and exit")
    ap.add_argument("command", choices=["env", "demo", "bench", "plot"],
                    help="env: versions, devices, lowering; demo: a DCP prefill with depth-N prefetch, checked; "
                         "bench: kernel sweeps and prefill step times to JSON; plot: PNG charts of that JSON")
    args, rest = ap.parse_known_args(argv[:1])
    if args.command == "env":
        from ckv_jax import env_report
        if argv[1:]:
            ap.error(f"env takes no arguments, got {argv[1:]}")
        return env_report.main()
    if args.command == "bench":
        from ckv_jax.benchmarks import suite
        return suite.main(argv[1:])
    if args.command == "plot":
        from ckv_jax.benchmarks import plot
        return plot.main(argv[1:])
    from ckv_jax import demo
    return demo.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
