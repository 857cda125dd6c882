#!/usr/bin/env python3
"""Writes tests/data/numpy_rng.json: NumPy's default_rng stream, for include/dsv4/engram/numpy_rng.hpp.

Run with a real NumPy (Debian 12: apt-get install python3-numpy; /usr/bin/python3):
    /usr/bin/python3 tests/engram/gen_numpy_rng_vectors.py > tests/data/numpy_rng.json
The tests read the JSON only, so they do not need NumPy. Every number is a decimal string (JSON
integers in our reader are signed 64-bit, and some values here are unsigned 64- or 128-bit).
"""

import json
import sys

import numpy as np

INT64_MAX = np.iinfo(np.int64).max
SEEDS = [0, 1, 10007, 140098, 2**32 + 5, 2**64 - 59]
N_RAW = 8


def seed_case(seed):
    ss = np.random.SeedSequence(seed)
    bitgen = np.random.PCG64(ss)
    st = bitgen.state["state"]
    case = {
        "seed": str(seed),
        "pool": [str(int(w)) for w in ss.pool],
        "state32": [str(int(w)) for w in ss.generate_state(8, np.uint32)],
        "state64": [str(int(w)) for w in ss.generate_state(4, np.uint64)],
        "pcg_state": str(st["state"]),  # after seeding (srandom's two steps)
        "pcg_inc": str(st["inc"]),
    }
    # Through default_rng, as engram.py does: its bit generator's raw 64-bit outputs.
    case["next64"] = [str(int(v)) for v in np.random.default_rng(seed).bit_generator.random_raw(N_RAW)]
    return case


# (low, high, size, dtype): half-open ranges around the 32-bit boundary and the rejection paths.
INTEGER_CASES = [
    (0, 1, 4, "int64"),                # rng 0: no draw
    (0, 2, 4, "int64"),
    (0, 1000, 7, "int64"),             # 32-bit path: halves of 64-bit draws
    (-5, 7, 5, "int64"),
    (0, 2**31 + 1, 8, "int64"),        # 32-bit Lemire, rejects about half the draws
    (0, 2**32 - 1, 4, "int64"),
    (0, 2**32, 5, "int64"),            # rng = 2^32 - 1: plain 32-bit words
    (0, 2**32 + 1, 4, "int64"),        # rng = 2^32: 64-bit path
    (0, 2**33 + 7, 4, "int64"),
    (0, 46539438283891, 4, "int64"),   # V4.1's multiplier bound
    (0, 2**62 + 12345, 4, "int64"),
    (0, INT64_MAX, 4, "int64"),
    (-(2**63), INT64_MAX, 4, "int64"),  # rng = 2^64 - 2
    (0, 2**63 + 1, 8, "uint64"),       # 64-bit Lemire, rejects about half the draws
    (0, 2**64, 4, "uint64"),           # rng = 2^64 - 1: raw 64-bit outputs
    (10, 2**64, 3, "uint64"),
]


def integers_cases():
    out = []
    for seed in [0, 1, 10007, 2**64 - 59]:
        for low, high, size, dtype in INTEGER_CASES:
            g = np.random.default_rng(seed)
            v = g.integers(low, high, size=size, dtype=getattr(np, dtype))
            out.append({"seed": str(seed), "low": str(low), "high": str(high), "dtype": dtype,
                        "values": [str(int(x)) for x in v]})
    return out


def call_sequence(seed, calls):
    """One generator, several integers() calls in a row: the 32-bit half kept back by one call
    is handed out by the next one that takes the 32-bit path."""
    g = np.random.default_rng(seed)
    steps = []
    for low, high, size in calls:
        v = g.integers(low, high, size=size, dtype=np.int64)
        steps.append({"low": str(low), "high": str(high), "values": [str(int(x)) for x in v]})
    steps.append({"next64": [str(int(x)) for x in g.bit_generator.random_raw(2)]})
    return {"seed": str(seed), "steps": steps}


def multipliers(layer_ids, max_ngram, compressed_vocab):
    # engram.py's compute_hash_multipliers, one row per layer.
    bound = max(1, (INT64_MAX // compressed_vocab) // 2)
    rows = {}
    for layer in layer_ids:
        v = np.random.default_rng(10007 * layer).integers(low=0, high=bound, size=(max_ngram,), dtype=np.int64)
        rows[str(layer)] = [str(int(x)) for x in v * 2 + 1]
    return {"max_ngram": max_ngram, "compressed_vocab": compressed_vocab, "bound": str(bound), "layers": rows}


def main():
    data = {
        "numpy_version": np.__version__,
        "generator": "tests/engram/gen_numpy_rng_vectors.py",
        "seeds": [seed_case(s) for s in SEEDS],
        "integers": integers_cases(),
        "sequences": [
            call_sequence(3, [(0, 1000, 3), (0, 2**40, 2), (0, 1000, 1), (0, 1000, 2)]),
            call_sequence(140098, [(0, 2**32, 1), (0, 2**33, 1), (0, 2**32, 1)]),
        ],
        "multipliers": [
            multipliers((1, 14), 4, 99092),  # V4.1 Flash
            multipliers((1, 14), 4, 1024),   # tiny
            multipliers((1, 2, 3), 3, 2**62),  # bound 1: every multiplier is 1
        ],
    }
    json.dump(data, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
