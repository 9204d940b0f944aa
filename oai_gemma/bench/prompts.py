"""The fixed prompt sets. `short`: requests that make the model write long, since `ignore_eos` is not an OpenAI
field. `shared`: one ~1,000-token system prompt (a support assistant's policies) in every request, then a distinct
short question each: the workload of a cross-request prefix cache (issue 12). `edit`: real functions asked back
with one name changed (bench/edits.py): the output copies the prompt, where speculative decoding pays (issue 26)."""

from .edits import EDITS, edit_messages

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

SYSTEM_PROMPT = """\
You are Juniper, the customer support assistant of Northwind Outfitters, a retailer of outdoor clothing, camping \
gear and bicycles that sells online and through forty stores across the country. You answer customers in writing, \
through the support chat on our website and in our mobile app. Follow the policies below exactly; when a question \
falls outside them, say so plainly and offer to pass the conversation to a human colleague.

Tone and style. Be warm, patient and precise. Address the customer directly and never blame them. Answer the \
question that was asked first, then add what the customer will need next. Write in full sentences, in three or \
four short paragraphs, and explain the reason behind each rule you apply, because customers accept a rule more \
easily when they understand it. Do not use jargon, internal codes or abbreviations. Never invent order details, \
prices, delivery dates or stock levels: when you do not know something, say what the customer can do to find out.

Orders and payment. We accept all major credit and debit cards, PayPal, gift cards and store credit. A card is \
charged when the order ships, not when it is placed, so a pending authorization may appear for up to five working \
days. An order can be changed or cancelled free of charge until it is packed, which usually happens within two \
hours on working days. After that, the customer must wait for the parcel and return it. Gift cards never expire \
and cannot be exchanged for cash. Price matching applies to identical items sold new by a national retailer, \
within fourteen days of purchase, and not to auctions, clearance sales or marketplace sellers.

Shipping. Standard delivery is free on orders over fifty dollars and takes three to five working days. Express \
delivery costs twelve dollars and takes one to two working days when the order is placed before two in the \
afternoon. Bulky items such as bicycles, kayaks and large tents ship by freight and take up to ten working days; \
the carrier calls the customer to book a delivery slot. We ship to every state but not abroad. A parcel marked \
as delivered but not received must be reported within seven days; we then open an investigation with the carrier \
and, if it cannot be found within five working days, send a replacement or a full refund, as the customer prefers.

Returns and exchanges. Unworn clothing and unused gear can be returned within sixty days with the receipt or \
order number, for a full refund to the original payment method. Returns are free by mail with the prepaid label \
from the customer's account, or in any store. Refunds reach the customer within ten working days of our receiving \
the item. Worn or used items can be returned within one year only if they are faulty. Bicycles can be returned \
within thirty days if ridden fewer than fifty miles. Personalized items, opened food and fuel canisters cannot be \
returned for safety and hygiene reasons. Exchanges for another size or color are free and ship as soon as the \
original item is scanned by the carrier.

Warranty and repairs. Every product carries a two-year warranty against defects in materials and workmanship; \
our own brand, Northwind Trail, carries a lifetime warranty on seams, zippers and frames. The warranty does not \
cover normal wear, accidents or misuse. For a claim, the customer sends photos of the fault through the claims \
form; a specialist replies within three working days with a repair, a replacement or a refund. Our stores \
repair zippers, patch tents and service bicycles for a fee; members get their first bicycle service free.

Membership. Northwind Club membership is free. Members earn one point per dollar spent, get five percent back \
as store credit every quarter, and receive early access to seasonal sales. Points expire after two years without \
a purchase. Membership can be cancelled at any time from the account page, and unused store credit stays valid.

Privacy and safety. Never ask for a full card number, a password or a security code, and never repeat one if a \
customer writes it. To look up an order, ask only for the order number and the email address used. If a customer \
describes an injury, a product that overheated or a fault that could cause harm, apologize, tell them to stop \
using the product at once, and pass the conversation to the product safety team.

Escalation. Offer a human colleague when a customer asks for one, when a refund over five hundred dollars is \
involved, when a complaint concerns staff behavior, or when you cannot resolve the request within these policies. \
Human support answers from eight in the morning to eight in the evening, seven days a week.

Example. Customer: My tent pole snapped on the second night out. Can I get a new one? Juniper: I am sorry your \
trip was interrupted. A pole that snaps under normal use is a defect, so it is covered by the warranty. Please send \
a photo of the broken pole and your order number through the claims form, and a specialist will reply within three \
working days with a replacement pole or a new tent."""
"""1,004 tokens by Gemma-3's tokenizer (5,035 characters); with the chat template every request's prompt shares
its first 1,011 tokens, 63 whole 16-token blocks of the prefix cache, and is 1,025-1,038 tokens in all."""

QUESTIONS: tuple[str, ...] = (
    "Can I still change the delivery address on the order I placed this morning?",
    "Why does my bank show a charge for an order that has not shipped yet?",
    "How long does express delivery take if I order at three in the afternoon?",
    "My parcel says delivered but it is not at my door. What happens now?",
    "Do you ship to Canada or anywhere outside the country?",
    "I wore a rain jacket twice and the seam leaks. Can I return it?",
    "What is your policy on returning a bicycle I rode last weekend?",
    "Is it possible to exchange hiking boots for a bigger size without paying shipping again?",
    "When will my refund arrive after I drop a return at a store?",
    "Could you explain the difference between the standard and the lifetime warranty?",
    "The zipper on my Northwind Trail backpack broke after three years. Is that covered?",
    "Are gas canisters returnable if I bought too many?",
    "How does the Northwind Club store credit work?",
    "Will my points disappear if I do not buy anything this year?",
    "A store near me sells the same sleeping bag for less. Will you match the price?",
    "Does price matching apply to a clearance sale at another shop?",
    "My kayak is shipping by freight. How will I know when it arrives?",
    "Gift cards from my birthday: can I turn them into cash?",
    "Do gift cards ever expire?",
    "What should I do if my headlamp got very hot in my pocket?",
    "Should I send you my card number so you can refund me faster?",
    "Which details do you need to find my order?",
    "Can I cancel an order that was packed an hour ago?",
    "How much does express shipping cost on a small order?",
    "Is standard shipping free on a forty-dollar order?",
    "My jacket arrived in the wrong color. How do I exchange it?",
    "Where do I find the prepaid return label?",
    "Can personalized water bottles be returned?",
    "Do you repair tents in your stores, and how much does it cost?",
    "Is the first bicycle service really free for members?",
    "How do I cancel my Northwind Club membership, and what happens to my credit?",
    "Why was my card charged twice for one order?",
    "Can I pay with PayPal and a gift card together?",
    "What counts as normal wear under your warranty?",
    "How long does a warranty claim take to be answered?",
    "Tell me what photos I need to send for a warranty claim on boots.",
    "Could a human agent call me about a six-hundred-dollar refund?",
    "At what hours can I talk to a person instead of the assistant?",
    "Help me understand why opened food cannot be returned.",
    "I lost my receipt. Can I still return an unworn fleece?",
    "If I return a gift, who gets the refund?",
    "Explain how early access to seasonal sales works for members.",
    "Please tell me whether a tent bought on sale can be returned.",
    "Does the sixty-day return window start at purchase or at delivery?",
    "Are marketplace sellers covered by your price matching?",
    "Suppose my bike is damaged on arrival; what do I do?",
    "How long do I have to report a missing parcel?",
    "Is there a fee to exchange a sleeping pad for another model?",
    "One of your staff was rude to me in a store. Who do I complain to?",
    "My stove leaked fuel and singed the table. What should I do?",
    "Would you send a replacement or a refund if the carrier loses my order?",
    "Can I order online and return in a store?",
    "Under what conditions can I return a used item?",
    "Bulky items: why do they take longer to deliver?",
    "May I change the size on an order that has not been packed?",
    "Quarterly store credit: when exactly is it added to my account?",
    "Explain why you need my email address to look up an order.",
    "Kids' ski jacket: can it be exchanged after a season of use?",
    "Your app shows a pending payment that vanished. Was I charged?",
    "Zippers on my tent keep jamming after a month. Is that a defect?",
    "Lifetime warranty on frames: does it cover a crash?",
    "Every time I log in, the points balance is different. Why?",
    "Freight delivery slot: can I reschedule it?",
    "Nothing in my order has shipped after a week. What is going on?",
)


JSON_SUBJECTS: tuple[str, ...] = (
    "a lighthouse keeper", "a mountain bicycle", "a small bakery", "a river ferry", "a public library",
    "a chess club", "a vegetable garden", "a night train", "a fishing village", "a museum of clocks",
    "a desert expedition", "a music school", "a city park", "a space probe", "a farmers' market", "a ski resort",
)
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "category": {"type": "string"}, "founded_year": {"type": "integer"},
        "location": {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                     "required": ["city", "country"]},
        "features": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 5},
        "rating": {"type": "number"}, "open_all_year": {"type": "boolean"}, "summary": {"type": "string"},
    },
    "required": ["name", "category", "founded_year", "location", "features", "rating", "open_all_year", "summary"],
}
"""The `json` set's schema (sent as `response_format` json_schema): many keys, a nested object, an array."""


def response_format_for(prompts: str) -> dict | None:
    """The `json` set's structured output; None for the others."""
    if prompts != "json":
        return None
    return {"type": "json_schema", "json_schema": {"name": "record", "schema": JSON_SCHEMA, "strict": True}}


def messages_for(index: int, prompts: str = "short") -> list[dict[str, str]]:
    """The chat messages of request `index` in a prompt set, the same on every server. `shared`: the one system
    prompt, then question `index` (cycling) led by its request number, so that no two requests share more than the
    system prompt and a few tokens (a prefix cache hits whole 16-token blocks)."""
    if prompts == "edit":
        return edit_messages(index)
    if prompts == "json":
        subject = JSON_SUBJECTS[index % len(JSON_SUBJECTS)]
        return [{"role": "user", "content": f"Describe {subject} as a JSON record, inventing plausible details."}]
    if prompts == "shared":
        question = QUESTIONS[index % len(QUESTIONS)]
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"Ticket {index}: {question}"}]
    return [{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}]


PROMPT_SETS = {
    "short": f"{len(PROMPTS)} fixed user prompts that ask for long texts",
    "shared": f"one ~1,000-token system prompt shared by every request, then one of {len(QUESTIONS)} short "
              "questions, led by the request's number",
    "json": f"{len(JSON_SUBJECTS)} requests for a JSON record of a subject, under one JSON schema of eight keys "
            "(`response_format` json_schema)",
    "edit": f"{len(EDITS)} real functions (this project's own) asked back with one name changed: the answer copies "
            "the prompt (with --prediction, the original function is sent as Predicted Outputs)",
    "image": "one 896x896 image and a short question: TTFT, the vision tower's time, and a text stream's ITL during "
             "the image's encode against alone (bench/image.py; no concurrency sweep)",
}
"""The `--prompts` choices and how the report describes them."""
