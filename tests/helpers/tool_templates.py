"""Chat templates with tool calling for four families, written for the tests (no package here ships
the originals, and the tests download nothing).

Each reproduces its family's documented tool-calling format, not the whole published template:

- QWEN25: Qwen2.5-Instruct's function calling (Qwen's docs, "Function Calling", Hermes-style): the
  tools as JSON lines inside ``<tools></tools>`` in the system turn, each call as
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` after the assistant's text,
  consecutive tool results in one user turn as ``<tool_response>`` blocks; ChatML turns.
- QWEN3: Qwen3's model card format: as Qwen2.5, no default system turn, string arguments written
  as they are, and an assistant turn after the last user question carries a ``<think>`` block (an
  empty one when it is the conversation's last turn and has no reasoning).
- LLAMA31: Llama 3.1's prompt format (llama.com, "Llama 3.1 model card and prompt formats", JSON
  based tool calling): ``Environment: ipython`` in the system header, the functions as indented JSON
  in the first user turn, a call answered as ``{"name": ..., "parameters": ...}``, results in the
  ``ipython`` role.
- MISTRAL: Mistral-7B-Instruct-v0.3's function calling (mistral-common's v3 tokenizer format):
  ``[AVAILABLE_TOOLS] [...][/AVAILABLE_TOOLS]`` before the last user turn, ``[TOOL_CALLS] [...]``
  ending with ``</s>``, results as ``[TOOL_RESULTS] {"content": ..., "call_id": ...}[/TOOL_RESULTS]``.

Studio must render every one exactly as transformers' ``apply_chat_template(messages, tools=tools)``
does (tests/core/test_tool_calls.py): the templates are the fixture, transformers the reference.
"""

from __future__ import annotations

_TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                "with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                "\"arguments\": <args-json-object>}\n</tool_call>")
_TOOL_RESULTS_AS_USER = (
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
)

QWEN25 = (
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set turns = messages %}"
    "{%- set system = 'You are a helpful assistant.' if tools else "
    "'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}{{- '\\n\\n" + _TOOLS_INTRO.replace("\n", "\\n") + "' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '" + _TOOLS_OUTRO.replace("\n", "\\n") + "' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for m in turns %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    "{%- for call in m.tool_calls %}{%- set f = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) "
    "+ '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    + _TOOL_RESULTS_AS_USER +
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN3 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '" + _TOOLS_INTRO.replace("\n", "\\n") + "' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '" + _TOOLS_OUTRO.replace("\n", "\\n") + "<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=messages | length - 1, found=false) %}"
    "{%- for m in messages | reverse %}{%- if not ns.found and m.role == 'user' %}"
    "{%- set ns.found = true %}{%- set ns.last_query = messages | length - loop.index %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- set content = m.content if m.content is string else '' %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for call in m.tool_calls or [] %}"
    "{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set f = call.function if call.function is defined else call %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    + _TOOL_RESULTS_AS_USER +
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA31 = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content | trim %}"
    "{%- set turns = messages[1:] %}{%- else %}{%- set system = '' %}{%- set turns = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + strftime_now('%d %b %Y') + '\\n\\n' }}"
    "{{- system + '<|eot_id|>' }}"
    "{%- if tools %}{%- set first = turns[0].content | trim %}{%- set turns = turns[1:] %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a "
    "JSON for a function call with its proper arguments that best answers the given prompt.\\n\\nRespond in the "
    "format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.Do not use "
    "variables.\\n\\n' }}"
    "{%- for t in tools %}{{- (t | tojson(indent=4)) + '\\n\\n' }}{%- endfor %}"
    "{{- first + '<|eot_id|>' }}{%- endif %}"
    "{%- for m in turns %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{%- set f = m.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + f.name + '\", \"parameters\": ' "
    "+ (f.arguments | tojson) + '}<|eot_id|>' }}"
    "{%- elif m.role in ('tool', 'ipython') %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{{- (m.content if m.content is string else m.content | tojson) + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content | trim) + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

MISTRAL = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}"
    "{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST] ' + m.content + '[/INST]' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{{- '[TOOL_CALLS] [' }}"
    "{%- for call in m.tool_calls %}"
    "{{- {'name': call.function.name, 'arguments': call.function.arguments, 'id': call.id} | tojson }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}"
    "{{- ']' + eos_token }}"
    "{%- elif m.role == 'assistant' %}{{- ' ' + m.content + eos_token }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '[TOOL_RESULTS] ' + ({'content': m.content, 'call_id': m.tool_call_id} | tojson) + '[/TOOL_RESULTS]' }}"
    "{%- endif %}{%- endfor %}"
)
