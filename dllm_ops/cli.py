r"""The command line: ``python -m dllm_ops generate --model PATH|NAME --prompt TEXT``
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

Prompts: ``--prompt TEXT`` (repeat for one batch), or ``--prompt-file FILE``
(one prompt per line, empty lines skipped; ``-`` is stdin), or, with neither,
the lines of stdin when stdin is not a terminal; prompts from a file or stdin
are decoded ``--batch-size`` at a time (a row's answer does not depend on its
batch).

The generated text goes to stdout and the decode statistics (model calls,
tokens per second, tokens run; one ``-- ...`` line per batch) to stderr, so
``... | other-command`` gets the text alone. A single ``--prompt``'s answer is
printed as it is; otherwise each answer is one line, in prompt order, with
``\`` and newlines inside an answer written as ``\\`` and ``\n``
(:func:`escape_line`). ``--json`` prints one JSON object instead (with the
configuration that ran under ``config``; text and tokens are lists, one entry
per ``--prompt``); with prompts from a file or stdin it prints JSON lines, one
object per prompt in order (``index``, ``prompt``, ``text``, ``tokens``, and
``batch`` / ``stats`` of the batch that decoded it).

Everything that can be checked without the weights is checked before the
model loads: the flags' choices (argparse ``choices`` from the configuration's
registries), the configuration (``--config``, flags, ``--set``), and against
the checkpoint's config.json the reveal rule and block geometry
(:func:`check_before_load`). Every error is one line on stderr and a non-zero
exit status (2: bad arguments or configuration, 1: the model or the decode
failed); ``DLLM_OPS_TRACEBACK=1`` shows the traceback. ``--version`` prints
``dllm_ops <version>``. ``dllm-ops`` is the same command (a console script of
``pip install``; ``make build`` writes it into the venv).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .model_flags import DTYPES, load_model


class UsageError(Exception):
    """Bad arguments or configuration: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage block) and exit status 2."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def device_name(text: str) -> str:
    """argparse type: cpu, cuda or cuda:N (the devices the kernels run on)."""
    kind, colon, index = text.partition(":")
    if kind == "cpu" and not colon or kind == "cuda" and (not colon or index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: choose cpu, cuda or cuda:N")


def run_cli(body, argv=None, *, prog: str = "") -> int:
    """Run a command-line ``body(argv)`` with the CLIs' error convention: every
    error is one line on stderr, ``<prog>error: <message>`` (``prog`` is
    ``""`` for ``python -m dllm_ops``, ``"dllm_ops.calibrate: "`` for the
    calibration CLI), exit status 2 for a :class:`UsageError` (bad arguments or
    configuration), 1 for anything else (the model, the data, the decode),
    130 on Ctrl+C; ``DLLM_OPS_TRACEBACK=1`` re-raises instead. A message
    that already starts with ``prog`` is not prefixed twice."""
    def say(message, status):
        msg = " ".join(str(message).split())
        if prog and msg.startswith(prog):
            msg = msg[len(prog):]
        print(f"{prog}error: {msg}", file=sys.stderr)
        return status
    try:
        return body(argv)
    except UsageError as e:
        return say(e, 2)
    except KeyboardInterrupt:
        return say("interrupted", 130)
    except Exception as e:  # one line, no traceback: the CLI's contract
        if os.environ.get("DLLM_OPS_TRACEBACK") == "1":
            raise
        return say(str(e) or type(e).__name__, 1)


#: dedicated flags -> the configuration path each sets (argparse dest -> path)
FLAG_PATHS = {
    "cache": "cache.method", "gen_length": "shape.gen_length", "block_length": "shape.block_length",
    "steps": "shape.steps", "unmask": "reveal.unmask", "threshold": "reveal.threshold",
    "factor": "reveal.factor", "alg": "reveal.alg", "temperature": "reveal.temperature",
    "seed": "shape.seed",
}


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__
    p = _Parser(prog="python -m dllm_ops", description="dllm_ops: diffusion-LLM decoding")
    p.add_argument("--version", action="version", version=f"dllm_ops {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    sub.required = True
    g = sub.add_parser("generate", help="decode an answer to a prompt and print it with its stats",
                       description="Decode with dllm_ops.generate; the decode configuration is "
                                   "--config FILE (or the defaults), then the flags and --set on top.")
    g.add_argument("--model", help="checkpoint folder, a shipped model (tiny-llada, tiny-dream) or "
                                   "a Hub id in the local cache (required unless --print-config)")
    g.add_argument("--prompt", action="append",
                   help="prompt text (repeat for a batch); without --prompt and --prompt-file, "
                        "the lines of stdin when it is not a terminal")
    g.add_argument("--prompt-file", metavar="FILE",
                   help="one prompt per line (empty lines skipped; - reads stdin); answers are "
                        "printed one per line in the same order (--json: one object per line)")
    g.add_argument("--batch-size", type=positive_int, default=16, metavar="N",
                   help="prompts from --prompt-file / stdin decoded together (default 16; all "
                        "--prompt values are one batch)")
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
    from .config import CACHE_METHODS, DREAM_ALGS, LLADA_UNMASK, CacheConfig, RevealConfig
    g.add_argument("--cache", default=None, choices=CACHE_METHODS,
                   help=f"cache method (default {CacheConfig.method})")
    if region:
        g.add_argument("--gen-length", type=int, default=None, help="generated tokens (default 128)")
    g.add_argument("--block-length", type=int, default=None, help="block size (default 32)")
    g.add_argument("--steps", type=int, default=None, help="model-call budget (default gen-length)")
    g.add_argument("--unmask", default=None, choices=LLADA_UNMASK,
                   help=f"LLaDA's reveal rule (default {RevealConfig.unmask})")
    g.add_argument("--threshold", type=float, default=None, help="threshold rule's tau (0.9)")
    g.add_argument("--factor", type=float, default=None)
    g.add_argument("--alg", default=None, choices=DREAM_ALGS,
                   help="Dream's algorithm (default entropy)")
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
    g.add_argument("--device", default=None, type=device_name,
                   help="cpu | cuda | cuda:N (default: cuda when available)")
    g.add_argument("--threads", type=positive_int, default=None, help="CPU threads")


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


def _model_config(name: str):
    """The ModelConfig of --model read from its config.json alone (no weights),
    or None when the checkpoint cannot be resolved or read: loading it then
    reports why (exit status 1)."""
    from .models import resolve_checkpoint
    from .models.loader import read_model_config
    try:
        return read_model_config(resolve_checkpoint(name))
    except (OSError, ValueError):   # CheckpointError / ModelConfigError are ValueErrors
        return None


def _check_storage(storage, cache_method: str, mc) -> None:
    """A kvq policy table against what config.json says (the weights'
    fingerprint is checked once the model has loaded)."""
    from .errors import PolicyTableError
    from .quant.policy_table import PolicyTable
    if storage.method != "kvq":
        return
    table = (PolicyTable.from_json(storage.table) if isinstance(storage.table, dict)
             else PolicyTable.load(storage.table))
    shape = {k: getattr(mc, k) for k in ("arch", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                                         "hidden_size", "vocab_size")}
    diff = sorted(k for k in shape if table.fingerprint.get(k) != shape[k])
    if diff:
        raise PolicyTableError(f"table was made for another model ({table.model!r}): "
                               f"{', '.join(diff)} differ")
    for name, want in (("cache", cache_method), ("bits", storage.bits), ("group", storage.group)):
        if getattr(table, name) != want:
            raise PolicyTableError(f"table is for {name}={getattr(table, name)!r}, decoding uses "
                                   f"{name}={want!r}")


def check_before_load(args, config, *, region: bool = True) -> None:
    """What a decode with ``config`` on --model would refuse, checked against
    the checkpoint's config.json before the weights load (a usage error, exit
    status 2): Dream-only sampling options on LLaDA, the reveal rule and the
    block geometry (``region=False``, the server: the region comes with each
    request, so the rule is checked on one block), a kvq policy table's file
    and the model, cache, bits and group it was made for."""
    from .errors import DllmOpsError
    from .policies import make_policy
    from .reveal import build_reveal
    mc = _model_config(args.model)
    if mc is None:
        return
    command = getattr(args, "command", None) or "generate"
    try:
        cache_method = make_policy(config.cache).name
        shape = config.shape
        if not region:
            shape = shape.replace(gen_length=shape.block_length, steps=None, max_blocks=None)
        build_reveal(mc.arch, config.reveal, shape, cache_method, generators=[])
        if region and shape.gen_length >= mc.max_seq_len:
            raise UsageError(f"python -m dllm_ops {command}: shape.gen_length ({shape.gen_length}) "
                             f"leaves no room for a prompt in the model's {mc.max_seq_len} positions")
        _check_storage(config.storage, cache_method, mc)
    except DllmOpsError as e:
        raise UsageError(str(e)) from None


def escape_line(text: str) -> str:
    r"""One answer as one line: ``\`` -> ``\\``, newline -> ``\n``, CR -> ``\r``."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _read_text(path: str, command: str) -> tuple[str, str]:
    """``(text, what)`` of --prompt-file ``path`` (``-``: stdin)."""
    if path == "-":
        return sys.stdin.read(), "stdin"
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    except OSError as e:
        raise UsageError(f"python -m dllm_ops {command}: --prompt-file {path}: "
                         f"{e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"python -m dllm_ops {command}: --prompt-file {path}: not UTF-8 text "
                         f"({e.reason} at byte {e.start})") from None


def read_prompts(args) -> tuple[list[str], bool]:
    """``(prompts, from_lines)``: the --prompt values, or the lines of
    --prompt-file / stdin (``from_lines``: then decoded in batches and printed
    one answer per line)."""
    command = getattr(args, "command", None) or "generate"
    if args.prompt and args.prompt_file:
        raise UsageError(f"python -m dllm_ops {command}: give --prompt or --prompt-file, not both")
    if args.prompt:
        return list(args.prompt), False
    if args.prompt_file:
        text, what = _read_text(args.prompt_file, command)
    elif sys.stdin is not None and not sys.stdin.isatty():
        text, what = sys.stdin.read(), "stdin"
    else:
        raise UsageError(f"python -m dllm_ops {command}: the following arguments are required: "
                         f"--prompt (or --prompt-file FILE, or prompts on stdin)")
    prompts = [line.removesuffix("\r") for line in text.split("\n")]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise UsageError(f"python -m dllm_ops {command}: no prompt in {what} (one prompt per line)")
    return prompts, True


def stats_line(s: dict) -> str:
    """The decode statistics of one batch as the ``-- ...`` line (stderr)."""
    return (f"-- NFE {s['nfe']}, {s['generated_tokens']} tokens in {s['wall_s']:.3f} s "
            f"({s['tokens_per_s']:.1f} tok/s), tokens run {s['tokens_recomputed']} "
            f"({s['n_layers']} layers), cache {s['cache']}, reveal {s['reveal']}")


def cmd_generate(args) -> int:
    config = decode_config(args)   # configuration errors before the model loads
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2, sort_keys=True))
        return 0
    if not args.model:
        raise UsageError("python -m dllm_ops generate: the following arguments are required: --model")
    prompts, from_lines = read_prompts(args)
    check_before_load(args, config)

    import dllm_ops

    model, device, dtype_name = load_model(args)

    def decode(batch):
        if args.chat:
            messages = [[{"role": "user", "content": p}] for p in batch]
            return dllm_ops.generate(model, model.tokenizer, config, messages=messages)
        return dllm_ops.generate(model, model.tokenizer, config, prompt=batch)

    if not from_lines:   # --prompt: one batch, one JSON object or the text as it is
        out = decode(prompts)
        s = dict(out.stats)
        if args.json:
            print(json.dumps(dict(model=args.model, device=device, dtype=dtype_name, prompts=prompts,
                                  text=out.text, tokens=out.sequences, config=config.to_dict(),
                                  stats=s), default=str))
            return 0
        for text in out.text:
            print(text if len(out.text) == 1 else escape_line(text))
        print(stats_line(s), file=sys.stderr)
        return 0
    size = args.batch_size
    n_batches = -(-len(prompts) // size)
    for b in range(n_batches):
        batch = prompts[b * size:(b + 1) * size]
        out = decode(batch)
        s = dict(out.stats)
        for r, (prompt, text, tokens) in enumerate(zip(batch, out.text, out.sequences)):
            if args.json:
                print(json.dumps(dict(index=b * size + r, model=args.model, device=device,
                                      dtype=dtype_name, prompt=prompt, text=text, tokens=tokens,
                                      batch=b, config=config.to_dict(), stats=s), default=str))
            else:
                print(escape_line(text))
        sys.stdout.flush()   # a batch's answers leave before the next batch decodes
        if not args.json:
            where = (f"batch {b + 1}/{n_batches} (prompts {b * size}-{b * size + len(batch) - 1}): "
                     if n_batches > 1 else "")
            print(stats_line(s).replace("-- ", f"-- {where}", 1), file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from .serve.command import serve
    config = decode_config(args)   # configuration errors before the model loads
    check_before_load(args, config, region=False)
    if args.ray:   # each replica loads its own model
        from .serve.replicas import serve_replicas
        return serve_replicas(args, config)
    return serve(args, config)


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


def main(argv=None) -> int:
    """``python -m dllm_ops`` / ``dllm-ops`` (``argv`` without the program name)."""
    return run_cli(_main, argv)
