"""A request's prompt as token ids, the way a vLLM OpenAI server makes it:
what `ucm pd-proxy` matches against its engines' KV events.

`/v1/completions`: a `prompt` of token ids is taken as is; a string (or a
list of one) is encoded with the model's tokenizer and its special tokens
(vLLM's default, `add_special_tokens` true). `/v1/chat/completions`: the
model's chat template (`chat_template` in tokenizer_config.json, or a
`chat_template.jinja` beside it) rendered with `messages` and
`add_generation_prompt` (default true) in a sandboxed Jinja environment, as
transformers renders it, then encoded without special tokens (the template
writes them). Uses the `tokenizers` library and Jinja2 only, no engine.

`tokens(path, body)` is None where the prompt cannot be told: several
prompts in one request, a prompt of embeddings or media, a template that
fails, or no tokenizer for a text prompt. The proxy then picks by load.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from ucm.errors import ConfigError


class PromptTokens:
    """The token ids of requests' prompts; `model_dir` None: token-id
    prompts only."""

    def __init__(self, model_dir: Optional[str] = None) -> None:
        self.tokenizer: Any = None
        self.template: Any = None
        self.specials: dict[str, str] = {}
        if model_dir is None:
            return
        root = Path(model_dir)
        if not (root / "tokenizer.json").is_file():
            raise ConfigError(f"pd-proxy: --tokenizer {model_dir!r} must be a model directory with a "
                              f"tokenizer.json")
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ConfigError(f"pd-proxy: --tokenizer needs the tokenizers library: {exc}") from exc
        self.tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        config = root / "tokenizer_config.json"
        cfg = json.loads(config.read_text()) if config.is_file() else {}
        source = cfg.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if (root / "chat_template.jinja").is_file():
            source = (root / "chat_template.jinja").read_text()
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            tok = cfg.get(name)
            if isinstance(tok, dict):
                tok = tok.get("content")
            if isinstance(tok, str):
                self.specials[name] = tok
        if source:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self.template = env.from_string(source)

    def tokens(self, path: str, body: dict) -> Optional[list[int]]:
        try:
            if path.endswith("/chat/completions"):
                return self._chat(body)
            return self._completion(body.get("prompt"))
        except Exception:  # a prompt this cannot tell: the caller picks by load
            return None

    def _completion(self, prompt: Any) -> Optional[list[int]]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            return list(prompt)
        if isinstance(prompt, str) and self.tokenizer is not None:
            return self.tokenizer.encode(prompt, add_special_tokens=True).ids
        return None

    def _chat(self, body: dict) -> Optional[list[int]]:
        messages = body.get("messages")
        if self.template is None or not isinstance(messages, list) or body.get("chat_template"):
            return None
        text = self.template.render(messages=messages, add_generation_prompt=body.get("add_generation_prompt", True),
                                    tools=body.get("tools"), **self.specials)
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def _raise(message: str) -> None:
    raise ValueError(message)
