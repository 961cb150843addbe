"""Settings shared by every test module."""

from hypothesis import settings

# Property tests on a shared, busy CI machine: no per-example time limit (a slow example is the
# machine, not the code), and the same examples on every run (derandomized, no example database),
# so a failure reproduces from the test's name alone.
settings.register_profile("kvroute", deadline=None, derandomize=True, database=None)
settings.load_profile("kvroute")
