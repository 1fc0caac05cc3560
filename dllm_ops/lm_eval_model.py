"""lm-eval-harness (0.4.x) model ``dllm_ops``: generation tasks decoded by
dllm_ops.generate with any cache method.

    pip install .[eval]          # lm_eval; `make build` also registers the model
    lm_eval --model dllm_ops \\
            --model_args pretrained=PATH|tiny-llada,cache.method=dual,reveal.unmask=threshold \\
            --tasks ... [--batch_size 16]

``--model_args``: the model-loading keys ``pretrained`` (a checkpoint folder
or a shipped model name), ``dtype`` (auto | float32 | bfloat16 | float16;
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

loglikelihood / loglikelihood_rolling raise NotImplementedError: a diffusion
LM has no left-to-right likelihood; LLaDA scores continuations with a
Monte-Carlo estimate over random maskings, which this adapter does not
implement. Multiple-choice tasks are therefore not supported.
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

log = logging.getLogger(__name__)

DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
DEFAULT_MAX_GEN_TOKS = 256


def _positive_int(name, value) -> int:
    ok = (isinstance(value, int) and not isinstance(value, bool)) or \
        (isinstance(value, str) and value.strip().isdigit())
    if not ok or int(value) <= 0:
        raise LmEvalArgError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


@register_model("dllm_ops")
class DllmOpsLM(LM):
    def __init__(self, pretrained: str, dtype: str = "auto", device: str | None = None,
                 batch_size=1, max_batch_size=None, threads=None, max_gen_toks=DEFAULT_MAX_GEN_TOKS,
                 **decode_settings):
        super().__init__()
        if str(dtype) not in DTYPES:
            raise LmEvalArgError(f"dtype {dtype!r}; choose from {sorted(DTYPES)}")
        self.batch_size = _positive_int("batch_size", batch_size)
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
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
        self.model = dllm_ops.load(pretrained, dtype=torch_dtype, device=self._device)
        self.tokenizer = self.model.tokenizer
        self.pretrained = str(pretrained)
        self.decode_stats = []   # generate()'s stats per batch, for whoever wants them

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

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(
            "dllm_ops lm_eval model: loglikelihood is not implemented. A diffusion LM has no "
            "left-to-right likelihood (LLaDA estimates it by Monte Carlo over random maskings, "
            "which this adapter does not do); use generation tasks (output_type: generate_until).")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(
            "dllm_ops lm_eval model: loglikelihood_rolling (perplexity) is not implemented: a "
            "diffusion LM has no left-to-right likelihood; use generation tasks.")

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
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
