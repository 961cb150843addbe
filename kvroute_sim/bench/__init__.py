"""``kvroute bench``: the performance figures (P1–P8 and the soak), measured side by side.

Each figure lives in its own module; ``kvroute_sim.bench.cli`` runs them in order, prints one
table and writes every number to ``bench-results.json``.
"""
