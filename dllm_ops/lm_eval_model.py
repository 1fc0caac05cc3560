"""lm-eval-harness (0.4.x) model ``dllm_ops``: generation tasks decoded by
dllm_ops.generate with any cache method; multiple-choice and perplexity tasks
scored by the Monte-Carlo estimate of the masked-diffusion bound
(dllm_ops.likelihood). Under ``accelerate launch`` every rank decodes its
shard (dllm_ops/lm_eval_ranks.py).

    pip install -r requirements.txt   # lm_eval is pinned there; `make build` registers the model
    lm_eval --model dllm_ops \\
            --model_args pretrained=PATH|tiny-llada,cache.method=dual,reveal.unmask=threshold \\
            --tasks ... [--batch_size 16]
    lm_eval --model dllm_ops --model_args pretrained=tiny-llada,mc_num=32,greedy_check=false \\
            --tasks <multiple-choice tasks>

``--model_args``: the model-loading keys ``pretrained`` (a checkpoint folder,
a shipped model name or a Hugging Face Hub id from the local cache),
``revision`` (the Hub id's branch, tag or commit; ``pretrained=org/name@rev``
says the same), ``dtype`` (auto | float32 | bfloat16 | float16;
auto: bf16 on CUDA, fp32 on CPU), ``device``, ``batch_size``, ``threads``,
``max_gen_toks``; every other key is a decode setting, parsed into one
:class:`dllm_ops.config.DecodeConfig` by the parser the command line's
``--set`` uses (:func:`dllm_ops.config.config_from_settings`, through
:func:`dllm_ops.config.config_from_model_args`): a dotted path of the
configuration (``cache.method=d2cache,cache.d2cache.rollout_p=0.2``,
``reuse.method=kv,reuse.rho=0.5``, ``storage.method=kivi,storage.bits=4``) or
a keyword of ``generate`` (``cache=dual,threshold=0.9``,
``dare=kv,dare_opts.rho=0.5``). The configuration is checked when the model
is made; ``self.decode_config`` holds it.

generate_until: requests with the same generation kwargs are decoded in
batches (longest prompts first, left-padded: a row decodes as it would alone).
``max_gen_toks`` sets the generated region (rounded up to a multiple of
``block_length``; ``gen_length`` in model_args overrides it) and the text is cut
to that many tokens, at EOS, and before the first ``until`` string.
``do_sample=True`` with a ``temperature`` samples at that temperature.

loglikelihood (multiple-choice tasks) and loglikelihood_rolling (perplexity):
LLaDA's Monte-Carlo estimate of the masked-diffusion bound on
log p(continuation | context), dllm_ops.likelihood (its docstring says exactly
what is computed, the greedy flag and the rolling windows). model_args:
``mc_num`` (draws per request, default 128), ``mc_batch_size`` (rows per
model call, default 32; copies of several requests share a call; the estimate
does not depend on it), ``seed`` (the decode's ``shape.seed``, which also seeds
each request's draws), ``greedy_check`` (default true: ``is_greedy`` is the
greedy decode's verdict, L model calls per request; false skips it and reports
``is_greedy`` False, for tasks whose metrics never read it, e.g. acc of a
multiple-choice task). A pair is encoded as lm-eval's own models encode it:
trailing spaces of the context move to the continuation, the continuation's
ids are those of context + continuation past the context's; an empty context
becomes the BOS id (EOS without one); a context too long for the model keeps
its last tokens.
"""
from __future__ import annotations

import json
import logging

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

import dllm_ops
from dllm_ops.config import config_from_model_args, region_length
from dllm_ops.errors import LmEvalArgError
from dllm_ops.likelihood import LikelihoodEstimator, rolling_windows
from dllm_ops.lm_eval_ranks import DataParallelRanks

log = logging.getLogger(__name__)

DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
DEFAULT_MAX_GEN_TOKS = 256
DEFAULT_MC_NUM = 128
DEFAULT_MC_BATCH_SIZE = 32


def _flag(name, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise LmEvalArgError(f"{name} must be true or false, got {value!r}")


def _positive_int(name, value) -> int:
    ok = (isinstance(value, int) and not isinstance(value, bool)) or \
        (isinstance(value, str) and value.strip().isdigit())
    if not ok or int(value) <= 0:
        raise LmEvalArgError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


@register_model("dllm_ops")
class DllmOpsLM(DataParallelRanks, LM):
    def __init__(self, pretrained: str, dtype: str = "auto", device: str | None = None,
                 batch_size=1, max_batch_size=None, threads=None, max_gen_toks=DEFAULT_MAX_GEN_TOKS,
                 mc_num=DEFAULT_MC_NUM, mc_batch_size=DEFAULT_MC_BATCH_SIZE, greedy_check=True,
                 revision=None, **decode_settings):
        super().__init__()
        device = self.join_ranks(device)   # under accelerate launch: this rank's device
        if str(dtype) not in DTYPES:
            raise LmEvalArgError(f"dtype {dtype!r}; choose from {sorted(DTYPES)}")
        self.batch_size = _positive_int("batch_size", batch_size)
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        mc_num = _positive_int("mc_num", mc_num)
        mc_batch_size = _positive_int("mc_batch_size", mc_batch_size)
        self.greedy_check = _flag("greedy_check", greedy_check)
        # the decode configuration, and which of its fields model_args set
        self.decode_config, self._given = config_from_model_args(decode_settings, self.max_gen_toks)
        if threads is not None:
            torch.set_num_threads(_positive_int("threads", threads))
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self._device.type == "cuda" and not torch.cuda.is_available():
            # lm_eval's --device defaults to cuda; as its hf model does, run on the CPU.
            log.warning("dllm_ops lm_eval model: device %s asked for but no GPU is visible; using the CPU",
                        device)
            self._device = torch.device("cpu")
        torch_dtype = DTYPES[str(dtype)] or (torch.bfloat16 if self._device.type == "cuda" else torch.float32)
        self.model = dllm_ops.load(pretrained, dtype=torch_dtype, device=self._device,
                                   revision=None if revision is None else str(revision))
        self.tokenizer = self.model.tokenizer
        self.pretrained = str(pretrained)
        self.decode_stats = []   # generate()'s stats per batch, for whoever wants them
        self.estimator = LikelihoodEstimator(self.model, mc_num=mc_num, batch_size=mc_batch_size,
                                             seed=self.decode_config.shape.seed)

    # ---- lm-eval's interface ----------------------------------------------------------
    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", self.pretrained).replace("/", "__")

    def chat_template(self, chat_template=False):
        return getattr(self.tokenizer, "chat_template", None)

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self.rank_note(f"{len(requests)} loglikelihood requests")
        pairs = [self._encode_pair(*req.args) for req in requests]
        lls = self._estimate(pairs, disable_tqdm, "dllm_ops loglikelihood")
        greedy = self.estimator.greedy(pairs) if self.greedy_check else [False] * len(pairs)
        out = []
        for req, ll, g in zip(requests, lls, greedy):
            out.append((ll, bool(g)))
            self.cache_hook.add_partial("loglikelihood", req.args, (ll, bool(g)))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        self.rank_note(f"{len(requests)} loglikelihood_rolling requests")
        prefix = self._prefix_id()
        windows, owner = [], []
        for r, req in enumerate(requests):
            tokens = self._encode(req.args[0])
            if tokens and tokens[0] == prefix:   # a text that starts with BOS: that is its context
                tokens = tokens[1:]
            for w in rolling_windows(tokens, prefix, self.model.config.max_seq_len):
                windows.append(w)
                owner.append(r)
        lls = self._estimate(windows, disable_tqdm, "dllm_ops loglikelihood_rolling")
        out = [0.0] * len(requests)
        for r, ll in zip(owner, lls):
            out[r] += ll
        for req, ll in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, ll)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        self.rank_note(f"{len(requests)} generate_until requests")
        from tqdm.auto import tqdm

        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            key = json.dumps(req.args[1], sort_keys=True, default=str)
            groups.setdefault(key, []).append(i)
        encoded = [self._encode(req.args[0]) for req in requests]
        n_batches = sum(-(-len(g) // self.batch_size) for g in groups.values())
        bar = tqdm(total=len(requests), disable=disable_tqdm or n_batches <= 1, desc="dllm_ops generate")
        for members in groups.values():
            gen_kwargs = dict(requests[members[0]].args[1])
            members = sorted(members, key=lambda i: -len(encoded[i]))
            for b in range(0, len(members), self.batch_size):
                batch = members[b:b + self.batch_size]
                texts = self._generate([encoded[i] for i in batch], gen_kwargs)
                for i, text in zip(batch, texts):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return results

    # ---- decoding -----------------------------------------------------------------------
    def _encode(self, context: str) -> list[int]:
        return self.tokenizer(context, add_special_tokens=False)["input_ids"]

    # ---- likelihoods ------------------------------------------------------------------
    def _prefix_id(self) -> int:
        c = self.model.config
        return c.bos_id if c.bos_id is not None else c.eos_id

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's encoding of a pair (module docstring); the context is cut to fit."""
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        if context:
            whole = self._encode(context + continuation)
            ctx = self._encode(context)
            cont = whole[len(ctx):]
        else:
            ctx, cont = [self._prefix_id()], self._encode(continuation)
        room = self.model.config.max_seq_len - len(cont)
        if room >= 1 and len(ctx) > room:
            log.warning("dllm_ops lm_eval model: a context of %d tokens keeps its last %d "
                        "(the model's context is %d)", len(ctx), room, self.model.config.max_seq_len)
            ctx = ctx[-room:]
        return ctx, cont

    def _estimate(self, pairs, disable_tqdm: bool, desc: str) -> list[float]:
        from tqdm.auto import tqdm

        rows = len(pairs) * self.estimator.mc_num
        bar = tqdm(total=rows, disable=disable_tqdm or rows <= self.estimator.batch_size, desc=desc,
                   unit="draw")
        try:
            return self.estimator.loglikelihood(pairs, progress=bar.update)
        finally:
            bar.close()

    def _generate(self, prompts: list[list[int]], gen_kwargs: dict) -> list[str]:
        until = gen_kwargs.get("until") or []
        if isinstance(until, str):
            until = [until]
        max_gen_toks = _positive_int("max_gen_toks", gen_kwargs.get("max_gen_toks", self.max_gen_toks))
        config = self.decode_config
        if "shape.gen_length" not in self._given:
            shape = config.shape
            config = config.replace(shape=shape.replace(
                gen_length=region_length(max_gen_toks, shape.block_length)))
        if gen_kwargs.get("do_sample") and "temperature" in gen_kwargs \
                and "reveal.temperature" not in self._given:
            config = config.replace(reveal=config.reveal.replace(
                temperature=float(gen_kwargs["temperature"])))
        out = dllm_ops.generate(self.model, prompts, config)
        self.decode_stats.append(out.stats)
        texts = []
        for seq in out.sequences:   # each cut at its first EOS
            text = self.tokenizer.decode(seq[:max_gen_toks], skip_special_tokens=False)
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            texts.append(text)
        return texts
