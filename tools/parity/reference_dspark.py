#!/usr/bin/env python3
"""The official reference's DSpark drafter (forward_spec) on a dsv4 checkpoint, for a teacher-forced
comparison with dsv4's host drafter (model/dspark_reference.hpp).

For each case of a cases.json (tests/data/parity), as the reference's own self-test does: the
prefill (forward from 0) and forward_spec at start_pos 0 (seeds the rings), then for each decode id
a forward at its position and forward_spec with the backbone's output id. Temperature is 0 (argmax
everywhere), so every id is reproducible. Saves, per case, float32 .npy arrays:
  <case>_dspark_hidden.npy      [prompt + steps, targets * dim]: main_hidden of the prefill rows, then of each step
  <case>_dspark_ids.npy         [steps, block + 1]: output_ids of each forward_spec (column 0: its input id)
  <case>_dspark_logits.npy      [steps * block, vocab]: the draft logits (Markov bias included)
  <case>_dspark_confidence.npy  [steps, block]
dsv4's side feeds the same main_hidden and input ids to its drafter (tests/model/test_dspark_parity.cpp),
so the comparison covers the drafter alone, not the backbone's spread.

The reference is imported at run time (never copied); model construction and loading are
reference_logits.py's (same folder), with the same exact conversions.

Usage:
  reference_dspark.py --reference .reference/deepseek_v41 --checkpoint DIR --config tiny_config.json \
      --cases tests/data/parity/cases.json --out-dir DIR [--device cuda|cpu]
"""

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_logits as rl  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = ap.parse_args()
    with open(a.cases) as f:
        cases = [(c["name"], rl.parse_ids(c["prompt"], "prompt"), rl.parse_ids(c["decode"], "decode"))
                 for c in json.load(f)["cases"]]
    with open(a.config) as f:
        config = json.load(f)

    import numpy as np
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("reference_dspark: --device cuda but no CUDA device is visible")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device(a.device)
    folder = os.path.abspath(a.reference)
    spec = importlib.util.spec_from_file_location("v41_reference", os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["v41_reference"] = pkg
    spec.loader.exec_module(pkg)
    ref = importlib.import_module("v41_reference.model")

    args = ref.ModelArgs(**config)
    args.temperature = 0  # argmax: DSparkBlock and sample() read it
    if not args.dspark_block_size:
        sys.exit("reference_dspark: the config has no DSpark stages (dspark_block_size 0)")
    t0 = time.time()
    model = ref.Transformer(args, rl.ModuloTokenizer(args.vocab_size, args.engram_compressed_vocab_size)).eval()
    loaded = rl.load_into(torch, model, rl.read_checkpoint(torch, a.checkpoint), a.device)
    os.makedirs(a.out_dir, exist_ok=True)
    for name, prompt, decode in cases:
        hidden, ids, logits, conf = [], [], [], []
        out_ids, _, mh = model(torch.tensor([prompt], dtype=torch.long), 0)
        hidden.append(mh[0].float().cpu())
        if model.forward_spec(out_ids, mh, 0) is not None:
            sys.exit("reference_dspark: forward_spec at start_pos 0 returned drafts")
        for step, tok in enumerate(decode):
            pos = len(prompt) + step
            out_ids, _, mh = model(torch.tensor([[tok]], dtype=torch.long), pos)
            hidden.append(mh[0].float().cpu())
            d_ids, d_logits, d_conf = model.forward_spec(out_ids, mh, pos)
            ids.append(d_ids[0].float().cpu())
            logits.append(d_logits[0].float().cpu())
            conf.append(d_conf[0].float().cpu())
        save = lambda suffix, t: np.save(os.path.join(a.out_dir, f"{name}_dspark_{suffix}.npy"),
                                         t.numpy().astype(np.float32))
        save("hidden", torch.cat(hidden))
        save("ids", torch.stack(ids))
        save("logits", torch.cat(logits))
        save("confidence", torch.stack(conf))
        print(f"reference_dspark: {name}: {len(decode)} drafts, ids {[r.int().tolist() for r in ids]}")
    print(json.dumps({"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
                      "parameters_loaded": loaded, "seconds": round(time.time() - t0, 2)}))


if __name__ == "__main__":
    main()
