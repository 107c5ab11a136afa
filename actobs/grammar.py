"""
The reply protocol as a grammar: reply_grammar, the EBNF (xgrammar's, which vLLM's structured outputs take) of exactly
the replies the toy expert writes, so a constrained policy samples only their free values; close_reply, the shortest
completion of a reply --max-new-tokens cut under it; GRAMMAR_FLAG, the --grammar flag of the scripts that roll out.
engine.VLLMPolicy decodes under it and replays its masks; docs/training.md#the-rollout-engine. Pure: no torch.
"""
import json
import re

from actobs.terminus import THINK_CLOSE, THINK_OPEN

# The reply as a grammar (xgrammar's EBNF, which vLLM's structured outputs take): exactly the text the toy expert's
# replies are (taskgen._reply: json.dumps with its default separators and key order, one line, ASCII with \u
# escapes), so a constrained policy chooses only the free values: the strings, each duration, task_complete. No free
# whitespace: a random policy cannot fill a reply with blanks. A string's characters are printable ASCII (plain) or
# escapes, and a '<' is never followed by 't' or '/' (write \u003c there): a '</think>' inside a value would cut
# the reply where reply_content splits the think block off (the expert's '<<' and '< file' pass). A duration has at
# most two digits either side of its point (parse_reply caps it at MAX_DURATION anyway). With think, an optional
# <think>...</think> block first, as Qwen3-style models write it and reply_content strips it; its text holds
# no '<', so the block ends only with </think>. Strings are right-recursive rules: xgrammar then computes a token
# mask inside a string in ~30 us on a 2k vocabulary; as one `(a | b | c)*` loop it took 1.6 ms (measured).
# The reply's parts in order: fixed text, or a free value (a rule of _VALUE_EBNF); a command's the same. The grammar's
# reply and command rules are written from them, and so is close_reply's completion of a cut reply.
STRING, NUMBER, BOOL, COMMANDS = "string", "number", "bool", "commands"
_REPLY_PARTS = ('{"analysis": ', STRING, ', "plan": ', STRING, ', "commands": [', COMMANDS,
                '], "task_complete": ', BOOL, "}")
_COMMAND_PARTS = ('{"keystrokes": ', STRING, ', "duration": ', NUMBER, "}")
_COMMAND_SEP = ", "
_THINK_END = THINK_CLOSE + "\n\n"  # a think block's end in the grammar
_VALUE_EBNF = r"""
commands ::= (command (COMMAND_SEP command)*)?
bool ::= "true" | "false"
string ::= "\"" chars "\""
chars ::= "" | plain chars | escape chars | "<" lt
lt ::= "" | "<" lt | safe chars | escape chars
plain ::= [ !#-;=-\[\]-~]
safe ::= [ !#-.0-;=-\[\]-su-~]
escape ::= "\\" (["\\bfnrt] | "u" hex hex hex hex)
hex ::= [0-9a-f]
number ::= ("0" | [1-9] [0-9]?) ("." [0-9] [0-9]?)?
"""


def _ebnf_rule(name, parts):
    return f"{name} ::= " + " ".join(json.dumps(p) if p not in (STRING, NUMBER, BOOL, COMMANDS) else p
                                     for p in parts)


def reply_grammar(think=False):
    """The grammar of a reply (xgrammar's EBNF), with or without the optional <think> block before its JSON."""
    return "\n".join(["root ::= think? reply" if think else "root ::= reply", _ebnf_rule("reply", _REPLY_PARTS),
                      _ebnf_rule("command", _COMMAND_PARTS),
                      f"think ::= {json.dumps(THINK_OPEN)} [^<]* {json.dumps(_THINK_END)}",
                      _VALUE_EBNF.replace("COMMAND_SEP", json.dumps(_COMMAND_SEP)).strip()])


# A reply cut by --max-new-tokens under the grammar is closed by the engine with the shortest text that completes
# it (close_reply), so every reply a constrained policy writes parses: the cut value at its shortest end, every
# part after it at its shortest. Each part's scanner takes (text, pos) and returns the position after the part, or,
# where the text ends inside it, the text that completes it.
_SHORTEST = {STRING: '""', NUMBER: "0", BOOL: "false", COMMANDS: ""}
_NUMBER = re.compile(r"[0-9]*(\.[0-9]*)?")


def _shortest(parts):
    return "".join(_SHORTEST.get(p, p) for p in parts)


def _fixed(part, text, pos):
    if text.startswith(part, pos):
        return pos + len(part)
    if part.startswith(text[pos:]):
        return part[len(text) - pos:]
    raise ValueError(f"not a prefix of a reply the grammar admits: {part!r} expected at {pos} of {text!r}")


def _string(text, pos):
    if pos == len(text):
        return _SHORTEST[STRING]
    i = _fixed('"', text, pos)
    while i < len(text) and text[i] != '"':
        if text[i] != "\\":
            i += 1
        elif i + 1 == len(text):
            return 'n"'  # the shortest escape
        elif text[i + 1] == "u":  # \uXXXX: the cut digits as 0
            if len(text) < i + 6:
                return "0" * (i + 6 - len(text)) + '"'
            i += 6
        else:
            i += 2
    return i + 1 if i < len(text) else '"'


def _number(text, pos):
    end = _NUMBER.match(text, pos).end()
    if end == len(text) and (end == pos or text.endswith(".")):
        return "0"  # no digit yet, or none after the point
    return end


def _bool(text, pos):
    for word in ("true", "false"):
        if text.startswith(word, pos):
            return pos + len(word)
    return _fixed("false" if text.startswith("f", pos) or pos == len(text) else "true", text, pos)


def _commands(text, pos):
    first = True
    while pos < len(text) and text[pos] != "]":
        if not first:
            pos = _fixed(_COMMAND_SEP, text, pos)
            if isinstance(pos, str):
                return pos + _shortest(_COMMAND_PARTS)
        pos, first = _parts(text, pos, _COMMAND_PARTS), False
        if isinstance(pos, str):
            return pos
    return pos


_SCAN = {STRING: _string, NUMBER: _number, BOOL: _bool, COMMANDS: _commands}


def _parts(text, pos, parts):
    """Scan `parts` from pos: -> the position after them, or the completion of the text cut inside them."""
    for k, part in enumerate(parts):
        pos = _SCAN[part](text, pos) if part in _SCAN else _fixed(part, text, pos)
        if isinstance(pos, str):
            return pos + _shortest(parts[k + 1:])
    return pos


def close_reply(text, think=False):
    """The shortest text that makes `text`, a prefix of a reply reply_grammar(think) admits (one cut by
    --max-new-tokens), a whole reply the grammar admits; "" for a whole reply. Raises ValueError for a text that
    is no such prefix."""
    pos = 0
    if think and text.startswith("<"):  # the think block: its text holds no '<' but the one of its end
        pos = _fixed(THINK_OPEN, text, 0)
        if isinstance(pos, str):
            return pos + _THINK_END + _shortest(_REPLY_PARTS)
        end = text.find("<", pos)
        pos = len(text) if end < 0 else _fixed(_THINK_END, text, end)
        if end < 0 or isinstance(pos, str):
            return (_THINK_END if end < 0 else pos) + _shortest(_REPLY_PARTS)
    pos = _parts(text, pos, _REPLY_PARTS)
    if isinstance(pos, str):
        return pos
    if pos != len(text):
        raise ValueError(f"text after a whole reply at {pos} of {text!r}")
    return ""


# --grammar of the scripts that roll out (grpo.py, evaluate.py): whether, and under which grammar, replies are decoded
GRAMMAR_FLAG = dict(nargs="?", const="reply", choices=["reply", "think"], help="decode every reply under the "
                    "protocol's grammar (grammar.reply_grammar; vLLM structured outputs), so only its free values "
                    "are sampled: 'reply' (the bare flag) the JSON reply alone, as the SFT data writes it; 'think' "
                    "an optional <think> block before it (reasoning models)")
