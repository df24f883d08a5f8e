import os

# How long an idle OpenMP worker spins before it sleeps, set before torch loads libgomp
# (a value the user exported wins). libgomp's default spins for about a millisecond after
# every parallel region; between the engine's kernels, which run on headroom's own pool at
# decode sizes, such a spinning worker holds one of the cores the pool needs: on a 2-core
# EPYC a decode step of 2 sequences took 22 ms instead of 13. 20,000 spins still bridge the
# gaps between the matmuls of a prefill or of a large batch (step times unchanged).
os.environ.setdefault("GOMP_SPINCOUNT", "20000")
