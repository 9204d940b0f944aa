"""The fixed prompt set: requests that make the model write long, since `ignore_eos` is not an OpenAI field."""

PROMPTS: tuple[str, ...] = (
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Write a long story about a dragon who is afraid of fire.",
    "Write a long, detailed essay on the history of the printing press and its effects on Europe.",
    "Explain in great detail how a car engine works, step by step, for a curious teenager.",
    "Write a long story about two friends crossing a desert on camels.",
    "Describe, at length, a walk through a busy market in an old city, with every sound and smell.",
    "Write a long letter from a sailor to his family, describing a year at sea.",
    "Write a long, detailed guide to growing tomatoes in a small garden, from seed to harvest.",
    "Write a long story about a robot that learns to paint.",
    "Explain in depth how the human heart works and what happens during a heartbeat.",
    "Write a long story about a village that wakes up to find the river has disappeared.",
    "Write a long travel diary of a week spent hiking in the mountains.",
    "Write a long, detailed history of the bicycle, from its invention to today.",
    "Write a long story about a detective solving a mystery in a library at night.",
    "Explain at length how bread is made, from wheat in the field to a loaf on the table.",
    "Write a long fairy tale about a fox, a crow and a stolen crown.",
)


def messages_for(index: int) -> list[dict[str, str]]:
    """The chat messages of request `index`: the prompts in turn, the same order on every server."""
    return [{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}]
