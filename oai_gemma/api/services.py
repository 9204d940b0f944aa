"""Every route's service, built once when the engine is ready (not per request)."""

from __future__ import annotations

from dataclasses import dataclass

from ..chat import PromptBuilder
from ..engine.engine import Engine
from ..settings import Settings
from .serving import ServingContext
from .serving_chat import ChatService
from .serving_completions import CompletionService
from .serving_tokenize import TokenizeService


@dataclass(frozen=True)
class Services:
    chat: ChatService
    completions: CompletionService
    tokenize: TokenizeService

    @classmethod
    def build(cls, engine: Engine, settings: Settings) -> Services:
        max_model_len = settings.model.max_model_len
        prompts = PromptBuilder(
            engine.tokenizer, engine.processor, settings.images, max_model_len, settings.served_model_name
        )
        context = ServingContext(engine, settings.served_model_name, max_model_len, prompts)
        return cls(
            ChatService(context, settings.engine.default_max_tokens), CompletionService(context), TokenizeService(context)
        )
