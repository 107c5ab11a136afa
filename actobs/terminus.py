"""
The Terminus-2 protocol as text, the one home of every string an agent and its harness exchange turn by turn (the
hand-off at the context limit has its prompts in handoff.py): the system prompt template, the observation headers,
the truncation notice, the reply parser with its errors, warnings and auto-corrections, the parse-error / warnings /
completion-check / cut-reply messages, and the recogniser that splits an observation into the harness's wrapper text
and its payload (derived from the same templates, so the two cannot drift apart); and the readers of what tools print
in the terminal that the harness acts on (a verifier's pytest that ran no test, a command that wanted the network).

The protocol is Harbor's Terminus-2 (the agent that wrote Nemotron-Terminal-Corpus): every text an agent is told,
which commands run and when an episode is complete are what Harbor's TerminusJSONPlainParser and agent loop give
(tests/test_terminus_harbor.py compares them on a battery of replies against Harbor's own parser, fetched from its
pinned wheel; the differences that remain are named where they arise). The wording appears in the corpus's rows
(tests/fixtures/nemotron_terminal_sample.json); the default system prompt is ours (pass a corpus's own prompt with
load_template). Pure: no Docker, no torch. envs.py runs the protocol in sandboxes, taskgen.py's expert speaks it,
probes.py splits observations with it.

    reply, error, warnings = parse_reply(text)      # Reply(analysis, plan, commands [(keys, wait)], task_complete)
    obs = answer(reply, error, warnings, terminal)   # what the agent is told next (its commands' output)
    wrapper_spans(obs)                               # [(start, end)] of harness text; None if not Terminus-2's
"""
import dataclasses
import json
import re
from pathlib import Path

import numpy as np

from actobs.labels import OBS, message_labels

# The Harbor release whose Terminus-2 this protocol answers as (tests/test_terminus_harbor.py holds them equal on its
# wheel); evaluation results record it, and a resume under another protocol is refused
HARBOR_VERSION = "0.26.0"
PROTOCOL = f"Terminus-2 as Harbor {HARBOR_VERSION} runs it"
MAX_OBS_BYTES = 10_000  # observations keep head and tail within this size
MAX_DURATION = 60.0  # longest wait one command may ask for
DEFAULT_DURATION = 1.0  # a command's wait when its reply gives none

# Observation text. A template's {fields} are filled by the harness: the terminal's output, the parser's
# error and warnings, the reply's token limit; everything else in it is fixed wrapper text.
OUTPUT_HEADER = "New Terminal Output:\n"  # + the new output since the last read (a pane diff)
SCREEN_HEADER = "Current Terminal Screen:\n"  # + the visible screen, when no diff can be found
TRUNCATION = "\n[... output limited to {limit} bytes; {omitted} interior bytes omitted ...]\n"
# The parser's feedback: its error line, its warnings as a list (joined by WARNING_SEP), or both, one per line.
ERROR_LINE = "ERROR: {error}"
WARNING_LIST = "WARNINGS: - {warnings}"
WARNING_SEP = "\n- "
PARSE_ERRORS = ("Previous response had parsing errors:\n{feedback}\n\n"
                "Please fix these issues and provide a proper JSON response.")
WARNINGS = "Previous response had warnings:\n{feedback}\n\n{observation}"
COMPLETION_CHECK = ("Current terminal state:\n{observation}\n\nAre you sure you want to mark the task as complete? "
                    "This will trigger your solution to be graded and you won't be able to make any further "
                    'corrections. If so, include "task_complete": true in your JSON response again.')
# The answer to a reply cut at the policy's token limit: none of it ran; the parser's warnings on the cut text, if any.
CUT_REPLY = ("ERROR!! NONE of the actions you just requested were performed because you exceeded {limit} tokens. "
             "Your outputs must be less than {limit} tokens. Re-issue this request, breaking it into chunks each of "
             "which is less than {limit} tokens.{warnings}")
CUT_WARNINGS = "\n\nParser warnings from your truncated response:\n- {warnings}"
# aider's second try (evaluate.py --second-try; not Terminus-2's): the verifier's output once, then a new terminal.
SECOND_TRY = ("The tests failed. Their output:\n{output}\n\nFix the problem and mark the task complete again "
              "when it is done. The terminal was restarted:\n{observation}")


# The parser's errors (the reply is not run) and warnings (it is), in Terminus-2's words.
NO_JSON = "No valid JSON found in response"
NO_OBJECT = "No valid JSON object found"
INVALID_JSON = "Invalid JSON: {error}"
JSON_SHOWN = " | Content: {content}"  # the object's text (repr), when shorter than 200 characters
JSON_PREVIEW = " | Content preview: {content}..."  # else its first 100 characters
TEXT_BEFORE = "Extra text detected before JSON object"
TEXT_AFTER = "Extra text detected after JSON object"
MISSING_FIELDS = "Missing required fields: {fields}"
NOT_A_STRING = "Field '{field}' should be a string"
COMMANDS_NOT_ARRAY = "Field 'commands' must be an array"
WRONG_ORDER = "Fields appear in wrong order. Found: {found}, expected: {expected}"
ORDER_SEP = " \u2192 "  # the arrow between field names in WRONG_ORDER
BAD_TASK_COMPLETE = "Field 'task_complete' should be a boolean or string"
NOT_AN_OBJECT = "Command {i} must be an object"
NO_KEYSTROKES = "Command {i} missing required 'keystrokes' field"
KEYSTROKES_NOT_STRING = "Command {i} 'keystrokes' must be a string"
BAD_DURATION = "Command {i}: Invalid duration value, using default {default}"
NO_DURATION = "Command {i}: Missing duration field, using default {default}"
UNKNOWN_FIELDS = "Command {i}: Unknown fields: {fields}"
NO_NEWLINE = ("Command {i} should end with newline when followed by another command. Otherwise the two commands "
              "will be concatenated together on the same line.")
AUTO_CORRECTED = "AUTO-CORRECTED: {fix} - please fix this in future responses"
ADDED_BRACES = "Fixed incomplete JSON by adding missing closing brace"
EXTRACTED = "Extracted JSON from mixed content"

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
    analysis: object  # as the reply gave them: strings, unless the parser warned
    plan: object
    commands: list  # [(keystrokes, wait in seconds)]
    task_complete: bool


class CutReply(str):
    """A reply the policy's token limit cut before its end (vLLM's finish reason 'length'): its text, and `limit`,
    the tokens a reply may have. The episode loop runs none of it and asks again (cut_message), as Terminus-2 does
    when its model call raises OutputLengthExceededError."""

    def __new__(cls, text, limit):
        self = super().__new__(cls, text)
        self.limit = limit
        return self


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REQUIRED = ("analysis", "plan", "commands")
TRUE_WORDS = ("true", "1", "yes")  # task_complete given as a string: complete when it is one of these (any case)


def reply_content(text):
    """The part of a reply Terminus-2's parser reads. Harbor gets a model's reply from a vLLM server whose
    reasoning parser (Qwen3's, vLLM 0.32-0.33) moves the think block out of the content, so its parser never sees
    the block (nor its braces and quotes); this is that content: the text after the first </think> (any later
    </think> dropped, as that parser drops it), nothing for a reply that opens a <think> block and never closes it
    (all reasoning), and the whole text of a reply with no think block (the parser with thinking off: the toy
    world's policies write none). Only the parser reads the content: the project's conversation and token sequence
    keep the whole reply, what the policy sampled (Harbor's chat history keeps the content alone, as its
    interleaved_thinking is off by default)."""
    if THINK_CLOSE in text:
        return text.split(THINK_CLOSE, 1)[1].replace(THINK_CLOSE, "")
    return "" if text.lstrip().startswith(THINK_OPEN) else text


def parse_reply(text):
    """Parse a reply as Terminus-2 does -> (Reply, or None when the harness rejects it; the error, or None;
    warnings). The content (reply_content) is read once as it is; when that fails, two corrections are tried in
    turn and the first that parses is taken, with an AUTO-CORRECTED warning first: the missing closing braces
    appended (for a reply with no JSON object or invalid JSON), then the first object in the text with braces nested
    at most one level deep that is valid JSON. A command error on a reply that marks the task complete is only a
    warning (no command runs). A reply whose warnings say "ERROR:" (an unknown command field so named) is rejected
    without an error of its own: Terminus-2's loop takes any feedback holding that word for a parse error. Where
    Harbor's parser raises instead (an integer duration past a float's range), the command waits the longest."""
    content = reply_content(text)
    reply, error, warnings = _read(content)
    if error is not None:
        for fix, fixed in ((ADDED_BRACES, _closing_braces(content, error)), (EXTRACTED, _flat_object(content))):
            if fixed is None:
                continue
            reply, error2, warnings2 = _read(fixed)
            if error2 is None:
                warnings = [AUTO_CORRECTED.format(fix=fix)] + warnings2
                break
        else:
            return None, error, warnings
    if any("ERROR:" in w for w in warnings):
        return None, None, warnings
    return reply, None, warnings


def _object_span(text):
    """(start, end) of the first JSON object in text as Terminus-2 finds it, or None: a scan in which a backslash
    skips the next character and a double quote opens or closes a string wherever they are (in prose too), and
    braces outside strings count up and down (one before the first '{' too); the object is the first '{' met at
    depth 0 through the '}' that brings the depth back to 0."""
    depth, start, in_string, escaped = 0, -1, False, False
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            in_string = not in_string
        elif not in_string and ch == "{":
            start = i if depth == 0 else start
            depth += 1
        elif not in_string and ch == "}":
            depth -= 1
            if depth == 0 and start >= 0:
                return start, i + 1
    return None


def _read(text):
    """One reading of a reply's content -> (Reply or None, error or None, warnings)."""
    span = _object_span(text)
    if span is None:
        return None, NO_JSON, [NO_OBJECT]
    start, end = span
    warnings = [w for w, extra in ((TEXT_BEFORE, text[:start]), (TEXT_AFTER, text[end:])) if extra.strip()]
    body = text[start:end]
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError; an integer of over 4300 digits
        shown = JSON_SHOWN.format(content=repr(body)) if len(body) < 200 else \
            JSON_PREVIEW.format(content=repr(body[:100]))
        return None, INVALID_JSON.format(error=e) + shown, warnings
    missing = [k for k in REQUIRED if k not in obj]
    if missing:
        return None, MISSING_FIELDS.format(fields=", ".join(missing)), warnings
    warnings += [NOT_A_STRING.format(field=k) for k in ("analysis", "plan") if not isinstance(obj[k], str)]
    if not isinstance(obj["commands"], list):
        return None, COMMANDS_NOT_ARRAY, warnings
    # The order in which the required fields' names first appear in the object's text (strings included)
    seen = {k: m.start() for k in REQUIRED if (m := re.search(f'"{k}"\\s*:', body))}
    found = sorted(seen, key=seen.get)
    if len(found) > 1 and found != [k for k in REQUIRED if k in seen]:
        warnings.append(WRONG_ORDER.format(found=ORDER_SEP.join(found),
                                           expected=ORDER_SEP.join(k for k in REQUIRED if k in seen)))
    done = obj.get("task_complete")
    if done is not None and not isinstance(done, (bool, str)):
        warnings.append(BAD_TASK_COMPLETE)
    done = done.lower() in TRUE_WORDS if isinstance(done, str) else bool(done)  # else by truth value (1, [], ...)
    commands, error = _read_commands(obj["commands"], warnings)
    if error is not None and not done:
        return None, error, warnings
    if error is not None:  # completing: the error is a warning and nothing runs
        warnings.append(error)
    return Reply(obj["analysis"], obj["plan"], commands, done), None, warnings


def _read_commands(items, warnings):
    """A reply's commands -> ([(keystrokes, wait)], None), or ([], the first command's error); appends the
    commands' warnings (those of the commands before an error stay)."""
    commands = []
    for i, cmd in enumerate(items, 1):
        if not isinstance(cmd, dict):
            return [], NOT_AN_OBJECT.format(i=i)
        if "keystrokes" not in cmd:
            return [], NO_KEYSTROKES.format(i=i)
        keys = cmd["keystrokes"]
        if not isinstance(keys, str):
            return [], KEYSTROKES_NOT_STRING.format(i=i)
        duration = cmd.get("duration", DEFAULT_DURATION)
        if "duration" not in cmd:
            warnings.append(NO_DURATION.format(i=i, default=DEFAULT_DURATION))
        elif not isinstance(duration, (int, float)):  # a bool is an int: true waits 1 s
            warnings.append(BAD_DURATION.format(i=i, default=DEFAULT_DURATION))
            duration = DEFAULT_DURATION
        unknown = [k for k in cmd if k not in ("keystrokes", "duration")]  # Terminus-2 lists them in no set order
        if unknown:
            warnings.append(UNKNOWN_FIELDS.format(i=i, fields=", ".join(unknown)))
        if i < len(items) and keys and not keys.endswith("\n"):
            warnings.append(NO_NEWLINE.format(i=i))
        # Terminus-2 caps a wait at MAX_DURATION and sleeps only a positive one (a negative or NaN one: none)
        commands.append((keys, float(min(duration, MAX_DURATION)) if duration > 0 else 0.0))
    return commands, None


def _closing_braces(text, error):
    """The text with its missing closing braces appended ('{' minus '}' anywhere in it), for a reply that has no
    object or invalid JSON; None when that does not apply."""
    missing = text.count("{") - text.count("}")
    json_error = error == NO_JSON or error.startswith(INVALID_JSON.format(error=""))
    return text + "}" * missing if json_error and missing > 0 else None


# An object whose braces nest at most one level deep, braces in strings counted as braces: '{', then text without
# braces or a flat {...}, any number of times, then '}'
_FLAT_OBJECT = re.compile(r"\{ [^{}]* (?: \{[^{}]*\} [^{}]* )* \}", re.X)


def _flat_object(text):
    """The first of the text's non-overlapping flat objects (_FLAT_OBJECT, left to right) that is valid JSON, or
    None."""
    for m in _FLAT_OBJECT.finditer(text):
        try:
            json.loads(m[0])
        except ValueError:
            continue
        return m[0]
    return None


def _feedback(error, warnings):
    """The parser's feedback: its error line, its warnings, or both, one per line."""
    return "\n".join(([ERROR_LINE.format(error=error)] if error is not None else [])
                     + ([WARNING_LIST.format(warnings=WARNING_SEP.join(warnings))] if warnings else []))


def parse_error_message(error, warnings):
    """The observation that answers a reply the harness rejected (error None: one whose warnings read as one)."""
    return PARSE_ERRORS.format(feedback=_feedback(error, warnings))


def with_warnings(observation, warnings):
    """An observation with the parser's warnings about the reply that produced it in front, if any."""
    return WARNINGS.format(feedback=_feedback(None, warnings), observation=observation) if warnings else observation


def confirm_message(observation):
    """The answer to a first task_complete: true, asking the agent to confirm."""
    return COMPLETION_CHECK.format(observation=observation)


def answer(reply, error, warnings, terminal=None, confirming=False):
    """What Terminus-2's loop tells the agent after a reply (parse_reply's result), or None when the episode ends
    there: a rejected reply's parse error (nothing ran); a task_complete reply ends the episode when a completion
    was pending (confirming: the reply before asked to complete and was answered with the check; a parse error
    between them keeps it pending), else gets the completion check around `terminal`, the terminal's output after
    its commands ran (the warnings are not shown: Terminus-2 drops them on a completion turn); any other reply gets
    that output with the warnings in front. The output is limited to MAX_OBS_BYTES again off the completion turn,
    as Terminus-2 limits it once when it reads it and once more there (a second notice then stands for the
    first)."""
    if reply is None:
        return parse_error_message(error, warnings)
    if reply.task_complete:
        return None if confirming else confirm_message(terminal)
    return with_warnings(truncate_output(terminal), warnings)


def cut_message(limit, warnings):
    """The answer to a reply cut at `limit` tokens (CutReply): nothing ran, ask again; `warnings`: the parser's on
    the cut text."""
    return CUT_REPLY.format(limit=limit, warnings=CUT_WARNINGS.format(warnings=WARNING_SEP.join(warnings))
                            if warnings else "")


def second_try_message(verifier_output, observation):
    return SECOND_TRY.format(output=truncate_output(verifier_output.strip()), observation=observation)


# ----------------------------------------------------------------------------------------------------------
# Recognising the wrapper: the templates above turned into regexes (literal text escaped, fields captured)

def _regex(template, **fields):
    parts = re.split(r"\{(\w+)\}", template)  # literal, field, literal, ...
    return "".join(fields[p] if i % 2 else re.escape(p) for i, p in enumerate(parts))


def _list(group):
    return _regex(WARNING_LIST, warnings=f"(?P<{group}>.*?)")


# A parse error's feedback is its error line with the warnings on the next line, or the warnings alone
_PARSE = re.compile(_regex(PARSE_ERRORS, feedback=f"(?:{_regex(ERROR_LINE, error='(?P<error>.*?)')}"
                                                  f"(?:\n{_list('list')})?|{_list('alone')})"), re.S)
_WARNED = re.compile(_regex(WARNINGS, feedback=_list("list"), observation="(?P<rest>.*)"), re.S)
_CHECK = re.compile(_regex(COMPLETION_CHECK, observation="(?P<rest>.*)"), re.S)
_CUT = re.compile(_regex(CUT_REPLY, limit=r"\d+", warnings=f"(?:{_regex(CUT_WARNINGS, warnings='(?P<list>.*)')})?"),
                  re.S)
_TERMINAL = re.compile(f"(?:{re.escape(OUTPUT_HEADER)}|{re.escape(SCREEN_HEADER)})(?P<rest>.*)", re.S)
_TRUNCATION = re.compile(_regex(TRUNCATION, limit=r"\d+", omitted=r"\d+"))
_SEP = re.compile(re.escape(WARNING_SEP))


def is_parse_error(observation):
    """Whether an observation is the protocol's answer to a reply it rejected."""
    return _PARSE.fullmatch(observation) is not None


def unparsed_replies(messages):
    """One bool per assistant reply of a conversation, in turn order: whether the protocol rejected it, read from
    the parse error it was answered with; the last reply has no answer (the episode ended there) and is parsed
    here."""
    m = messages
    return [is_parse_error(m[i + 1]["content"]) if i + 1 < len(m) else parse_reply(m[i]["content"])[0] is None
            for i in range(len(m)) if m[i]["role"] == "assistant"]


def is_completion_check(observation):
    return _CHECK.fullmatch(observation) is not None


_LAST_TERMINAL = re.compile(f".*(?:{re.escape(OUTPUT_HEADER)}|{re.escape(SCREEN_HEADER)})(?P<rest>.*)", re.S)


def terminal_text(message):
    """The terminal's text a user message of the protocol shows last: what follows its last output or screen
    header (an observation's new output or screen, the first prompt's screen, a second try's), the completion
    check's question left out; None for a message that shows none (a parse error, a cut reply's answer)."""
    if _PARSE.fullmatch(message) or _CUT.fullmatch(message):
        return None
    m = _CHECK.fullmatch(message)
    m = _LAST_TERMINAL.match(m["rest"] if m else message)
    return None if m is None else m["rest"]


def wrapper_spans(observation):
    """Character spans [(start, end)] of the harness's fixed text in an observation turn; the rest is payload:
    the terminal's output, and the parser's error and warning texts. None when the text is not in one of the
    forms above (an observation of another harness). The forms: a parse error; a cut reply's answer; the terminal
    (its header, its output, the truncation notices), alone, after warnings or inside the completion check."""
    m = _PARSE.fullmatch(observation) or _CUT.fullmatch(observation)
    if m:
        payload = [m.span("error")] if m.re is _PARSE and m.start("error") >= 0 else []
        return _complement(payload + _items(m, "list") + _items(m, "alone"), len(observation))
    payload, pos, end = [], 0, len(observation)
    m = _WARNED.fullmatch(observation) or _CHECK.fullmatch(observation)
    if m:
        payload, (pos, end) = _items(m, "list"), m.span("rest")
    m = _TERMINAL.fullmatch(observation, pos, end)
    if m is None:
        return None
    pos = m.start("rest")
    for t in _TRUNCATION.finditer(observation, pos, end):  # the notice is ours, not the terminal's
        payload.append((pos, t.start()))
        pos = t.end()
    return _complement(payload + [(pos, end)], len(observation))


def _items(m, group):
    """Spans of the warnings in a matched warning list (`group`), without the separators; none if the group is
    not in the pattern or did not match."""
    if group not in m.re.groupindex or m.start(group) < 0:
        return []
    (pos, end), spans = m.span(group), []
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
