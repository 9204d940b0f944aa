"""Messages -> `Prompt`: the one place a conversation becomes what the engine prefills.

    messages (typed, `messages.py`) --render--> text with <start_of_image> markers + ImageParts
        text only:   tokenize (off the event loop when long)            -> Prompt(token_ids)
        with images: fetch + decode (`images.py`), the model's processor (`vision.py`)
                                                                        -> Prompt(token_ids, pixel_values, cache_keys)

A `PromptBuilder` is made once per server (it holds the tokenizer, the processor, the image policy and its HTTP
client); `build_prompt` is called per request. Every refusal is a `ChatInputError` naming the field; a prompt too
long to fit the context whatever it says is a `PromptTooLong`, found before megabytes are tokenized.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ..cpu import in_a_turn
from ..settings import ImageSettings
from .images import image_client, load_images
from .messages import ChatInputError, ChatMessage
from .render import ImagePart, MessagePath, RenderedChat, render_chat
from .vision import expand_images

LONG_PROMPT_CHARS = 20_000
"""A text longer than this is tokenized off the event loop."""


@dataclass(frozen=True)
class Prompt:
    """What the engine prefills for one request: the token ids and, for images, their pixels and cache keys."""

    token_ids: list[int]
    pixel_values: Any = None
    """[crops, 3, 896, 896] tensor of the prompt's images in order, or None (a text prompt)."""
    cache_keys: tuple[int, ...] = ()
    """One content hash per crop: the prefix cache tells two images apart by it, not by their token ids."""


class PromptTooLong(ChatInputError):
    """The prompt cannot fit the context window: `detail` says why, `param` names the field holding it."""

    def __init__(self, detail: str, param: str):
        super().__init__(detail, param, "context_length_exceeded")
        self.detail = detail


class PromptBuilder:
    """Builds prompts for one model: made once at start-up, shared by every route."""

    def __init__(self, tokenizer, processor, images: ImageSettings, max_model_len: int, model_name: str):
        """`processor`: the model's multimodal processor, or None for a text-only model."""
        self.tokenizer = tokenizer
        self.processor = processor
        self.images = images
        self.model_name = model_name
        self.max_prompt_chars = max_model_len * longest_token_chars(tokenizer)
        self._image_client = None

    async def build_prompt(
        self, messages: list[ChatMessage], *, tool_prompt: str | None = None, add_generation_prompt: bool = True,
        add_special_tokens: bool = False, paths: list[MessagePath] | None = None, field: str = "messages",
    ) -> Prompt:
        """The prompt of a conversation (`tool_prompt`: the tools' instruction, which opens the first user turn).
        Errors name the request's own fields: `paths` where each message sits (chat's `messages[i]` by default),
        `field` the whole conversation."""
        rendered = render_chat(messages, tool_prompt=tool_prompt, add_generation_prompt=add_generation_prompt, paths=paths)
        if rendered.images:
            return await self._vision_prompt(rendered)
        return Prompt(await self.encode(rendered.prompt, field, add_special_tokens))

    async def encode(self, text: str, where: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` (`where`: the field that holds it); a long one (a book) is tokenized off the event
        loop, and one too long to fit whatever it says is refused at once, not after tokenizing megabytes."""
        if len(text) > self.max_prompt_chars:
            raise PromptTooLong(
                f"`{where}` is {len(text)} characters long; the most this server takes is {self.max_prompt_chars}", where
            )

        def run() -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

        return await asyncio.to_thread(run) if len(text) > LONG_PROMPT_CHARS else run()

    async def _vision_prompt(self, rendered: RenderedChat) -> Prompt:
        """Fetch and decode the images (concurrently, off the event loop), then run the model's processor."""
        if self.processor is None:
            raise ChatInputError(
                f"the model `{self.model_name}` is text-only and cannot read images; "
                "serve a multimodal Gemma-3 model (google/gemma-3-4b-it, -12b-it or -27b-it) to send images",
                rendered.images[0].param, "image_not_supported",
            )
        if self._image_client is None:
            self._image_client = image_client(self.images)
        try:
            images = await load_images(rendered.images, self.images, self._image_client)
        except ChatInputError as exc:
            raise ChatInputError(exc.message, exc.param, "invalid_image") from None
        scans = [self._pan_and_scan(part) for part in rendered.images]
        vision = await asyncio.to_thread(in_a_turn, expand_images, self.processor, rendered.prompt, images, scans)
        return Prompt(vision.token_ids, vision.pixel_values, tuple(vision.crop_keys))

    def _pan_and_scan(self, part: ImagePart) -> bool:
        return part.detail == "high" or (part.detail == "auto" and self.images.pan_and_scan)


def longest_token_chars(tokenizer) -> int:
    """No token stands for more characters than its longest vocabulary piece (Gemma's normalizer only maps " " to
    "▁"), so a prompt longer than `max_model_len` times this cannot fit, whatever it says."""
    return max(len(piece) for piece in tokenizer.get_vocab())
