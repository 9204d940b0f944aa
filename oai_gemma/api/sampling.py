"""The request -> engine mapping every wire format shares (through `plan.py`): the completion budget within the
context window, the sampling parameters (all three wire requests name them alike), the number of choices."""

from __future__ import annotations

from ..engine.types import SamplingParams, completion_room
from .errors import context_length_exceeded, invalid_request, over_limit, shown
from .protocol import SamplingFields


def completion_budget(prompt_len: int, asked: int | None, default: int, max_model_len: int, where: str) -> int:
    """The completion's max_tokens: `asked`, else `default` cut to the room left; a 400
    `context_length_exceeded` (naming `where`, the request field that holds the prompt) when it cannot fit.

    The rule itself is the engine's `completion_room`, which the engine's own checks read too."""
    room = completion_room(max_model_len, prompt_len)
    if room < 1 or (asked is not None and asked > room):
        wanted = prompt_len + (asked or 1)
        raise context_length_exceeded(
            max_model_len, f"you requested {wanted} tokens ({prompt_len} in the {where}, {asked or 1} in the completion)", where
        )
    return min(default, room) if asked is None else asked


def sampling_params(
    request: SamplingFields, max_tokens: int, logprobs: int | None, vocab_limit: int, prompt_logprobs: int | None = None
) -> SamplingParams:
    """SamplingParams from a request's sampling fields (`max_tokens`: the budget, set or defaulted)."""
    if request.min_tokens and request.min_tokens > max_tokens:
        raise over_limit("min_tokens", "max", max_tokens, request.min_tokens, " (the completion's `max_tokens`)")
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=min(max(request.top_k or 0, 0), vocab_limit),  # beyond the vocabulary means off (and fits the sampler's int64)
        seed=request.seed,
        stop=stop,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=request.repetition_penalty or 1.0,
        min_p=request.min_p or 0.0,
        logit_bias=logit_bias(request.logit_bias, vocab_limit),
        min_tokens=request.min_tokens or 0,
        ignore_eos=bool(request.ignore_eos),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def logit_bias(bias: dict[str, float] | None, vocab_limit: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}`; the ids must be in the vocabulary."""
    pairs = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) < 10) or int(key) >= vocab_limit:  # "²", 5000 digits
            raise invalid_request(f"logit_bias key {shown(key)!r} is not a token id of this model", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def choice_count(n: int | None, num_slots: int) -> int:
    """The request's `n`: its choices run side by side, so at most one batch of them."""
    if (n or 1) > num_slots:
        raise over_limit("n", "max", num_slots, n, " (`engine.max_num_seqs`: a request's choices run in one batch)")
    return n or 1
