"""OpenAI chat messages -> Gemma-3 prompt (no HTTP types): typed messages, the template, tools, images.

The entry point is `PromptBuilder.build_prompt(messages, ...) -> Prompt` (`prompt.py`).
"""

from oai_gemma.chat.messages import ChatInputError, ChatMessage, parse_messages
from oai_gemma.chat.prompt import Prompt, PromptBuilder, PromptTooLong
from oai_gemma.chat.render import IMAGE_TOKEN, OFFICIAL_TEMPLATE_PATH, ImagePart, MessagePath, RenderedChat, render_chat

__all__ = [
    "IMAGE_TOKEN", "OFFICIAL_TEMPLATE_PATH", "ChatInputError", "ChatMessage", "ImagePart", "MessagePath", "Prompt",
    "PromptBuilder", "PromptTooLong", "RenderedChat", "parse_messages", "render_chat",
]
