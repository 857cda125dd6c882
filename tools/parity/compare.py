#!/usr/bin/env python3
"""Compares two logits files (.npy, float32, rows x vocab: `dsv4 logits`, reference_logits.py).

Prints, per row and overall: the max absolute error; the max relative error (absolute error over
the row's max |logit| in the first file, the reference); the RMS relative error (RMS of the
difference over the RMS of the reference row), and its mean over the rows; whether the argmax
agrees. Exits 1 if a row's max or RMS relative error, or the mean RMS relative error, is above its
tolerance, or, with --argmax, if an argmax differs where the reference's top two logits are
further apart than the max-relative tolerance (a closer pair is within tolerance, so either order
passes); exits 2 on unreadable input or mismatched shapes. Plain Python (no NumPy needed).

Tolerances: --tol / --rms-tol / --mean-rms-tol, or a case's "tolerance" entry of a cases.json
(--cases FILE --case NAME). The defaults are the short-context ones; tools/parity/README.md
("Tolerance") says where they come from.

Usage: compare.py REFERENCE.npy OURS.npy [--cases tests/data/parity/cases.json --case NAME]
                  [--tol T] [--rms-tol T] [--mean-rms-tol T] [--argmax]
"""

import argparse
import array
import ast
import json
import struct
import sys

# Short-context tolerances (tests/data/parity/cases.json, case "short"; README: "Tolerance").
DEFAULT_TOL, DEFAULT_RMS_TOL, DEFAULT_MEAN_RMS_TOL = 0.15, 0.15, 0.12


def read_npy(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        print(f"compare: {e}", file=sys.stderr)
        sys.exit(2)
    if data[:6] != b"\x93NUMPY":
        print(f"compare: {path}: not a .npy file", file=sys.stderr)
        sys.exit(2)
    major = data[6]
    if major == 1:
        (n,) = struct.unpack("<H", data[8:10])
        start = 10
    else:
        (n,) = struct.unpack("<I", data[8:12])
        start = 12
    header = ast.literal_eval(data[start : start + n].decode("latin1"))
    if header["descr"] != "<f4" or header["fortran_order"]:
        print(f"compare: {path}: holds {header['descr']} (fortran_order {header['fortran_order']}), "
              "expected little-endian float32 in C order", file=sys.stderr)
        sys.exit(2)
    shape = tuple(header["shape"])
    if len(shape) == 1:
        shape = (1, shape[0])
    if len(shape) != 2:
        print(f"compare: {path}: a {len(shape)}-D array, expected rows x vocab", file=sys.stderr)
        sys.exit(2)
    values = array.array("f")
    values.frombytes(data[start + n :])
    if len(values) != shape[0] * shape[1]:
        print(f"compare: {path}: {len(values)} values for shape {shape}", file=sys.stderr)
        sys.exit(2)
    return shape, values


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference")
    ap.add_argument("ours")
    ap.add_argument("--tol", type=float, help=f"max relative error per row (default {DEFAULT_TOL})")
    ap.add_argument("--rms-tol", type=float, help=f"RMS relative error per row (default {DEFAULT_RMS_TOL})")
    ap.add_argument("--mean-rms-tol", type=float, help=f"mean over the rows of the RMS relative error (default {DEFAULT_MEAN_RMS_TOL})")
    ap.add_argument("--cases", help="cases.json whose case --case gives the tolerances")
    ap.add_argument("--case", help="the case's name in --cases")
    ap.add_argument("--argmax", action="store_true", help="also fail when an argmax differs")
    a = ap.parse_args()
    tol = {"max_rel": DEFAULT_TOL, "rms_rel": DEFAULT_RMS_TOL, "mean_rms_rel": DEFAULT_MEAN_RMS_TOL}
    if a.cases or a.case:
        if not (a.cases and a.case):
            print("compare: --cases and --case go together", file=sys.stderr)
            sys.exit(2)
        with open(a.cases) as f:
            found = [c for c in json.load(f)["cases"] if c["name"] == a.case]
        if not found:
            print(f"compare: no case '{a.case}' in {a.cases}", file=sys.stderr)
            sys.exit(2)
        tol.update(found[0]["tolerance"])
    for key, value in (("max_rel", a.tol), ("rms_rel", a.rms_tol), ("mean_rms_rel", a.mean_rms_tol)):
        if value is not None:
            tol[key] = value
    a.tol = tol["max_rel"]
    (rows, cols), ref = read_npy(a.reference)
    shape2, ours = read_npy(a.ours)
    if shape2 != (rows, cols):
        print(f"compare: shapes differ: {a.reference} is {(rows, cols)}, {a.ours} is {shape2}", file=sys.stderr)
        sys.exit(2)
    worst_abs = worst_rel = worst_rms = sum_rms = 0.0
    agree = 0
    failed = []
    print(f"{'row':>7} {'max |ref|':>10} {'max abs err':>12} {'max rel err':>12} {'rms rel err':>12} {'argmax ref/ours':>16}")
    for r in range(rows):
        a_row = ref[r * cols : (r + 1) * cols]
        b_row = ours[r * cols : (r + 1) * cols]
        scale = max(abs(x) for x in a_row)
        diffs = [x - y for x, y in zip(a_row, b_row)]
        err = max(abs(d) for d in diffs)
        rel = err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))
        rms_ref = (sum(x * x for x in a_row) / cols) ** 0.5
        rms = (sum(d * d for d in diffs) / cols) ** 0.5 / rms_ref if rms_ref > 0 else (0.0 if err == 0 else float("inf"))
        order = sorted(range(cols), key=lambda i: a_row[i], reverse=True)
        am_a, am_b = order[0], max(range(cols), key=lambda i: b_row[i])
        decisive = a_row[order[0]] - a_row[order[1]] > a.tol * scale
        agree += am_a == am_b
        worst_abs, worst_rel, worst_rms = max(worst_abs, err), max(worst_rel, rel), max(worst_rms, rms)
        sum_rms += rms
        bad = rel > a.tol or rms > tol["rms_rel"] or rel != rel or (a.argmax and am_a != am_b and decisive)
        if bad:
            failed.append(r)
        label = "prefill" if r == 0 else f"dec {r}"
        flag = "  FAIL" if bad else ("" if am_a == am_b else "  (argmax: top two within tolerance)")
        print(f"{label:>7} {scale:10.4f} {err:12.4e} {rel:12.4e} {rms:12.4e} {am_a:>8}/{am_b:<7}{flag}")
    mean_rms = sum_rms / rows
    print(f"overall: max abs err {worst_abs:.4e}, max rel err {worst_rel:.4e} (tolerance {a.tol:.4g}), "
          f"rms rel err {worst_rms:.4e} (tolerance {tol['rms_rel']:.4g}), mean rms rel err {mean_rms:.4e} "
          f"(tolerance {tol['mean_rms_rel']:.4g}), argmax agrees on {agree}/{rows} rows")
    if failed or mean_rms > tol["mean_rms_rel"]:
        print(f"compare: FAILED" + (f" on rows {failed}" if failed else "") +
              (" (mean rms rel err)" if mean_rms > tol["mean_rms_rel"] else ""), file=sys.stderr)
        sys.exit(1)
    print("compare: OK")


if __name__ == "__main__":
    main()
