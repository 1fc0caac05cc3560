"""The command line: ``python -m dllm_ops generate --model PATH|NAME --prompt TEXT``
(and ``python -m dllm_ops serve --model PATH|NAME``: dllm_ops/serve/command.py).

What to decode is one :class:`dllm_ops.config.DecodeConfig`, built in this
order: ``--config FILE.json`` (a DecodeConfig as JSON, whole or partial; the
defaults otherwise), then the dedicated flags (``--cache``, ``--gen-length``,
``--threshold``, ...) and every ``--set KEY=VALUE`` on top, through
:func:`dllm_ops.config.config_from_settings` (the parser lm-eval's
``model_args`` use too). A key is a dotted path of the configuration
(``cache.method=d2cache``, ``cache.d2cache.rollout_p=0.2``,
``reuse.method=kv``) or a keyword of ``generate`` (``cache=dual``,
``d2cache.rollout_p=0.2``, ``dare=kv``, ``dare_opts.rho=0.5``,
``kv_quant.bits=4``); a flag and a ``--set`` naming the same field is an error.
``--print-config`` prints the resolved configuration as JSON and exits (no
model is loaded): that JSON is a ``--config`` file.

Prints the generated text and the decode statistics (model calls, tokens per
second, tokens run); ``--json`` prints one JSON object instead (with the
configuration that ran under ``config``). Every error is one line on stderr
and a non-zero exit status (2: bad arguments or configuration, 1: the model or
the decode failed); ``DLLM_OPS_TRACEBACK=1`` shows the traceback.
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


#: dedicated flags -> the configuration path each sets (argparse dest -> path)
FLAG_PATHS = {
    "cache": "cache.method", "gen_length": "shape.gen_length", "block_length": "shape.block_length",
    "steps": "shape.steps", "unmask": "reveal.unmask", "threshold": "reveal.threshold",
    "factor": "reveal.factor", "alg": "reveal.alg", "temperature": "reveal.temperature",
    "seed": "shape.seed",
}


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m dllm_ops", description="dllm_ops: diffusion-LLM decoding")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    sub.required = True
    g = sub.add_parser("generate", help="decode an answer to a prompt and print it with its stats",
                       description="Decode with dllm_ops.generate; the decode configuration is "
                                   "--config FILE (or the defaults), then the flags and --set on top.")
    g.add_argument("--model", help="checkpoint folder, or a shipped model: tiny-llada, tiny-dream "
                                   "(required unless --print-config)")
    g.add_argument("--prompt", action="append",
                   help="prompt text (repeat for a batch; required unless --print-config)")
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message in the model's chat template")
    g.add_argument("--print-config", action="store_true",
                   help="print the resolved decode configuration as JSON and exit (a --config file)")
    add_decode_arguments(g)
    add_model_arguments(g)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)
    from .serve.command import add_server_arguments
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (dllm_ops/serve)",
                       description="Serve a model over HTTP; the decode defaults are --config FILE "
                                   "(or the defaults), then the flags and --set on top; each "
                                   "request's max_tokens sets the region.")
    s.add_argument("--model", required=True,
                   help="checkpoint folder, or a shipped model: tiny-llada, tiny-dream")
    add_server_arguments(s)
    add_decode_arguments(s, region=False)
    add_model_arguments(s)
    s.set_defaults(func=cmd_serve)
    return p


def add_decode_arguments(g, *, region: bool = True) -> None:
    """The decode configuration's flags: --config, the dedicated flags, --set
    (``region=False``: no --gen-length; the server takes it from each request)."""
    g.add_argument("--config", dest="config_file", metavar="FILE.json",
                   help="a decode configuration as JSON (DecodeConfig.to_json / --print-config); "
                        "flags and --set apply on top")
    g.add_argument("--cache", default=None, help="cache method: none | prefix | dual | d2cache "
                                                 "(default none)")
    if region:
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
                   help="any configuration field by its path or generate() keyword, e.g. "
                        "--set cache.d2cache.rollout_p=0.2, --set reuse.method=kv --set reuse.rho=0.5, "
                        "--set stop_at_eos=false (values are JSON when they parse as JSON)")


def add_model_arguments(g) -> None:
    """--dtype, --device, --threads (see :func:`load_model`)."""
    g.add_argument("--dtype", default="auto", choices=sorted(DTYPES),
                   help="weights and activations (auto: fp32 on CPU, bf16 on CUDA)")
    g.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads")


def _load_config_file(path: str, command: str = "generate"):
    from .config import DecodeConfig
    from .errors import ConfigError
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise UsageError(f"python -m dllm_ops {command}: --config {path}: {e.strerror}") from None
    except ValueError as e:
        raise UsageError(f"python -m dllm_ops {command}: --config {path}: not valid JSON ({e})") from None
    try:
        return DecodeConfig.from_dict(data)
    except ConfigError as e:
        raise UsageError(f"python -m dllm_ops {command}: --config {path}: {e}") from None


def decode_config(args):
    """The DecodeConfig of parsed ``generate`` (or ``serve``) arguments: --config
    (or the defaults), then the dedicated flags and --set, one parser for both."""
    from .config import DecodeConfig, config_from_settings, leaf_paths, parse_pairs, settings_tree
    from .errors import ConfigError
    from .options import OptionError
    command = getattr(args, "command", None) or "generate"
    base = _load_config_file(args.config_file, command) if args.config_file else DecodeConfig()
    try:
        given = parse_pairs(args.options)
        from_set = leaf_paths(settings_tree(given))
        settings = dict(given)
        for dest, path in FLAG_PATHS.items():
            value = getattr(args, dest, None)   # serve has no --gen-length
            if value is None:
                continue
            if path in from_set or path in settings:
                flag = "--" + dest.replace("_", "-")
                raise UsageError(f"python -m dllm_ops {command}: {dest} is given both as {flag} "
                                 f"and --set")
            settings[path] = value
        return config_from_settings(settings, base)
    except (ConfigError, OptionError) as e:
        raise UsageError(str(e)) from None


def config_from_argv(argv: list[str]):
    """The DecodeConfig a ``python -m dllm_ops generate ...`` command line would
    decode with (``argv`` without the program name), without loading a model."""
    return decode_config(build_parser().parse_args(argv))


def load_model(args):
    """``(model, device, dtype name)`` for --model, --dtype, --device, --threads."""
    import torch

    import dllm_ops

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = DTYPES[args.dtype] or ("bfloat16" if device.startswith("cuda") else "float32")
    return dllm_ops.load(args.model, dtype=getattr(torch, dtype_name), device=device), device, dtype_name


def cmd_generate(args) -> int:
    config = decode_config(args)   # configuration errors before the model loads
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2, sort_keys=True))
        return 0
    for flag in ("model", "prompt"):
        if not getattr(args, flag):
            raise UsageError(f"python -m dllm_ops generate: the following arguments are required: "
                             f"--{flag}")

    import dllm_ops

    model, device, dtype_name = load_model(args)
    if args.chat:
        messages = [[{"role": "user", "content": p}] for p in args.prompt]
        out = dllm_ops.generate(model, model.tokenizer, config, messages=messages)
    else:
        out = dllm_ops.generate(model, model.tokenizer, config, prompt=args.prompt)
    s = dict(out.stats)
    if args.json:
        print(json.dumps(dict(model=args.model, device=device, dtype=dtype_name, prompts=args.prompt,
                              text=out.text, tokens=out.sequences, config=config.to_dict(), stats=s),
                         default=str))
        return 0
    for r, text in enumerate(out.text):
        print(text if len(out.text) == 1 else f"[{r}] {text}")
    print(f"-- NFE {s['nfe']}, {s['generated_tokens']} tokens in {s['wall_s']:.3f} s "
          f"({s['tokens_per_s']:.1f} tok/s), tokens run {s['tokens_recomputed']} "
          f"({s['n_layers']} layers), cache {s['cache']}, reveal {s['reveal']}")
    return 0


def cmd_serve(args) -> int:
    from .serve.command import serve
    config = decode_config(args)   # configuration errors before the model loads
    model, _, _ = load_model(args)
    return serve(args, model, config)


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
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 1
