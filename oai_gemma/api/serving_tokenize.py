"""vLLM's `/tokenize` and `/detokenize`: a prompt string or chat messages to token ids, and back.

Chat messages are rendered and encoded exactly as `/v1/chat/completions` does, so `count` equals the
`usage.prompt_tokens` a chat completion would report for the same messages (images included).
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, Struct, UnsetType

from .errors import invalid_request
from .protocol import ChatMessage, encoder
from .serving import OpenAIServing


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


class TokenizeService(OpenAIServing):
    async def tokenize(self, body: bytes) -> bytes:
        request: TokenizeRequest = self.decode(_tokenize_decoder, body, model_required=False)
        if (request.prompt is None) == (request.messages is None):
            raise invalid_request("send exactly one of `prompt` (a string) or `messages` (chat messages)", "prompt")
        if request.messages is not None:  # chat's own prompt: images expanded as for a chat completion
            prompt = await self.build_prompt(
                request.messages, add_generation_prompt=request.add_generation_prompt,
                add_special_tokens=bool(request.add_special_tokens),
            )
            ids = prompt.token_ids
        else:  # a text too long to fit the context whatever it says is a 400 at once, as for chat and completions
            ids = await self.encode(request.prompt, "prompt", request.add_special_tokens is not False)
        strs = self.engine.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else UNSET
        return encoder.encode(TokenizeResponse(len(ids), self.max_model_len, ids, strs))

    def detokenize(self, body: bytes) -> bytes:
        request: DetokenizeRequest = self.decode(_detokenize_decoder, body, model_required=False)
        self.check_token_ids(request.tokens, "tokens", len(self.engine.tokenizer))
        return encoder.encode(DetokenizeResponse(self.engine.tokenizer.decode(request.tokens)))
