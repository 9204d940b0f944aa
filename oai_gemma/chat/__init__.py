"""OpenAI chat messages -> Gemma-3 prompt text (no HTTP, no torch)."""

from oai_gemma.chat.render import (
    IMAGE_TOKEN,
    OFFICIAL_TEMPLATE_PATH,
    ChatInputError,
    ImagePart,
    RenderedChat,
    render_chat,
)

__all__ = ["IMAGE_TOKEN", "OFFICIAL_TEMPLATE_PATH", "ChatInputError", "ImagePart", "RenderedChat", "render_chat"]
