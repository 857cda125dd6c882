#!/usr/bin/env python3
"""Logits of the official DeepSeek V4.1 reference (model.py + kernel_cpu.py) on a dsv4 checkpoint.

Builds the reference `Transformer` from a config.json in the official format (`dsv4 config-json`),
loads a checkpoint written by `dsv4 random-checkpoint` into it, runs the prefill (forward from
position 0) and then one forward per decode id, as generate.py does (teacher forcing: the given ids,
not sampled ones), and saves the fp32 logits of the last prompt position and after each decode
token as a .npy array of shape (1 + len(decode), vocab): the same file `dsv4 logits` writes.

The reference code is imported at run time from its folder (e.g. .reference/deepseek_v41, which is
git-ignored); nothing of it is copied here. Every adaptation this script makes is listed in
tools/parity/README.md; none changes the math.

Usage (tools/parity/README.md has the full recipe):
  reference_logits.py --reference .reference/deepseek_v41 --checkpoint DIR --config tiny_config.json \
      --prompt 1,2,3 --decode 4,5 --out ref.npy [--device cuda|cpu] [--multipliers FILE] [--dump-dir DIR]
  reference_logits.py ... --cases tests/data/parity/cases.json --out-dir DIR [--suffix S]
  reference_logits.py ... --time 512,32 [--time-repeats 5]   (speed only; may follow a case)

--time PROMPT,STEPS times the reference the way generate.py runs it, at batch 1: a prefill of PROMPT
token ids (seeded random ids of the vocabulary) from position 0, then STEPS one-token forwards, after
one untimed warm-up, each repeat synchronized on the device; it prints the medians (prefill tokens/s,
decode ms per step) and records them with --info. This is the speed side of issue 6's comparison
with the official reference on the same GPU and checkpoint (scripts/gpu-reference-speed.sh runs
both sides).
"""

import argparse
import importlib
import importlib.util
import json
import math
import os
import struct
import sys
import time


def parse_ids(text, name):
    if text == "":
        return []
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        sys.exit(f"reference_logits: --{name} needs comma-separated token ids, got '{text}'")
    if any(i < 0 for i in ids):
        sys.exit(f"reference_logits: --{name}: token ids are non-negative")
    return ids


# ---- safetensors, read directly (no dependency on the safetensors package's dtype support) ----

def st_dtypes(torch):
    return {
        "BF16": torch.bfloat16,
        "F16": torch.float16,
        "F32": torch.float32,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E8M0": torch.float8_e8m0fnu,
        "I8": torch.int8,
        "U8": torch.uint8,
        "I32": torch.int32,
        "I64": torch.int64,
    }


def read_checkpoint(torch, folder):
    """name -> CPU tensor, for a folder with model.safetensors.index.json or one .safetensors file."""
    dtypes = st_dtypes(torch)
    if os.path.isdir(folder):
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(x for x in os.listdir(folder) if x.endswith(".safetensors"))
        paths = [os.path.join(folder, x) for x in files]
    else:
        paths = [folder]
    if not paths:
        sys.exit(f"reference_logits: no .safetensors file in {folder}")
    tensors = {}
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in dtypes:
                sys.exit(f"reference_logits: {path}: tensor {name} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            raw = bytearray(data[base + begin : base + end])
            t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            tensors[name] = t.view(dtypes[info["dtype"]]).reshape(info["shape"])
    return tensors


def dequantize_blocks(torch, w, s):
    """FP8 weight [N, K] times its E8M0 block scales (32x32 or 128x128 tiles, inferred from the
    scale's shape), as convert.py does for wo_a: exact in fp32, then bf16 (an E4M3 value times a
    power of two is exact in bf16)."""
    n, k = w.shape
    bs = math.ceil(n / s.shape[0])
    if math.ceil(n / bs) != s.shape[0] or math.ceil(k / bs) != s.shape[1]:
        sys.exit(f"reference_logits: scale shape {tuple(s.shape)} does not tile a {n} x {k} weight")
    sf = s.float().repeat_interleave(bs, dim=0)[:n].repeat_interleave(bs, dim=1)[:, :k]
    return (w.float() * sf).to(torch.bfloat16)


def load_into(torch, model, ckpt, device):
    """Checkpoint tensors -> the reference's parameters, by name. Conversions are exact only:
    same dtype; bf16 -> fp32 (modules that keep fp32 copies of bf16-stored weights); I8 bytes ->
    float4_e2m1fn_x2 (a reinterpretation: two E2M1 codes per byte, even element in the low nibble);
    wo_a F8 + scale -> bf16 (convert.py's dequantization). Anything else is refused."""
    used = set()
    loaded = 0
    for name, p in model.named_parameters():  # tied mtp.*.embed / mtp.*.head appear once, as embed / head
        if name not in ckpt:
            sys.exit(f"reference_logits: parameter {name} {tuple(p.shape)} {p.dtype} is not in the checkpoint")
        t = ckpt[name]
        used.add(name)
        if name.endswith("attn.wo_a.weight") and t.dtype == torch.float8_e4m3fn and p.dtype == torch.bfloat16:
            scale_name = name[: -len("weight")] + "scale"
            if scale_name not in ckpt:
                sys.exit(f"reference_logits: {name} is FP8 but {scale_name} is missing")
            used.add(scale_name)
            t = dequantize_blocks(torch, t, ckpt[scale_name])
        elif p.dtype == torch.float4_e2m1fn_x2 and t.dtype in (torch.int8, torch.uint8):
            t = t.view(torch.uint8)
        elif t.dtype == torch.bfloat16 and p.dtype == torch.float32:
            t = t.float()
        elif t.dtype != p.dtype:
            sys.exit(f"reference_logits: {name}: checkpoint dtype {t.dtype}, the reference module holds {p.dtype} "
                     "(no exact conversion)")
        if tuple(t.shape) != tuple(p.shape):
            sys.exit(f"reference_logits: {name}: checkpoint shape {tuple(t.shape)}, the reference module has {tuple(p.shape)}")
        if t.element_size() == 1:  # 1-byte formats travel as bytes (not every copy kernel has them)
            t = t.contiguous().view(torch.uint8).to(device).view(p.dtype)
        else:
            t = t.contiguous().to(device)
        p.data = t  # keeps the Parameter object (Linear.weight.scale refers to it)
        loaded += 1
    unused = sorted(set(ckpt) - used)
    if unused:
        sys.exit(f"reference_logits: {len(unused)} checkpoint tensors have no reference parameter, e.g. {unused[:5]}")
    return loaded


class ModuloTokenizer:
    """Just enough of a HF tokenizer for engram.build_compressed_token_map: token i decodes to the
    lower-case text t<i mod compressed>, which every normalizer step leaves as it is, so the
    compressed token map is i -> i mod compressed (first-seen ids). `compressed` defaults to the
    vocabulary (dsv4's tiny: the identity); bench_model's V4.1-width variant uses the same modulo
    map with V4.1's engram_compressed_vocab_size (99,092), which engram.py asserts."""

    def __init__(self, vocab_size, compressed=None):
        self.vocab_size = vocab_size
        self.compressed = compressed or vocab_size
        self.backend_tokenizer = self

    def __len__(self):
        return self.vocab_size

    def decode(self, ids, skip_special_tokens=False):
        (token_id,) = ids
        return f"t{token_id % self.compressed}"

    def id_to_token(self, token_id):
        return self.decode([token_id])


def run_case(torch, ref, model, prompt, decode, dump=None):
    """Prefill (forward from position 0), then one forward per decode id at positions len(prompt),
    len(prompt) + 1, ..., as generate.py's loop does; returns the fp32 logits rows [1 + len(decode), vocab].
    A prefill from position 0 rewrites every cache slot and shared slot that later forwards read
    (spec §7, SharedAttentionRuntime), so cases can run one after another on the same model.
    With `dump` (a dict), also records each block's prefill output: the residual, the pre-mix it
    hands to the next block, and the top-k lists published so far (read by tools/parity/layer_parity.cpp)."""
    hooks = []
    if dump is not None:
        def capture(i):
            def hook(module, inputs, output):
                if inputs[1] == 0:  # prefill only (start_pos 0)
                    dump.setdefault("x", []).append(output[0][0].float().flatten().cpu())
                    dump.setdefault("pre", []).append(output[1][0].float().flatten().cpu())
                    idx = ref.shared_attn.topk_idxs if module.attn.compress_ratio else None
                    dump.setdefault("topk", []).append(None if idx is None else idx[0].cpu())
            return hook
        for i, layer in enumerate(model.layers):
            hooks.append(layer.register_forward_hook(capture(i)))
    rows = []
    try:
        _, logits, _ = model(torch.tensor([prompt], dtype=torch.long), 0)
        rows.append(logits[0].float().cpu())
    finally:
        for h in hooks:
            h.remove()
    for step, tok in enumerate(decode):
        _, logits, _ = model(torch.tensor([[tok]], dtype=torch.long), len(prompt) + step)
        rows.append(logits[0].float().cpu())
    return torch.stack(rows).numpy()


def time_generation(torch, model, vocab, prompt_tokens, steps, repeats, device):
    """Median seconds of a prefill of `prompt_tokens` ids from position 0 and of `steps` one-token
    forwards after it (batch 1, as generate.py), over `repeats` runs after one warm-up run."""
    g = torch.Generator(device="cpu").manual_seed(20261202)
    ids = torch.randint(0, vocab, (prompt_tokens + steps,), generator=g, device="cpu").tolist()

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def once():
        with torch.inference_mode():
            sync()
            t0 = time.perf_counter()
            model(torch.tensor([ids[:prompt_tokens]], dtype=torch.long), 0)
            sync()
            t1 = time.perf_counter()
            for step in range(steps):
                model(torch.tensor([[ids[prompt_tokens + step]]], dtype=torch.long), prompt_tokens + step)
            sync()
            t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    def reported(what):
        r = once()
        print(f"reference_logits: {what}: prefill {r[0]:.3f} s, {steps} decode steps {r[1]:.3f} s", flush=True)
        return r

    reported("warm-up")
    runs = [reported(f"run {i + 1} of {repeats}") for i in range(repeats)]
    prefill = sorted(r[0] for r in runs)[len(runs) // 2]
    decode = sorted(r[1] for r in runs)[len(runs) // 2]
    return {
        "prompt_tokens": prompt_tokens,
        "decode_steps": steps,
        "repeats": repeats,
        "prefill_s": prefill,
        "prefill_tokens_per_s": prompt_tokens / prefill,
        "decode_s": decode,
        "decode_ms_per_step": 1e3 * decode / steps if steps else 0.0,
        "decode_tokens_per_s": steps / decode if steps else 0.0,
        "all_runs_s": [[round(a, 6), round(b, 6)] for a, b in runs],
    }


def save_dump(np, dump, folder, name, seqlen, index_topk):
    """<name>_x.npy [layers, s * hc * dim], <name>_pre.npy [layers, s * hc] and <name>_topk.npy
    [layers, s * index_topk] (float32; top-k rows padded with -2, all -2 for window-only layers)."""
    np.save(os.path.join(folder, f"{name}_x.npy"), np.stack([t.numpy() for t in dump["x"]]).astype(np.float32))
    np.save(os.path.join(folder, f"{name}_pre.npy"), np.stack([t.numpy() for t in dump["pre"]]).astype(np.float32))
    topk = np.full((len(dump["topk"]), seqlen, index_topk), -2, dtype=np.float32)
    for layer, t in enumerate(dump["topk"]):
        if t is not None:
            topk[layer, :, : t.shape[-1]] = t.numpy()
    np.save(os.path.join(folder, f"{name}_topk.npy"), topk.reshape(len(dump["topk"]), -1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True, help="folder of the reference package (model.py, kernel_cpu.py, engram.py, ...)")
    ap.add_argument("--checkpoint", required=True, help="checkpoint folder written by dsv4 random-checkpoint")
    ap.add_argument("--config", required=True, help="config.json in the official format (dsv4 config-json)")
    ap.add_argument("--prompt", help="comma-separated prompt token ids (one case)")
    ap.add_argument("--decode", default="", help="comma-separated ids fed one per decode step")
    ap.add_argument("--out", help="output .npy of the one case (rows: prefill, then each decode step)")
    ap.add_argument("--cases", help="instead of --prompt/--decode/--out: a cases.json (tests/data/parity) whose "
                    "cases all run on this one checkpoint, written to --out-dir as <name><suffix>.npy")
    ap.add_argument("--out-dir", help="output folder for --cases")
    ap.add_argument("--suffix", default="", help="appended to each case's file name (--cases)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--multipliers", help="JSON from dsv4 config-json --multipliers: replaces the reference's "
                    "Engram hash multipliers (only for testing the rest of the model while they differ)")
    ap.add_argument("--dump-dir", help="also save each case's per-layer prefill residuals, pre-mixes and top-k lists "
                    "there (<case>_x.npy, <case>_pre.npy, <case>_topk.npy; for tools/parity/layer_parity.cpp)")
    ap.add_argument("--info", help="write a JSON record of the run (versions, device, multipliers used)")
    ap.add_argument("--time", help="PROMPT,STEPS: also time a prefill of PROMPT random ids and STEPS decode forwards "
                                   "(batch 1; the medians are printed and recorded); alone, it needs no case")
    ap.add_argument("--time-repeats", type=int, default=5, help="timed runs of --time after one warm-up (default 5)")
    a = ap.parse_args()

    if a.cases:
        if not a.out_dir:
            sys.exit("reference_logits: --cases needs --out-dir")
        with open(a.cases) as f:
            cases = [(c["name"], parse_ids(c["prompt"], "prompt"), parse_ids(c["decode"], "decode"))
                     for c in json.load(f)["cases"]]
        outs = [os.path.join(a.out_dir, name + a.suffix + ".npy") for name, _, _ in cases]
    elif a.prompt is None and a.out is None and a.time:
        cases, outs = [], []
    else:
        if a.prompt is None or a.out is None:
            sys.exit("reference_logits: give --prompt and --out (or --cases and --out-dir, or --time alone)")
        cases = [("case", parse_ids(a.prompt, "prompt"), parse_ids(a.decode, "decode"))]
        outs = [a.out]
    timing_shape = None
    if a.time:
        try:
            timing_shape = [int(x) for x in a.time.split(",")]
        except ValueError:
            timing_shape = []
        if len(timing_shape) != 2 or timing_shape[0] < 1 or timing_shape[1] < 0:
            sys.exit(f"reference_logits: --time needs PROMPT,STEPS with PROMPT >= 1, got '{a.time}'")
        if a.time_repeats < 1:
            sys.exit(f"reference_logits: --time-repeats needs at least 1, got {a.time_repeats}")
    with open(a.config) as f:
        config = json.load(f)
    for name, prompt, decode in cases:
        if not prompt:
            sys.exit(f"reference_logits: {name}: the prompt needs at least one token id")
        for i in prompt + decode:
            if i >= config["vocab_size"]:
                sys.exit(f"reference_logits: {name}: token id {i} is outside the vocabulary ({config['vocab_size']} ids)")

    import numpy as np
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("reference_logits: --device cuda but no CUDA device is visible")
    # fp32 matmuls stay fp32 (no TF32), bf16 GEMMs reduce in fp32: the spec's GEMM semantics.
    for owner, flag in ((torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32"),
                        (torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction")):
        try:
            setattr(owner, flag, False)
        except (AttributeError, RuntimeError) as e:
            print(f"reference_logits: could not set {flag} = False: {e}", file=sys.stderr)
    # As generate.py: bf16 default dtype, the device as default device. kernel_cpu.py creates its
    # tables and accumulators without a device argument, so the default device is set before import.
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device(a.device)

    folder = os.path.abspath(a.reference)
    init = os.path.join(folder, "__init__.py")
    if not os.path.exists(init):
        sys.exit(f"reference_logits: {folder} has no __init__.py (the vendored reference folder is a package)")
    spec = importlib.util.spec_from_file_location("v41_reference", init, submodule_search_locations=[folder])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["v41_reference"] = pkg
    spec.loader.exec_module(pkg)
    ref = importlib.import_module("v41_reference.model")

    args = ref.ModelArgs(**config)
    for name, prompt, decode in cases:
        if len(prompt) + len(decode) > args.max_seq_len:
            sys.exit(f"reference_logits: {name}: {len(prompt) + len(decode)} positions exceed max_seq_len {args.max_seq_len}")
    if timing_shape and sum(timing_shape) > args.max_seq_len:
        sys.exit(f"reference_logits: --time {a.time}: {sum(timing_shape)} positions exceed max_seq_len {args.max_seq_len}")
    t0 = time.time()
    model = ref.Transformer(args, ModuloTokenizer(args.vocab_size, args.engram_compressed_vocab_size)).eval()
    print(f"reference_logits: the reference model built in {time.time() - t0:.1f} s", flush=True)
    ckpt = read_checkpoint(torch, a.checkpoint)
    print(f"reference_logits: {len(ckpt)} checkpoint tensors read at {time.time() - t0:.1f} s", flush=True)
    loaded = load_into(torch, model, ckpt, a.device)
    del ckpt
    print(f"reference_logits: {loaded} parameters loaded at {time.time() - t0:.1f} s", flush=True)
    reference_multipliers = model.engram_hash.multipliers.tolist() if model.engram_hash is not None else []
    used_multipliers = reference_multipliers
    if a.multipliers:
        with open(a.multipliers) as f:
            m = json.load(f)
        if list(m["engram_layer_ids"]) != list(args.engram_layer_ids):
            sys.exit(f"reference_logits: --multipliers is for Engram layers {m['engram_layer_ids']}, "
                     f"the config has {list(args.engram_layer_ids)}")
        override = torch.tensor(m["engram_hash_multipliers"], dtype=torch.int64)
        if tuple(override.shape) != tuple(model.engram_hash.multipliers.shape):
            sys.exit(f"reference_logits: --multipliers has shape {tuple(override.shape)}, "
                     f"the reference {tuple(model.engram_hash.multipliers.shape)}")
        model.engram_hash.multipliers.copy_(override)
        used_multipliers = override.tolist()
    t1 = time.time()

    for folder in (a.out_dir, a.dump_dir):
        if folder:
            os.makedirs(folder, exist_ok=True)
    results = []
    for (name, prompt, decode), out in zip(cases, outs):
        dump = {} if a.dump_dir else None
        logits = run_case(torch, ref, model, prompt, decode, dump).astype(np.float32)
        if a.dump_dir:
            save_dump(np, dump, a.dump_dir, name, len(prompt), args.index_topk)
        np.save(out, logits)
        results.append(logits)
        print(f"reference_logits: {name}: {logits.shape[0]} x {logits.shape[1]} logits -> {out}")
    if len(cases) > 1:
        # the first case once more, after the others: the model carries nothing over between cases
        again = run_case(torch, ref, model, cases[0][1], cases[0][2]).astype(np.float32)
        if not np.array_equal(again, results[0]):
            sys.exit(f"reference_logits: {cases[0][0]} run again after the other cases gave other logits")
    t2 = time.time()
    timing = None
    if timing_shape:
        timing = time_generation(torch, model, args.vocab_size, timing_shape[0], timing_shape[1], a.time_repeats, a.device)
        print(f"reference_logits: timed on {a.device}, batch 1: prefill of {timing['prompt_tokens']} tokens "
              f"{timing['prefill_s']:.4f} s ({timing['prefill_tokens_per_s']:.1f} tokens/s); {timing['decode_steps']} "
              f"decode steps {timing['decode_ms_per_step']:.2f} ms a step ({timing['decode_tokens_per_s']:.2f} tokens/s); "
              f"medians of {timing['repeats']}")
    record = {
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "numpy": np.__version__,
        "parameters_loaded": loaded,
        "reference_multipliers": reference_multipliers,
        "used_multipliers": used_multipliers,
        "multipliers_overridden": bool(a.multipliers),
        "cases": [{"name": n, "prompt_tokens": len(p), "decode_steps": len(d)} for n, p, d in cases],
        "load_s": round(t1 - t0, 2),
        "run_s": round(t2 - t1, 2),
        "timing": timing,
    }
    if a.info:
        with open(a.info, "w") as f:
            json.dump(record, f, indent=1)
    print(f"reference_logits: {a.device}, {loaded} parameters, multipliers "
          f"{'overridden' if a.multipliers else 'of the reference'}, load {t1 - t0:.1f} s, run {t2 - t1:.1f} s")
    print("reference_logits: record " + json.dumps(record))


if __name__ == "__main__":
    main()
