"""The command line: ``python -m dllm_ops generate --model PATH|NAME --prompt TEXT``.

Prints the generated text and the decode statistics (model calls, tokens per
second, tokens run); ``--json`` prints one JSON object instead. Every error is
one line on stderr and a non-zero exit status (2: bad arguments, 1: the
model or the decode failed); ``DLLM_OPS_TRACEBACK=1`` shows the traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

DTYPES = {"auto": None, "fp32": "float32", "float32": "float32", "bf16": "bfloat16",
          "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage block) and exit status 2."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def _cache_names() -> list[str]:
    from .policies import POLICIES
    return sorted(POLICIES)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m dllm_ops", description="dllm_ops: diffusion-LLM decoding")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    sub.required = True
    g = sub.add_parser("generate", help="decode an answer to a prompt and print it with its stats",
                       description="Decode with dllm_ops.generate; options default to generate()'s.")
    g.add_argument("--model", required=True,
                   help="checkpoint folder, or a shipped model: tiny-llada, tiny-dream")
    g.add_argument("--prompt", required=True, action="append",
                   help="prompt text (repeat for a batch)")
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message in the model's chat template")
    g.add_argument("--cache", default="none", help="cache method (default none)")
    g.add_argument("--gen-length", type=int, default=None, help="generated tokens (default 128)")
    g.add_argument("--block-length", type=int, default=None, help="block size (default 32)")
    g.add_argument("--steps", type=int, default=None, help="model-call budget (default gen-length)")
    g.add_argument("--unmask", default=None, help="LLaDA reveal rule: topk | threshold | factor")
    g.add_argument("--threshold", type=float, default=None, help="threshold rule's tau (0.9)")
    g.add_argument("--factor", type=float, default=None)
    g.add_argument("--alg", default=None, help="Dream's algorithm (default entropy)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--set", dest="options", action="append", default=[], metavar="KEY=VALUE",
                   help="any other generate() option, e.g. --set stop_at_eos=false, "
                        "--set d2cache.rollout_p=0.2 (values are JSON when they parse as JSON)")
    g.add_argument("--dtype", default="auto", choices=sorted(DTYPES),
                   help="weights and activations (auto: fp32 on CPU, bf16 on CUDA)")
    g.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)
    return p


def _generate_kwargs(args) -> dict:
    from .options import generate_options, parse_pairs
    given = parse_pairs(args.options)
    named = dict(cache=args.cache, gen_length=args.gen_length, block_length=args.block_length,
                 steps=args.steps, unmask=args.unmask, threshold=args.threshold,
                 factor=args.factor, alg=args.alg, temperature=args.temperature, seed=args.seed)
    for key, value in named.items():
        if value is None:
            continue
        if key in given:
            raise UsageError(f"python -m dllm_ops generate: {key} is given both as "
                             f"--{key.replace('_', '-')} and --set")
        given[key] = value
    return generate_options(given)


def cmd_generate(args) -> int:
    import torch

    import dllm_ops

    kwargs = _generate_kwargs(args)   # option errors before the model loads
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = DTYPES[args.dtype] or ("bfloat16" if device.startswith("cuda") else "float32")
    model = dllm_ops.load(args.model, dtype=getattr(torch, dtype_name), device=device)
    if args.chat:
        messages = [[{"role": "user", "content": p}] for p in args.prompt]
        out = dllm_ops.generate(model, model.tokenizer, messages=messages, **kwargs)
    else:
        out = dllm_ops.generate(model, model.tokenizer, prompt=args.prompt, **kwargs)
    s = out.stats
    if args.json:
        print(json.dumps(dict(model=args.model, device=device, dtype=dtype_name, prompts=args.prompt,
                              text=out.text, tokens=out.sequences, options=kwargs, stats=s),
                         default=str))
        return 0
    for r, text in enumerate(out.text):
        print(text if len(out.text) == 1 else f"[{r}] {text}")
    print(f"-- NFE {s['nfe']}, {s['generated_tokens']} tokens in {s['wall_s']:.3f} s "
          f"({s['tokens_per_s']:.1f} tok/s), tokens run {s['tokens_recomputed']} "
          f"({s['n_layers']} layers), cache {s['cache']}, reveal {s['reveal']}")
    return 0


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, no traceback: the CLI's contract
        if os.environ.get("DLLM_OPS_TRACEBACK") == "1":
            raise
        from .options import OptionError
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2 if isinstance(e, OptionError) else 1
