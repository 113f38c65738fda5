"""Which cases of the long test matrices CI runs. CI keeps a subset that still covers every family, layout and
feature at least once; TRESTLE_FULL_TESTS=1 runs every combination (the README's long run, before a release)."""
import os

FULL = os.environ.get("TRESTLE_FULL_TESTS") == "1"


def ci_cases(cases, kept):
    """`cases` whole under TRESTLE_FULL_TESTS=1, else the ones in `kept` (each of which must be a case)."""
    cases = list(cases)
    missing = [k for k in kept if k not in cases]
    assert not missing, f"ci_cases: kept cases that are not cases: {missing}"
    return cases if FULL else [c for c in cases if c in kept]
