"""Every route's service, built once when the engine is ready (not per request)."""

from __future__ import annotations

from dataclasses import dataclass

from ..chat import PromptBuilder
from ..engine.engine import Engine
from ..settings import Settings
from .responses.store import ResponseStore
from .serving import ServingContext
from .serving_chat import ChatService
from .serving_completions import CompletionService
from .responses.serving import ResponsesService
from .serving_tokenize import TokenizeService


@dataclass(frozen=True)
class Services:
    chat: ChatService
    completions: CompletionService
    tokenize: TokenizeService
    responses: ResponsesService

    @classmethod
    def build(cls, engine: Engine, settings: Settings, store: ResponseStore) -> Services:
        max_model_len = settings.model.max_model_len
        prompts = PromptBuilder(
            engine.tokenizer, engine.processor, settings.images, max_model_len, settings.served_model_name
        )
        context = ServingContext(engine, settings.served_model_name, max_model_len, prompts)
        default_max_tokens = settings.engine.default_max_tokens
        return cls(
            ChatService(context, default_max_tokens), CompletionService(context), TokenizeService(context),
            ResponsesService(context, default_max_tokens, store),
        )
