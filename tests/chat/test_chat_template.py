"""`render_chat` against golden strings and against Google's own Gemma-3 chat template, rendered by Jinja."""

import copy
import hashlib

import pytest
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from oai_gemma.chat import OFFICIAL_TEMPLATE_PATH, ChatInputError, ImagePart, render_chat

BOS = "<bos>"
GEN = "<start_of_turn>model\n"


def user(content):
    return {"role": "user", "content": content}


def assistant(content):
    return {"role": "assistant", "content": content}


def system(content):
    return {"role": "system", "content": content}


def text(t):
    return {"type": "text", "text": t}


def image(url="https://example.com/cat.png", detail=None):
    inner = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": inner}


def prompt(messages, **kwargs):
    return render_chat(messages, **kwargs).prompt


# ---------------------------------------------------------------- the official template, as transformers runs it


def official(messages, add_generation_prompt=True):
    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(OFFICIAL_TEMPLATE_PATH.read_text())
    return template.render(
        messages=_as_hf(messages), add_generation_prompt=add_generation_prompt, bos_token=BOS
    )


def _as_hf(messages):
    """HF processors see an image as {"type": "image"}; the URL is loaded separately."""
    out = copy.deepcopy(messages)
    for m in out:
        if isinstance(m.get("content"), list):
            m["content"] = [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]
    return out


def test_official_template_file_is_googles_text_byte_for_byte():
    data = OFFICIAL_TEMPLATE_PATH.read_bytes()
    assert hashlib.sha256(data).hexdigest() == "7de1c58e208eda46e9c7f86397df37ec49883aeece39fb961e0a6b24088dd3c4"
    assert b"{%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}" in data


def test_official_template_rejects_what_we_repair():
    """Guards the harness: if Jinja accepted everything, the equality test below would prove little."""
    with pytest.raises(TemplateError, match="alternate"):
        official([user("a"), user("b")])


VALID = {
    "single_user": [user("Hello")],
    "user_whitespace_trimmed": [user("  \n Hello there \n\n")],
    "system_string": [system("You are terse."), user("Hi")],
    "system_untrimmed_as_official": [system("  Be kind. \n"), user("Hi")],
    "system_one_text_part": [system([text("Rules ")]), user("Go")],
    "empty_system": [system(""), user("Hi")],
    "multi_turn": [user("a"), assistant("b"), user("c"), assistant(" d "), user("e")],
    "system_multi_turn": [system("S"), user("a"), assistant("b"), user("c")],
    "ends_with_assistant": [user("Say hi"), assistant("Hi")],
    "text_parts_concatenated": [user([text(" one "), text("two\n"), text(" three")])],
    "image_then_text": [user([image(), text("What is this?")])],
    "text_image_text": [user([text("Compare "), image(), text(" and "), image("data:image/png;base64,AAAA")])],
    "images_in_two_turns": [user([image()]), assistant("A cat."), user([text("And this?"), image(detail="low")])],
    "assistant_list_content": [user("q"), assistant([text(" part1"), text("part2 ")]), user("r")],
    "empty_user_string": [user("")],
    "unicode": [system("Réponds en français."), user("Ça va ? 🙂")],
    "special_markup_passes_through": [user("<b>x</b> & {{ y }}")],
}


@pytest.mark.parametrize("messages", VALID.values(), ids=VALID.keys())
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_official_template_byte_for_byte(messages, add_generation_prompt):
    ours = prompt(messages, add_generation_prompt=add_generation_prompt)
    assert ours == official(messages, add_generation_prompt=add_generation_prompt)


# ---------------------------------------------------------------- golden strings


def test_single_user_message():
    assert prompt([user("Hello")]) == "<bos><start_of_turn>user\nHello<end_of_turn>\n" + GEN


def test_system_message_folds_into_first_user_turn_with_blank_line():
    assert prompt([system("Be brief."), user("Hi")]) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n" + GEN
    )


def test_assistant_role_is_rendered_as_model():
    assert prompt([user("Hi"), assistant("Hello!"), user("Bye")]) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n" + GEN
    )


def test_no_generation_prompt_when_not_asked():
    assert prompt([user("Hi")], add_generation_prompt=False) == "<bos><start_of_turn>user\nHi<end_of_turn>\n"


def test_bos_token_is_configurable():
    assert prompt([user("Hi")], bos_token="").startswith("<start_of_turn>user\n")


def test_text_parts_are_trimmed_and_concatenated_without_separator():
    assert prompt([user([text(" a "), text("b\n")])]) == "<bos><start_of_turn>user\nab<end_of_turn>\n" + GEN


def test_image_renders_as_start_of_image_at_its_place_and_is_recorded():
    chat = render_chat([user([text("Look: "), image("https://x/y.png", detail="high"), text(" ok?")])])
    assert chat.prompt == "<bos><start_of_turn>user\nLook:<start_of_image>ok?<end_of_turn>\n" + GEN
    assert chat.images == [ImagePart(url="https://x/y.png", detail="high", param="messages[0].content[1]")]


def test_images_are_listed_in_prompt_order_with_their_params():
    chat = render_chat(
        [system("S"), user([image("u1"), image("u2")]), assistant("ok"), user([text("t"), image("u3")])]
    )
    assert [(i.url, i.param) for i in chat.images] == [
        ("u1", "messages[1].content[0]"),
        ("u2", "messages[1].content[1]"),
        ("u3", "messages[3].content[1]"),
    ]
    assert chat.prompt.count("<start_of_image>") == 3


def test_image_detail_defaults_to_auto():
    assert render_chat([user([image()])]).images[0].detail == "auto"


def test_image_url_string_form_is_accepted():
    chat = render_chat([user([{"type": "image_url", "image_url": "https://x/z.jpg"}])])
    assert chat.images == [ImagePart("https://x/z.jpg", "auto", "messages[0].content[0]")]
    assert "<start_of_image>" in chat.prompt


def test_message_name_is_ignored():
    assert prompt([{"role": "user", "content": "Hi", "name": "bob"}]) == prompt([user("Hi")])


# ---------------------------------------------------------------- where the official template raises


def test_developer_role_is_a_system_message():
    assert prompt([{"role": "developer", "content": "Be brief."}, user("Hi")]) == prompt(
        [system("Be brief."), user("Hi")]
    )


def test_several_system_messages_merge_with_blank_line():
    assert prompt([system("A"), {"role": "developer", "content": "B"}, user("Hi")]) == (
        "<bos><start_of_turn>user\nA\n\nB\n\nHi<end_of_turn>\n" + GEN
    )


def test_late_system_message_joins_the_first_user_turn_prefix():
    assert prompt([system("A"), user("q1"), assistant("a1"), system("B"), user("q2")]) == (
        "<bos><start_of_turn>user\nA\n\nB\n\nq1<end_of_turn>\n"
        "<start_of_turn>model\na1<end_of_turn>\n"
        "<start_of_turn>user\nq2<end_of_turn>\n" + GEN
    )


def test_system_message_after_first_user_turn_is_not_a_system_turn():
    """The official template would emit `<start_of_turn>system` here, a turn Gemma-3 never saw in training."""
    assert prompt([user("q"), system("S")]) == "<bos><start_of_turn>user\nS\n\nq<end_of_turn>\n" + GEN


def test_system_text_parts_are_all_kept():
    assert prompt([system([text("One. "), text("Two.")]), user("Hi")]) == (
        "<bos><start_of_turn>user\nOne. Two.\n\nHi<end_of_turn>\n" + GEN
    )


def test_consecutive_user_messages_merge_with_blank_line():
    assert prompt([user(" a "), user([text("b"), image()])]) == (
        "<bos><start_of_turn>user\na\n\nb<start_of_image><end_of_turn>\n" + GEN
    )


def test_consecutive_assistant_messages_merge_with_blank_line():
    assert prompt([user("q"), assistant("a"), assistant("b")], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nq<end_of_turn>\n<start_of_turn>model\na\n\nb<end_of_turn>\n"
    )


def test_users_separated_only_by_a_system_message_merge():
    assert prompt([user("a"), system("S"), user("b")]) == "<bos><start_of_turn>user\nS\n\na\n\nb<end_of_turn>\n" + GEN


def test_assistant_null_content_is_empty():
    assert prompt([user("q"), assistant(None)], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nq<end_of_turn>\n<start_of_turn>model\n<end_of_turn>\n"
    )


def test_assistant_missing_content_is_empty():
    assert prompt([user("q"), {"role": "assistant"}]) == prompt([user("q"), assistant("")])


def test_empty_turn_is_skipped_when_merging():
    assert prompt([user("q"), assistant(None), assistant("a")]) == prompt([user("q"), assistant("a")])


def test_conversation_starting_with_assistant_is_rendered_as_is():
    assert prompt([assistant("Hello! How can I help?"), user("Hi")]) == (
        "<bos><start_of_turn>model\nHello! How can I help?<end_of_turn>\n"
        "<start_of_turn>user\nHi<end_of_turn>\n" + GEN
    )


def test_system_before_leading_assistant_becomes_its_own_user_turn():
    assert prompt([system(" Be kind. "), assistant("Hi!"), user("Hey")]) == (
        "<bos><start_of_turn>user\nBe kind.<end_of_turn>\n"
        "<start_of_turn>model\nHi!<end_of_turn>\n"
        "<start_of_turn>user\nHey<end_of_turn>\n" + GEN
    )


def test_system_only_conversation_renders_system_text_as_user_turn():
    assert prompt([system("Tell me a joke.")]) == "<bos><start_of_turn>user\nTell me a joke.<end_of_turn>\n" + GEN


def test_several_system_only_messages_render_as_one_user_turn():
    assert prompt([system("A"), system("B")]) == "<bos><start_of_turn>user\nA\n\nB<end_of_turn>\n" + GEN


# ---------------------------------------------------------------- refusals


def refused(messages):
    with pytest.raises(ChatInputError) as info:
        render_chat(messages)
    assert isinstance(info.value, ValueError)
    assert info.value.message == str(info.value)
    return info.value


def test_empty_messages_list_is_refused():
    assert refused([]).param == "messages"


def test_messages_not_a_list_is_refused():
    assert refused({"role": "user", "content": "x"}).param == "messages"


def test_message_not_an_object_is_refused():
    assert refused([user("a"), "hello"]).param == "messages[1]"


def test_user_null_content_is_refused():
    error = refused([user("a"), assistant("b"), user(None)])
    assert (error.param, error.code) == ("messages[2].content", "missing_required_parameter")
    assert error.message == "Missing required parameter: 'messages[2].content'."


def test_user_missing_content_is_refused():
    assert refused([{"role": "user"}]).param == "messages[0].content"


def test_system_null_content_is_refused():
    assert refused([system(None), user("a")]).param == "messages[0].content"


def test_content_of_wrong_type_is_refused():
    assert refused([user(42)]).param == "messages[0]"


def test_function_role_is_refused():
    error = refused([user("q"), {"role": "function", "content": "42", "name": "f"}])
    assert error.param == "messages[1]"
    assert "'tool'" in error.message


def test_assistant_tool_call_without_a_name_is_refused_naming_it():
    call = {"id": "c1", "type": "function", "function": {"arguments": "{}"}}
    error = refused([user("q"), {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert error.param == "messages[1].tool_calls[0].function.name"


def test_tool_message_without_content_is_refused():
    assert refused([user("q"), {"role": "tool", "tool_call_id": "c1"}]).param == "messages[1].content"


def test_tool_results_merge_into_one_user_turn_with_the_next_question():
    rendered = prompt([
        user("q"), {"role": "tool", "tool_call_id": "a", "content": "one"},
        {"role": "tool", "tool_call_id": "b", "content": [text(" two ")]}, user("and now?"),
    ])
    assert rendered == (
        BOS + "<start_of_turn>user\nq\n\n```tool_output\none\n```\n\n```tool_output\ntwo\n```\n\nand now?<end_of_turn>\n" + GEN
    )


def test_assistant_content_comes_before_its_tool_calls():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    rendered = prompt([user("q"), {"role": "assistant", "content": "Let me look.", "tool_calls": [call]}])
    assert '<start_of_turn>model\nLet me look.\n{"name": "f", "parameters": {"x": 1}}<end_of_turn>' in rendered


@pytest.mark.parametrize("role", ["robot", None, ""])
def test_unknown_role_is_refused(role):
    assert refused([user("q"), {"role": role, "content": "x"}]).param == "messages[1]"


def test_unknown_part_type_is_refused():
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    assert refused([user("q"), assistant("a"), user([text("x"), audio])]).param == "messages[2].content[1]"


def test_hf_style_image_part_is_refused():
    assert refused([user([{"type": "image"}])]).param == "messages[0].content[0]"


def test_part_that_is_not_an_object_is_refused():
    assert refused([user(["hello"])]).param == "messages[0].content[0]"


@pytest.mark.parametrize("part", [{"type": "text"}, {"type": "text", "text": None}, {"type": "text", "text": 3}])
def test_text_part_without_string_text_is_refused(part):
    assert refused([user([text("ok"), part])]).param == "messages[0].content[1]"


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url"},
        {"type": "image_url", "image_url": {}},
        {"type": "image_url", "image_url": {"url": ""}},
        {"type": "image_url", "image_url": {"url": None}},
        {"type": "image_url", "image_url": ""},
    ],
)
def test_image_url_part_without_url_is_refused(part):
    assert refused([user([part])]).param == "messages[0].content[0]"


def test_image_detail_outside_auto_low_high_is_refused():
    assert refused([user([image(detail="ultra")])]).param == "messages[0].content[0]"


def test_image_in_system_message_is_refused():
    assert refused([user("q"), system([text("look"), image()])]).param == "messages[1].content[1]"


def test_bad_part_in_system_message_is_refused():
    assert refused([system([{"type": "text"}]), user("q")]).param == "messages[0].content[0]"


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": "<end_of_image>"}'}}


@pytest.mark.parametrize(
    "messages, param",
    [
        ([user("look <start_of_image> here")], "messages[0].content"),
        ([user([text("hi"), text("<image_soft_token>" * 3), image()])], "messages[0].content[1]"),
        ([system("<end_of_image>"), user("q")], "messages[0].content"),
        ([system([text("a"), text("<start_of_image>")]), user("q")], "messages[0].content[1]"),
        ([user("q"), {"role": "tool", "tool_call_id": "c1", "content": "<image_soft_token>"}], "messages[1].content"),
        ([user("q"), {"role": "assistant", "content": None, "tool_calls": [CALL]}], "messages[1].tool_calls"),
    ],
    ids=["user-string", "user-part", "system-string", "system-part", "tool-result", "tool-call-arguments"],
)
def test_text_holding_an_image_token_is_refused_naming_it(messages, param):
    # the tokenizer reads these in any text as the tokens an image part expands to: an image that is not there
    error = refused(messages)
    assert error.param == param and "image token" in error.message and "image_url" in error.message


def test_a_tool_description_holding_an_image_token_is_refused_as_the_tools():
    with pytest.raises(ChatInputError) as info:
        render_chat([user("q")], tool_prompt="f: returns <start_of_image>")
    assert info.value.param == "tools"


def test_text_naming_image_tokens_without_their_brackets_renders_as_sent():
    assert "start_of_image and image_soft_token" in prompt([user("start_of_image and image_soft_token")])
