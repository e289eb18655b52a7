"""Chat prompts as users write them: lists of messages rendered by the tokenizer's chat template
(`specjax.chat_prompt_ids`), one conversation or a batch of them, and the errors for bad ones."""

import pytest
from tiny import tiny_model, tiny_tokenizer

import specjax
from specjax import planner

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan? 日本の首都は？"},
    ],
    [{"role": "system", "content": "  spaces\n\tand tabs  "}, {"role": "user", "content": "café ☕ 🚀"}],
]


@pytest.fixture(scope="module")
def chat_model(smollm2):
    """A tiny random model over SmolLM2's vocabulary, with its tokenizer and chat template."""
    tokenizer = smollm2.tokenizer
    base = tiny_model(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_layers=1)
    return specjax.Model(base.config, base.params, tokenizer, name="tiny-smollm2-vocab")


def template_ids(tokenizer, messages) -> list[int]:
    """transformers' own rendering and tokenization of a conversation."""
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_chat_prompt_ids_are_apply_chat_templates(smollm2, index):
    tokenizer, messages = smollm2.tokenizer, CONVERSATIONS[index]
    ids = specjax.chat_prompt_ids(tokenizer, messages)
    assert ids == template_ids(tokenizer, messages)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")  # the assistant's turn is open


def test_a_str_is_one_user_message(chat_model):
    """With chat=True a str prompt is the conversation of one user message, as before."""
    messages = [{"role": "user", "content": "Hello!"}]
    assert planner.tokenize(chat_model, "Hello!", chat=True) == [template_ids(chat_model.tokenizer, messages)]
    assert planner.tokenize(chat_model, "Hello!", chat=True) == planner.tokenize(
        chat_model, messages, chat=True
    )


def test_generate_takes_a_conversation_and_a_batch_of_them(chat_model):
    ids = [specjax.chat_prompt_ids(chat_model.tokenizer, m) for m in CONVERSATIONS]
    by_ids = specjax.generate(chat_model, ids, max_new_tokens=4)

    batch = specjax.generate(chat_model, CONVERSATIONS, max_new_tokens=4, chat=True)
    assert batch.prompt_tokens == ids
    assert batch.tokens == by_ids.tokens

    one = specjax.generate(chat_model, CONVERSATIONS[1], max_new_tokens=4, chat=True)
    assert one.prompt_tokens == [ids[1]] and one.tokens == [by_ids.tokens[1]]

    # strs, conversations and token ids mix in one batch
    mixed = specjax.generate(chat_model, ["Hello!", CONVERSATIONS[1], ids[2]], max_new_tokens=4, chat=True)
    assert mixed.prompt_tokens == ids and mixed.tokens == by_ids.tokens


MESSAGE = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "prompts, message",
    [
        ([{"role": "user"}], r"""prompts\[0\] must have a "role" and a "content", got \{'role': 'user'\}"""),
        ([[MESSAGE], [{"content": "x"}]], r'prompts\[1\]\[0\] must have a "role" and a "content"'),
        (
            [MESSAGE, "oops"],
            r"prompts\[1\] must be a message \{\"role\": str, \"content\": str\}, got str 'oops'",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            r'prompts\[0\]\["content"\] must be a str \(the message\'s text\), got list',
        ),
        ([[MESSAGE, {"role": None, "content": "x"}]], r'prompts\[0\]\[1\]\["role"\] must be a non-empty str'),
        (
            [[MESSAGE], [1.5]],
            r"prompts\[1\] must be a str, a list of int token ids or, with chat=True, a list",
        ),
        ([[MESSAGE], []], r"prompts\[1\] is empty"),
    ],
)
def test_bad_messages(chat_model, prompts, message):
    with pytest.raises(ValueError, match=message):
        specjax.generate(chat_model, prompts, max_new_tokens=2, chat=True)


def test_messages_need_chat_a_tokenizer_and_a_template(chat_model):
    with pytest.raises(ValueError, match=r"prompts is a list of messages: pass chat=True"):
        specjax.generate(chat_model, [MESSAGE], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompts\[1\] is a list of messages: pass chat=True"):
        specjax.generate(chat_model, ["hi", [MESSAGE]], max_new_tokens=2)
    bare = tiny_model()
    with pytest.raises(ValueError, match=r"prompts is a list of messages but the model has no tokenizer"):
        specjax.generate(bare, [MESSAGE], max_new_tokens=2, chat=True)
    no_template = specjax.Model(bare.config, bare.params, tiny_tokenizer(), name="tiny-no-template")
    for prompts in ("hi", [MESSAGE], [[MESSAGE]]):
        with pytest.raises(
            ValueError, match=r"chat=True but the tokenizer of model 'tiny-no-template' has no chat"
        ):
            specjax.generate(no_template, prompts, max_new_tokens=2, chat=True)
    with pytest.raises(ValueError, match=r"messages: the tokenizer has no chat template"):
        specjax.chat_prompt_ids(no_template.tokenizer, [MESSAGE])


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], r"messages must be a non-empty list of messages"),
        ("hi", r"messages must be a non-empty list of messages .*, got 'hi'"),
        ([MESSAGE, ("user", "hi")], r"messages\[1\] must be a message .*, got tuple"),
        ([{"role": "", "content": "x"}], r'messages\[0\]\["role"\] must be a non-empty str .*, got \'\''),
        (
            [{"role": "user", "content": None}],
            r'messages\[0\]\["content"\] must be a str .*, got NoneType None',
        ),
    ],
)
def test_chat_prompt_ids_checks_its_messages(smollm2, messages, message):
    with pytest.raises(ValueError, match=message):
        specjax.chat_prompt_ids(smollm2.tokenizer, messages)
