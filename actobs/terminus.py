"""
The Terminus-2 protocol as text, the one home of every string an agent and its harness exchange: the system
prompt template, the observation headers, the truncation notice, the parse-error / warnings / completion-check
messages, the reply parser, and the recogniser that splits an observation into the harness's wrapper text and
its payload (derived from the same templates, so the two cannot drift apart); and the readers of what tools print
in the terminal that the harness acts on (a verifier's pytest that ran no test, a command that wanted the network).

The wording of the observation messages is Terminus-2's, as it appears in Nemotron-Terminal-Corpus rows
(tests/fixtures/nemotron_terminal_sample.json); the default system prompt is ours (pass a corpus's own prompt
with load_template). Pure: no Docker, no torch. envs.py runs the protocol in sandboxes, taskgen.py's expert
speaks it, probes.py splits observations with it.

    reply, error, warnings = parse_reply(text)      # Reply(analysis, plan, commands [(keys, duration)], task_complete)
    obs = OUTPUT_HEADER + truncate_output(diff)      # what the agent sees after its commands ran
    wrapper_spans(obs)                               # [(start, end)] of harness text; None if not Terminus-2's
"""
import dataclasses
import json
import re
from pathlib import Path

import numpy as np

from actobs.labels import OBS, message_labels

MAX_OBS_BYTES = 10_000  # observations keep head and tail within this size
MAX_DURATION = 60.0  # longest wait one command may ask for
DEFAULT_DURATION = 1.0  # a command's wait when its reply gives none

# Observation text. A template's {fields} are filled by the harness: the terminal's output, the parser's
# error and warnings; everything else in it is fixed wrapper text.
OUTPUT_HEADER = "New Terminal Output:\n"  # + the new output since the last read (a pane diff)
SCREEN_HEADER = "Current Terminal Screen:\n"  # + the visible screen, when no diff can be found
TRUNCATION = "\n[... output limited to {limit} bytes; {omitted} interior bytes omitted ...]\n"
WARNING_LIST = "\nWARNINGS: - {warnings}"  # the warnings joined by WARNING_SEP
WARNING_SEP = "\n- "
PARSE_ERRORS = ("Previous response had parsing errors:\nERROR: {error}{warnings}\n\n"
                "Please fix these issues and provide a proper JSON response.")
WARNINGS = "Previous response had warnings:{warnings}\n\n{observation}"
COMPLETION_CHECK = ("Current terminal state:\n{observation}\n\nAre you sure you want to mark the task as complete? "
                    "This will trigger your solution to be graded and you won't be able to make any further "
                    'corrections. If so, include "task_complete": true in your JSON response again.')
# aider's second try (evaluate.py --second-try; not Terminus-2's): the verifier's output once, then a new terminal.
SECOND_TRY = ("The tests failed. Their output:\n{output}\n\nFix the problem and mark the task complete again "
              "when it is done. The terminal was restarted:\n{observation}")

DEFAULT_PROMPT = """\
You are an agent working in a Linux shell. You get a task and the terminal's state, and you answer with \
keystrokes to type, one batch per reply, until the task is done.

Reply with a single JSON object of this form:

{
  "analysis": "What the terminal shows, what is done, what is left.",
  "plan": "What the next keystrokes do and why.",
  "commands": [
    {"keystrokes": "ls -la\\n", "duration": 0.1},
    {"keystrokes": "grep -rn error /var/log/app\\n", "duration": 1.0}
  ],
  "task_complete": false
}

Fields:
- "analysis" (string, required) and "plan" (string, required).
- "commands" (array, required, may be empty to just wait): each item has "keystrokes" (string, required),
  typed verbatim into the terminal, and "duration" (number of seconds to wait before the next command,
  1.0 if absent, at most 60).
- "task_complete" (boolean, optional, false if absent): true when you believe the task is solved; you will be
  asked to confirm once.

Keystrokes are sent exactly as written: end a command with "\\n" to run it. Control keys are written as
tmux key names on their own: "C-c" interrupts, "C-d" sends end-of-file. Use short durations for quick
commands (0.1 for ls, cat, cd) and longer ones for builds or downloads; to wait more, send
{"keystrokes": "", "duration": 10.0}. Text outside the JSON object is ignored with a warning.

Task:
{instruction}

Current terminal state:
{terminal_state}"""


def load_template(path=None):
    """The system prompt template; a user's own corpus prompt keeps RL and evaluation on the SFT format."""
    if path is None:
        return DEFAULT_PROMPT
    text = Path(path).read_text()
    for field in ("{instruction}", "{terminal_state}"):
        if field not in text:
            raise ValueError(f"{path}: prompt template lacks the {field} placeholder")
    return text


def fill_prompt(template, instruction, terminal_state):
    # str.replace, not str.format: templates hold JSON examples full of braces.
    return template.replace("{instruction}", instruction.strip()).replace("{terminal_state}", terminal_state)


# ----------------------------------------------------------------------------------------------------------
# Terminal output

def decode(raw):
    """Terminal bytes -> str; bytes that are not UTF-8 become U+FFFD instead of raising."""
    return raw.decode("utf-8", errors="replace")


def truncate_output(text, limit=MAX_OBS_BYTES):
    """Keep the first and last limit/2 bytes with the TRUNCATION notice between, cut on UTF-8 character
    boundaries (a character split by a cut is dropped and counted as omitted)."""
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    half = limit // 2
    head, tail = raw[:half].decode("utf-8", errors="ignore"), raw[-half:].decode("utf-8", errors="ignore")
    omitted = len(raw) - len(head.encode()) - len(tail.encode())
    return head + TRUNCATION.format(limit=limit, omitted=omitted) + tail


def pane_diff(lines, start, anchor):
    """New output since the last read: from the line that was last (the prompt the keys were typed at) to the
    end. Returns None when that line is gone (cleared screen, history overflow), i.e. no diff can be found."""
    if start >= len(lines) or not lines[start].startswith(anchor):
        return None
    new = [ln.rstrip() for ln in lines[start:]]
    while new and not new[-1]:
        new.pop()
    # The first read after the initial screen starts at the top; later ones start after a line break.
    return ("\n" if start > 0 else "") + "\n".join(new)


def visible_screen(lines, rows):
    screen = [ln.rstrip() for ln in lines[-rows:]]
    while screen and not screen[-1]:
        screen.pop()
    return "\n".join(screen) + "\n"


# What pytest prints once it has run tests, under any verbosity (-q drops the banner, -qq the summary line):
# the summary line ("== 1 failed, 2 passed in 0.12s ==", "1 error in 0.08s" for a module that does not import),
# the progress line ("F.  [100%]") or a FAILURES / ERRORS section.
PYTEST_RAN = re.compile(rb"^=* *(?:\d+ \w+, )*\d+ (?:failed|passed|errors?|xfailed|xpassed|skipped)\b.* in [\d.]+s\b"
                        rb"|^[.FEsxXR]+\s+\[\s*\d+%\]\s*$|^=+ (?:FAILURES|ERRORS) =+\s*$", re.M)
# pytest's words when it ran nothing: exit status 4 (usage error, no such file) or 5 (no tests collected).
PYTEST_NOTHING = re.compile(rb"^(?:ERROR: usage:|ERROR: file or directory not found|ERROR: not found:|.*pytest: error: "
                            rb"|=* *no tests ran in|=* *\d+ deselected in|INTERNALERROR>).*$", re.M)


def pytest_never_ran(output):
    """Why a verifier's pytest ran no test, from its output; None when it ran tests. A run whose tests failed,
    or whose test module did not import (pytest's exit status 1 or 2: the agent's code is often what the tests
    import) is a wrong answer; a usage error, no test collected or an internal error (exit 3-5), or no pytest
    output at all (no interpreter, or uv could not fetch pytest offline) is a verifier that never ran."""
    output = re.sub(rb"\x1b\[[0-9;]*m", b"", output)  # --color=yes
    if PYTEST_RAN.search(output):
        return None
    said = PYTEST_NOTHING.findall(output)  # the last is the most specific ("usage: ..." comes before the error)
    if said:
        return f"pytest ran no test: {decode(said[-1]).strip(' =')}"
    errors = re.findall(rb"^.*(?:error|not found|No such file|[Cc]annot|[Cc]ould not).*$", output, re.M)
    return "no pytest run in its output" + (f"; its last error: {decode(errors[-1]).strip()[:300]}" if errors else "")


# What a command prints when it needs the network and the sandbox has none (no DNS, no route): apt, pip, uv, curl,
# git, npm, go.
NETWORK_ERRORS = re.compile(r"^.*(?:Temporary failure (?:in name resolution|resolving)|Could not resolve (?:host|proxy)"
                            r"|Name or service not known|No address associated with hostname|Network is unreachable"
                            r"|getaddrinfo EAI_AGAIN|failed to lookup address information|dial tcp: lookup).*$", re.M)


def network_evidence(text):
    """The last line of `text` saying that something failed for want of the network, or ''."""
    found = NETWORK_ERRORS.findall(text)
    return found[-1].strip()[:300] if found else ""


# ----------------------------------------------------------------------------------------------------------
# Replies

@dataclasses.dataclass
class Reply:
    analysis: str
    plan: str
    commands: list  # [(keystrokes, duration)]
    task_complete: bool


def parse_reply(text):
    """Parse a reply: an optional <think>...</think> block, then one JSON object (text around it is tolerated
    with a warning). Returns (Reply or None, error or None, warnings)."""
    warnings = []
    body = text.rsplit("</think>", 1)[1] if "</think>" in text else text
    if "<think>" in body:
        return None, "<think> block is not closed with </think>", warnings
    decoder, obj, first_error = json.JSONDecoder(), None, None
    for m in list(re.finditer(r"\{", body))[:50]:  # the object may follow prose that itself contains braces
        try:
            obj, end = decoder.raw_decode(body, m.start())
        except json.JSONDecodeError as e:
            first_error = first_error or e
            continue
        if isinstance(obj, dict):
            break
        obj = None
    if obj is None:
        if first_error:
            return None, f"Invalid JSON: {first_error}", warnings
        return None, "No valid JSON found in response", warnings + ["No valid JSON object found"]
    if body[:m.start()].strip():
        warnings.append("Extra text detected before JSON object")
    if body[end:].strip():
        warnings.append("Extra text detected after JSON object")
    missing = [k for k in ("analysis", "plan", "commands") if k not in obj]
    if missing:
        return None, f"Missing required fields: {', '.join(missing)}", warnings
    if not isinstance(obj["commands"], list):
        return None, "Field 'commands' must be an array", warnings
    commands = []
    for i, cmd in enumerate(obj["commands"], 1):
        if not isinstance(cmd, dict) or not isinstance(cmd.get("keystrokes"), str):
            return None, f"Command {i} must be an object with a string 'keystrokes' field", warnings
        duration = cmd.get("duration", DEFAULT_DURATION)
        if isinstance(duration, bool) or not isinstance(duration, (int, float)):
            warnings.append(f"Command {i}: 'duration' is not a number, using {DEFAULT_DURATION}")
            duration = DEFAULT_DURATION
        commands.append((cmd["keystrokes"], min(max(float(duration), 0.0), MAX_DURATION)))
    done = obj.get("task_complete", False)
    if isinstance(done, str):  # "true"/"false" are common enough to accept
        warnings.append("Field 'task_complete' should be a boolean")
        done = done.strip().lower() == "true"
    return Reply(str(obj["analysis"]), str(obj["plan"]), commands, bool(done)), None, warnings


# The reply as a grammar (xgrammar's EBNF, which vLLM's structured outputs take): exactly the text the toy expert's
# replies are (taskgen._reply: json.dumps with its default separators and key order, one line, ASCII with \u
# escapes), so a constrained policy chooses only the free values: the strings, each duration, task_complete. No free
# whitespace: a random policy cannot fill a reply with blanks. A string's characters are printable ASCII (plain) or
# escapes, and a '<' is never followed by 't' or '/' (write \u003c there): '<think>' or '</think>' inside a value
# would break parse_reply, which looks for them in the raw text (the expert's '<<' and '< file' pass). A duration
# has at most two digits either side of its point (parse_reply caps it at MAX_DURATION anyway). With think, an
# optional <think>...</think> block first, as Qwen3-style models write it and parse_reply skips it; its text holds
# no '<', so the block ends only with </think>. Strings are right-recursive rules: xgrammar then computes a token
# mask inside a string in ~30 us on a 2k vocabulary; as one `(a | b | c)*` loop it took 1.6 ms (measured).
# The reply's parts in order: fixed text, or a free value (a rule of _VALUE_EBNF); a command's the same. The grammar's
# reply and command rules are written from them, and so is close_reply's completion of a cut reply.
STRING, NUMBER, BOOL, COMMANDS = "string", "number", "bool", "commands"
_REPLY_PARTS = ('{"analysis": ', STRING, ', "plan": ', STRING, ', "commands": [', COMMANDS,
                '], "task_complete": ', BOOL, "}")
_COMMAND_PARTS = ('{"keystrokes": ', STRING, ', "duration": ', NUMBER, "}")
_COMMAND_SEP = ", "
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>\n\n"
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
                      f"think ::= {json.dumps(_THINK_OPEN)} [^<]* {json.dumps(_THINK_CLOSE)}",
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
        pos = _fixed(_THINK_OPEN, text, 0)
        if isinstance(pos, str):
            return pos + _THINK_CLOSE + _shortest(_REPLY_PARTS)
        end = text.find("<", pos)
        pos = len(text) if end < 0 else _fixed(_THINK_CLOSE, text, end)
        if end < 0 or isinstance(pos, str):
            return (_THINK_CLOSE if end < 0 else pos) + _shortest(_REPLY_PARTS)
    pos = _parts(text, pos, _REPLY_PARTS)
    if isinstance(pos, str):
        return pos
    if pos != len(text):
        raise ValueError(f"text after a whole reply at {pos} of {text!r}")
    return ""


# --grammar of the scripts that roll out (grpo.py, evaluate.py): whether, and under which grammar, replies are decoded
GRAMMAR_FLAG = dict(nargs="?", const="reply", choices=["reply", "think"], help="decode every reply under the "
                    "protocol's grammar (terminus.reply_grammar; vLLM structured outputs), so only its free values "
                    "are sampled: 'reply' (the bare flag) the JSON reply alone, as the SFT data writes it; 'think' "
                    "an optional <think> block before it (reasoning models)")


def _warning_list(warnings):
    return WARNING_LIST.format(warnings=WARNING_SEP.join(warnings)) if warnings else ""


def parse_error_message(error, warnings):
    """The observation that answers a reply that could not be parsed."""
    return PARSE_ERRORS.format(error=error, warnings=_warning_list(warnings))


def with_warnings(observation, warnings):
    """An observation with the parser's warnings about the reply that produced it in front, if any."""
    return WARNINGS.format(warnings=_warning_list(warnings), observation=observation) if warnings else observation


def confirm_message(observation):
    """The answer to a first task_complete: true, asking the agent to confirm."""
    return COMPLETION_CHECK.format(observation=observation)


# ----------------------------------------------------------------------------------------------------------
# Recognising the wrapper: the templates above turned into regexes (literal text escaped, fields captured)

def second_try_message(verifier_output, observation):
    return SECOND_TRY.format(output=truncate_output(verifier_output.strip()), observation=observation)


def _regex(template, **fields):
    parts = re.split(r"\{(\w+)\}", template)  # literal, field, literal, ...
    return "".join(fields[p] if i % 2 else re.escape(p) for i, p in enumerate(parts))


_WARNED = re.compile(_regex(WARNINGS, warnings=_regex(WARNING_LIST, warnings="(?P<list>.*?)"),
                            observation="(?P<rest>.*)"), re.S)
_CHECK = re.compile(_regex(COMPLETION_CHECK, observation="(?P<rest>.*)"), re.S)
_TERMINAL = re.compile(f"(?:{re.escape(OUTPUT_HEADER)}|{re.escape(SCREEN_HEADER)})(?P<rest>.*)", re.S)
_PARSE = re.compile(_regex(PARSE_ERRORS, error="(?P<error>.*?)",
                           warnings="(?:" + _regex(WARNING_LIST, warnings="(?P<list>.*?)") + ")?"), re.S)
_TRUNCATION = re.compile(_regex(TRUNCATION, limit=r"\d+", omitted=r"\d+"))
_SEP = re.compile(re.escape(WARNING_SEP))


def is_parse_error(observation):
    """Whether an observation is the protocol's answer to a reply it could not parse."""
    return _PARSE.fullmatch(observation) is not None


def unparsed_replies(messages):
    """One bool per assistant reply of a conversation, in turn order: whether the protocol could not parse it, read
    from the parse error it was answered with; the last reply has no answer (an episode ended by its third parse
    error among them) and is parsed here."""
    m = messages
    return [is_parse_error(m[i + 1]["content"]) if i + 1 < len(m) else parse_reply(m[i]["content"])[1] is not None
            for i in range(len(m)) if m[i]["role"] == "assistant"]


def is_completion_check(observation):
    return _CHECK.fullmatch(observation) is not None or (
        (m := _WARNED.fullmatch(observation)) is not None and _CHECK.fullmatch(m["rest"]) is not None)


def wrapper_spans(observation):
    """Character spans [(start, end)] of the harness's fixed text in an observation turn; the rest is payload:
    the terminal's output, and the parser's error and warning texts. None when the text is not in one of the
    forms above (an observation of another harness)."""
    m = _PARSE.fullmatch(observation)
    if m:
        payload = [m.span("error")] + _items(m)
        return _complement(payload, len(observation))
    payload, pos = [], 0
    m = _WARNED.fullmatch(observation)
    if m:
        payload, pos = _items(m), m.start("rest")
    end = len(observation)
    m = _CHECK.fullmatch(observation, pos)
    if m:
        pos, end = m.span("rest")
    m = _TERMINAL.fullmatch(observation, pos, end)
    if m is None:
        return None
    pos = m.start("rest")
    for t in _TRUNCATION.finditer(observation, pos, end):  # the notice is ours, not the terminal's
        payload.append((pos, t.start()))
        pos = t.end()
    return _complement(payload + [(pos, end)], len(observation))


def _items(m):
    """Spans of the warnings in a matched WARNING_LIST (group 'list'), without the separators."""
    if m.start("list") < 0:
        return []
    (pos, end), spans = m.span("list"), []
    for k in _SEP.finditer(m.string, pos, end):
        spans.append((pos, k.start()))
        pos = k.end()
    return spans + [(pos, end)]


def _complement(payload, n):
    out, pos = [], 0
    for s, e in sorted(payload):
        if s > pos:
            out.append((pos, s))
        pos = max(pos, e)
    return out + ([(pos, n)] if pos < n else [])


def wrapper_mask(messages, roles, text, off, spans):
    """(T,) bool: observation tokens of harness text. That is the fixed text of the Terminus-2 templates in an
    observation's content (wrapper_spans; an observation in no Terminus-2 form is all payload) and the
    observation's end-of-turn token. A token is wrapper only if all its characters are, so one that a BPE merge
    makes straddle wrapper and payload is payload: payload keeps every character the environment produced.
    roles, text, off, spans: as labels.encode_spans returns them."""
    wrap = np.zeros(len(text) + 1, dtype=np.int64)  # per character
    for ranges, label in zip(spans, message_labels(messages)):
        if label == OBS:
            (s, e), eot = ranges[0], ranges[1:]
            for a, b in wrapper_spans(text[s:e]) or ():
                wrap[s + a: s + b] = 1
            for a, b in eot:
                wrap[a:b] = 1
    csum = np.concatenate([[0], np.cumsum(wrap)])
    return (csum[off[:, 1]] - csum[off[:, 0]] == off[:, 1] - off[:, 0]) & (roles == OBS)
