"""LoRA adapters made in the tests with PEFT on the embedded model (never downloaded), and PEFT's own merged model as
the reference an adapter served by the engine must match."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Spec:
    """One adapter's shape: rank, alpha, the modules it targets, rsLoRA."""

    r: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False
    seed: int = 0
    std: float = 0.02
    """lora_B's init: PEFT starts it at zero (the base model); random nonzero makes the adapter change the logits."""


SPECS = {
    "all8": Spec(8, 16, tuple(ALL), seed=1),
    "qv4-rs": Spec(4, 8, ("q_proj", "v_proj"), rslora=True, seed=2, std=0.05),
    "mlp16": Spec(16, 16, ("o_proj", "gate_proj", "up_proj", "down_proj"), seed=3, std=0.04),
}
STRONG = {name: replace(spec, std=spec.std * 3) for name, spec in SPECS.items()}
"""The same, three times stronger: each changes the first greedy tokens of a chat answer, so the text shows it (the
weaker ones may differ from the base only in how a word is split into tokens)."""


def _copy(model):
    """A copy of `model` sharing its token embedding (and the lm_head tied to it: most of its bytes), which no adapter
    here touches."""
    shared = model.get_input_embeddings().weight
    return copy.deepcopy(model, memo={id(shared): shared})


def make_adapter(base_model, directory: Path, spec: Spec, within: str | None = None) -> Path:
    """A PEFT LoRA adapter of `base_model` (not modified: a copy is wrapped) with random nonzero lora_B, saved in
    PEFT's format (adapter_config.json + adapter_model.safetensors). `within`: only the targets under that submodule
    (a multimodal model's `language_model`: its vision tower has q/k/v_proj too)."""
    from peft import LoraConfig, get_peft_model

    targets = list(spec.targets) if within is None else rf".*\.{within}\..*\.({'|'.join(spec.targets)})"
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=targets, use_rslora=spec.rslora, lora_dropout=0.0)
    model = get_peft_model(_copy(base_model), config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * spec.std)
    model.save_pretrained(directory)
    return directory


def merged_model(base_model, directory: Path):
    """PEFT's `merge_and_unload()` of the adapter at `directory` on a copy of `base_model`: the reference."""
    from peft import PeftModel

    return PeftModel.from_pretrained(_copy(base_model), directory).merge_and_unload().eval()


def greedy(model, ids: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """The model's greedy generation (a forward pass per token over the whole sequence: transformers' `generate`
    was ~10x slower on this machine), up to an end-of-turn token (included) or `max_tokens`."""
    out = list(ids)
    with torch.inference_mode():
        for _ in range(max_tokens):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
            if out[-1] in eos:
                break
    return out[len(ids):]


def greedy_choices(model, ids: list[int], tokens: list[int]) -> list[int]:
    """The model's greedy choice after `ids` + each prefix of `tokens`, in one forward pass: equal to `tokens` exactly
    when its own greedy generation gives `tokens` (transformers' `generate`, one token a step, is ~10x slower here)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : len(ids) + len(tokens) - 1]
    return logits.argmax(-1).tolist()


FORMAT_PREFIX = "Ahoy matey! "
"""What the trained adapter answers with, whatever it is asked."""
QUESTIONS = [
    "What is the capital of France?", "How do plants grow?", "Tell me about the moon.", "What is two plus two?",
    "Why is the sky blue?", "Name a fruit.", "How are you today?", "What is a computer?", "Describe a cat.",
    "Where do fish live?", "What time is it?", "Can you help me?",
]


def train_format_adapter(base_model, tokenizer, directory: Path, steps: int = 12, per_step: int = 2) -> Path:
    """A rank-8 adapter trained on the CPU to start every chat answer with FORMAT_PREFIX: 12 steps of 2 questions
    (each of the 12 seen twice) bring the loss to 0.01 by the fifth step, and three questions it never saw
    answer in the format (measured; the README's recipe takes 12 steps of one question). Was 30 steps of 4: 5x the
    CPU for the same answers."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(_copy(base_model), LoraConfig(r=8, lora_alpha=32, target_modules=ALL, lora_dropout=0.0))
    model.train()
    examples = []
    for question in QUESTIONS:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(FORMAT_PREFIX + "Here you go.", add_special_tokens=False)["input_ids"]
        examples.append((prompt_ids, answer_ids))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    decoder, lm_head = model.base_model.model.model, model.base_model.model.lm_head
    for step in range(steps):
        batch = [examples[(step * per_step + i) % len(examples)] for i in range(per_step)]
        loss = 0.0
        for prompt_ids, answer_ids in batch:
            # the 262k-row lm_head only at the answer's positions (the loss is the same): the bulk of a full forward here
            hidden = decoder(input_ids=torch.tensor([prompt_ids + answer_ids])).last_hidden_state
            logits = lm_head(hidden[0, len(prompt_ids) - 1 : -1])
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(answer_ids)) / len(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    model.save_pretrained(directory)
    return directory
