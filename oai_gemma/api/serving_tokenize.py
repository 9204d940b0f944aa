"""vLLM's `/tokenize` and `/detokenize`: a prompt string or chat messages to token ids, and back.

Chat messages are rendered and encoded exactly as `/v1/chat/completions` does, so `count` equals the
`usage.prompt_tokens` a chat completion would report for the same messages (images included).
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, Struct, UnsetType

from ..chat import ChatInputError, render_chat
from .errors import decode_body, invalid_request, model_not_found
from .protocol import ChatMessage, encoder
from .serving_chat import ChatService


class TokenizeRequest(Struct):
    """vLLM's TokenizeCompletionRequest (`prompt`) and TokenizeChatRequest (`messages`) in one Struct."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages (<bos> is in the template)
    return_token_strs: bool = False


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | UnsetType = UNSET


class DetokenizeRequest(Struct):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(Struct):
    prompt: str


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


def _decode(decoder: msgspec.json.Decoder, body: bytes, chat: ChatService):
    request = decode_body(decoder, body)
    if request.model is not None and request.model != chat.served_name:
        raise model_not_found(request.model, chat.served_name)
    return request


async def tokenize(chat: ChatService, body: bytes) -> bytes:
    request: TokenizeRequest = _decode(_tokenize_decoder, body, chat)
    if (request.prompt is None) == (request.messages is None):
        raise invalid_request("send exactly one of `prompt` (a string) or `messages` (chat messages)", "prompt")
    if request.messages is not None:
        try:
            rendered = render_chat(msgspec.to_builtins(request.messages), add_generation_prompt=request.add_generation_prompt)
        except ChatInputError as exc:
            raise invalid_request(exc.message, exc.param) from None
        if rendered.images:  # chat's own path: its 400 on a text-only model, its expanded ids on a multimodal one
            return _response(chat, (await chat.vision_prompt(rendered)).token_ids, request.return_token_strs)
        text, special, where = rendered.prompt, bool(request.add_special_tokens), "messages"
    else:
        text, special, where = request.prompt, request.add_special_tokens is not False, "prompt"
    # a text too long to fit the context whatever it says is a 400 at once, as for chat and completions
    return _response(chat, await chat.encode_prompt(text, where, special), request.return_token_strs)


def _response(chat: ChatService, ids: list[int], with_strs: bool) -> bytes:
    strs = chat.engine.tokenizer.convert_ids_to_tokens(ids) if with_strs else UNSET
    return encoder.encode(TokenizeResponse(len(ids), chat.max_model_len, ids, strs))


def detokenize(chat: ChatService, body: bytes) -> bytes:
    request: DetokenizeRequest = _decode(_detokenize_decoder, body, chat)
    vocab = len(chat.engine.tokenizer)
    bad = next((i for i, t in enumerate(request.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid_request(
            f"token id {request.tokens[bad]} at tokens[{bad}] is outside the vocabulary (0 to {vocab - 1})",
            "tokens", "invalid_token_id",
        )
    return encoder.encode(DetokenizeResponse(chat.engine.tokenizer.decode(request.tokens)))
