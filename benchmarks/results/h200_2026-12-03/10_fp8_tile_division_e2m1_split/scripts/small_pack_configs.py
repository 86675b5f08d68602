"""The pack sweep at 32,768 and 65,536 records with more tile shapes than `tune` keeps (from
2 rows and 1 warp to 16 rows and 8 warps), against torch and XLA in the same run."""
import sys

from ckv_jax.benchmarks import tune
from pallas_kernels.paged_gather import GatherConfig

tune.GATHER_CONFIGS = [GatherConfig(t, w) for t, w in
                       [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (8, 8), (16, 4), (16, 8)]]
sys.exit(tune.main(["--ops", "gather_records", "--tokens", "32768,65536", "--json", sys.argv[1]]))
