"""``--chat-template``: a template file, an inline template, or a built-in one by name.

``chatml_tools`` is ChatML (``<|im_start|>role ... <|im_end|>``, as SmolLM2, Qwen2 and
Hermes use) with the tools listed in the system prompt and calls written as Hermes
``<tool_call>`` blocks: with ``--tool-call-parser hermes`` it makes tools work on a ChatML
model whose own template ignores them.
"""

from __future__ import annotations

import os

CHATML_TOOLS = """\
{%- if tools %}
<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}You may call one or more functions to assist with the user query.
You are given these functions within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each function call, return a JSON object with the function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m['role'] == 'system' %}
{%- elif m['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ m['content'] }}
</tool_response><|im_end|>
{% elif m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant
{% if m['content'] %}{{ m['content'] }}
{% endif %}{% for c in m['tool_calls'] %}<tool_call>
{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}
</tool_call>
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

BUILTIN = {"chatml_tools": CHATML_TOOLS}


def load_chat_template(value: str | None) -> str | None:
    """The template text of ``--chat-template``; ValueError when it is none of the three."""
    if value is None:
        return None
    if value in BUILTIN:
        return BUILTIN[value]
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(
        f"chat_template {value!r} is not a file, an inline Jinja template or one of "
        f"{', '.join(sorted(BUILTIN))}."
    )
