"""The Terminus-2 protocol (terminus.py): the reply parser, the observation messages in the exact wording of
real Nemotron-Terminal-Corpus rows, output truncation and pane diffs, and the wrapper / payload split of every
observation turn of the real rows and of the expert's episodes."""
import json
import random

import pytest

from actobs import grammar, taskgen, terminus
from conftest import FIXTURES, nemotron_rows, split_observation

GOOD = {"analysis": "a", "plan": "p", "commands": [{"keystrokes": "ls\n", "duration": 0.1}], "task_complete": False}


def observations(conv):
    return [m["content"] for m in conv[1:] if m["role"] == "user"]


# ---------------------------------------------------------------------------------------------- replies

def test_parse_reply_think_and_json():
    reply, err, warnings = terminus.parse_reply("<think>\nlook first {not json}\n</think>\n\n"
                                                + json.dumps(GOOD, indent=2))
    assert err is None and warnings == []
    assert reply == terminus.Reply("a", "p", [("ls\n", 0.1)], False)


def test_parse_reply_extra_text_warns():
    reply, err, warnings = terminus.parse_reply("Sure! " + json.dumps(GOOD) + "\nHope this helps")
    assert err is None and reply.commands == [("ls\n", 0.1)]
    assert warnings == ["Extra text detected before JSON object", "Extra text detected after JSON object"]


def test_parse_reply_defaults_and_caps():
    reply, err, _ = terminus.parse_reply(json.dumps({"analysis": "", "plan": "", "commands": [
        {"keystrokes": "C-c"}, {"keystrokes": "sleep 100\n", "duration": 500}, {"keystrokes": "", "duration": -1}]}))
    assert err is None and reply.task_complete is False
    assert reply.commands == [("C-c", 1.0), ("sleep 100\n", 60.0), ("", 0.0)]


@pytest.mark.parametrize("text, error", [
    ("no json here", "No valid JSON found in response"),
    ('{"analysis": "a", "plan": "p"}', "Missing required fields: commands"),
    ('{"analysis": "a", "plan": "p", "commands": "ls"}', "Field 'commands' must be an array"),
    ('{"analysis": "a", "plan": "p", "commands": [{"duration": 1}]}', "Command 1 missing required 'keystrokes' field"),
    ('{"analysis": "a", "plan": "p", "commands": [{"keystrokes": "ls\\n"}, 3]}', "Command 2 must be an object"),
    ('{"analysis": "a", "plan": "p", "commands": [{"keystrokes": 1}]}', "Command 1 'keystrokes' must be a string"),
    ("<think>never closed {", "No valid JSON found in response"),  # all of it reasoning: no content
])
def test_parse_reply_errors(text, error):
    reply, err, _ = terminus.parse_reply(text)
    assert reply is None and err == error


def test_parse_reply_invalid_json_names_the_problem_and_shows_the_object():
    text = '{"analysis": "a", "plan": "p", "commands": [}'
    reply, err, _ = terminus.parse_reply(text)
    assert reply is None and err == f"Invalid JSON: Expecting value: line 1 column 45 (char 44) | Content: {text!r}"
    long = '{"analysis": "' + "x" * 300 + '", "plan": "p", "commands": [}'
    err = terminus.parse_reply(long)[1]
    assert err.endswith(f" | Content preview: {long[:100]!r}...")


def test_parse_reply_auto_corrections_say_so():
    """A missing closing brace is added, and an object is taken out of text that confuses the object scan (an odd
    double quote in the prose), each with an AUTO-CORRECTED warning first; the corrected reply runs."""
    reply, err, warnings = terminus.parse_reply(json.dumps(GOOD)[:-1])
    assert err is None and reply.commands == [("ls\n", 0.1)]
    assert warnings == ["AUTO-CORRECTED: Fixed incomplete JSON by adding missing closing brace - please fix this in "
                        "future responses"]
    reply, err, warnings = terminus.parse_reply('He said "hi then ' + json.dumps(GOOD))
    assert err is None and reply.commands == [("ls\n", 0.1)]
    assert warnings == ["AUTO-CORRECTED: Extracted JSON from mixed content - please fix this in future responses"]


def test_parse_reply_warnings_in_order():
    text = json.dumps({"plan": 1, "analysis": "a", "commands": [{"keystrokes": "cd /app", "x": 1},
                                                                 {"keystrokes": "ls\n", "duration": "1"}],
                       "task_complete": 2})
    reply, err, warnings = terminus.parse_reply(text)
    assert err is None and reply.commands == [("cd /app", 1.0), ("ls\n", 1.0)] and reply.task_complete
    assert warnings == ["Field 'plan' should be a string",
                        "Fields appear in wrong order. Found: plan \u2192 analysis \u2192 commands, expected: "
                        "analysis \u2192 plan \u2192 commands",
                        "Field 'task_complete' should be a boolean or string",
                        "Command 1: Missing duration field, using default 1.0", "Command 1: Unknown fields: x",
                        "Command 1 should end with newline when followed by another command. Otherwise the two "
                        "commands will be concatenated together on the same line.",
                        "Command 2: Invalid duration value, using default 1.0"]


@pytest.mark.parametrize("value, done", [(True, True), ("true", True), ("Yes", True), ("1", True), (" true", False),
                                         ("no", False), (1, True), (0, False), ([], False), (None, False)])
def test_task_complete_reading(value, done):
    assert terminus.parse_reply(json.dumps({**GOOD, "task_complete": value}))[0].task_complete is done


def test_a_completing_reply_with_a_bad_command_completes_with_a_warning_and_runs_nothing():
    text = json.dumps({**GOOD, "commands": [{"keystrokes": "ls\n", "duration": 1}, "rm -rf /"], "task_complete": True})
    reply, err, warnings = terminus.parse_reply(text)
    assert err is None and reply.task_complete and reply.commands == [] and warnings == ["Command 2 must be an object"]
    reply, err, _ = terminus.parse_reply(text.replace("true", "false"))
    assert reply is None and err == "Command 2 must be an object"


def test_a_warning_that_says_error_rejects_the_reply():
    """Terminus-2's loop takes any feedback holding "ERROR:" for a parse error: an unknown command field so named."""
    reply, err, warnings = terminus.parse_reply(json.dumps({**GOOD, "commands": [{"keystrokes": "ls\n", "duration": 1,
                                                                               "ERROR: no": 1}]}))
    assert (reply, err, warnings) == (None, None, ["Command 1: Unknown fields: ERROR: no"])
    told = terminus.answer(reply, err, warnings)
    assert told == ("Previous response had parsing errors:\nWARNINGS: - Command 1: Unknown fields: ERROR: no\n\n"
                    "Please fix these issues and provide a proper JSON response.") and terminus.is_parse_error(told)


@pytest.mark.parametrize("text, content", [
    ("<think>\nhm\n</think>\n\n{}", "\n\n{}"), ("{}", "{}"), ("<think>a</think>b</think>c", "bc"),
    ("x</think>y", "y"), ("  <think>never closed {}", ""), ("{} <think>", "{} <think>"), ("<think>a</think>", ""),
])
def test_reply_content_is_what_a_reasoning_parser_hands_over(text, content):
    assert terminus.reply_content(text) == content


def test_answer_follows_terminus_2s_loop():
    """A parse error, the completion check without the warnings, the end on a confirmation, the output limited
    once more with the warnings in front."""
    done = json.dumps({**GOOD, "task_complete": True, "commands": [{"keystrokes": "ls\n"}]})
    reply, err, warnings = terminus.parse_reply(done)
    assert warnings and terminus.answer(reply, err, warnings, "OUT") == terminus.confirm_message("OUT")
    assert terminus.answer(reply, err, warnings, "OUT", confirming=True) is None
    reply, err, warnings = terminus.parse_reply(done.replace("true", "false"))
    long = terminus.truncate_output(terminus.OUTPUT_HEADER + "x" * 20_000)
    told = terminus.answer(reply, err, warnings, long, confirming=True)
    assert told == terminus.with_warnings(terminus.truncate_output(long), warnings) and told.count("[... output") == 1
    assert "; 71 interior bytes omitted ...]" in told  # the second notice counts the first one's bytes
    assert terminus.answer(*terminus.parse_reply("oops"), "OUT") == terminus.parse_error_message(
        "No valid JSON found in response", ["No valid JSON object found"])


def test_a_cut_reply_is_asked_again_with_the_parsers_warnings():
    cut = terminus.CutReply(json.dumps(GOOD)[:30], 512)
    assert cut == json.dumps(GOOD)[:30] and cut.limit == 512
    told = terminus.cut_message(cut.limit, terminus.parse_reply(cut)[2])
    assert told == ("ERROR!! NONE of the actions you just requested were performed because you exceeded 512 tokens. "
                    "Your outputs must be less than 512 tokens. Re-issue this request, breaking it into chunks each of "
                    "which is less than 512 tokens.\n\nParser warnings from your truncated response:\n"
                    "- No valid JSON object found")
    assert split_observation(told)[1] == ["No valid JSON object found"] and not terminus.is_parse_error(told)
    assert terminus.cut_message(512, []).endswith("less than 512 tokens.")


DONE = '{"analysis": "", "plan": "", "commands": [], "task_complete": true}'


def test_unparsed_replies_count_every_reply_the_protocol_could_not_parse():
    """grpo.py's parse-error rate: a reply is unparsed when the protocol answered it with a parse error; the last
    reply, which nothing answered (an episode its third parse error ended), is parsed here."""
    def conversation(replies):
        msgs = [{"role": "user", "content": "task"}]
        for k, r in enumerate(replies):
            msgs.append({"role": "assistant", "content": r})
            if k + 1 < len(replies):
                bad = terminus.parse_reply(r)[1]
                msgs.append({"role": "user", "content": terminus.parse_error_message(bad, []) if bad else "out"})
        return msgs
    convs = [conversation(r) for r in (["{x", DONE], ["{}", DONE, DONE, DONE], ["{x", "{y", "{z"], [DONE])]
    assert [terminus.unparsed_replies(m) for m in convs] == [[True, False], [True, False, False, False], [True] * 3,
                                                           [False]]


# ---------------------------------------------------------------------------------------------- messages

def test_messages_are_those_of_the_real_rows():
    """A reply with no JSON and a first task_complete get exactly the observations of the published rows."""
    real = [o for row in nemotron_rows() for o in observations(row["conversations"])]
    reply, err, warnings = terminus.parse_reply("I will look at the files first.")
    assert terminus.parse_error_message(err, warnings) in real
    checks = [o for o in real if o.startswith("Current terminal state:\n")]
    assert len(checks) == 4
    for o in checks:
        inner = o[len("Current terminal state:\n"): o.index("\n\nAre you sure")]
        assert terminus.confirm_message(inner) == o and terminus.is_completion_check(o)
    assert not any(terminus.is_completion_check(o) for o in real if o not in checks)
    assert terminus.parse_error_message("E", []) == (
        "Previous response had parsing errors:\nERROR: E\n\n"
        "Please fix these issues and provide a proper JSON response.")
    assert terminus.with_warnings("OBS", ["w1", "w2"]) == "Previous response had warnings:\nWARNINGS: - w1\n- w2\n\nOBS"
    assert terminus.with_warnings("OBS", []) == "OBS"


def test_prompt_template_from_a_corpus_row(tmp_path):
    """A user's corpus prompt (here a real Nemotron row) becomes a template that reproduces that row exactly."""
    first = json.loads((FIXTURES / "nemotron_terminal_sample.json").read_text())[0]["conversations"][0]["content"]
    head, rest = first.split("Task Description:\n", 1)
    instruction, state = rest.split("\n\nCurrent terminal state:\n", 1)
    path = tmp_path / "prompt.txt"
    path.write_text(head + "Task Description:\n{instruction}\n\nCurrent terminal state:\n{terminal_state}")
    template = terminus.load_template(path)
    assert terminus.fill_prompt(template, instruction, state) == first
    bad = tmp_path / "bad.txt"
    bad.write_text("no placeholders {instruction}")
    with pytest.raises(ValueError, match=r"bad.txt: prompt template lacks the \{terminal_state\} placeholder"):
        terminus.load_template(bad)
    default = terminus.fill_prompt(terminus.load_template(None), "Do X.", "Current Terminal Screen:\nroot@h:/app#\n")
    assert default.endswith("Task:\nDo X.\n\nCurrent terminal state:\nCurrent Terminal Screen:\nroot@h:/app#\n")
    assert '"keystrokes": "ls -la\\n"' in default


# ---------------------------------------------------------------------------------------------- terminal output

def test_truncate_output_keeps_head_and_tail_within_utf8():
    text = "H" * 6000 + "é" * 3000 + "T" * 6000  # 18,000 bytes
    out = terminus.truncate_output(text)
    assert out.startswith("H" * 5000) and out.endswith("T" * 5000)
    assert "\n[... output limited to 10000 bytes; 8000 interior bytes omitted ...]\n" in out
    assert terminus.truncate_output("short") == "short"
    cut = terminus.truncate_output("a" + "é" * 6000)  # 12,001 bytes: the head's cut falls inside a character
    marker = "\n[... output limited to 10000 bytes; 2002 interior bytes omitted ...]\n"  # 2001 + the split one
    assert "\ufffd" not in cut and marker in cut and len(cut.encode()) <= 10_000 + len(marker)


def test_decode_replaces_invalid_utf8():
    assert terminus.decode(b"ok \xff\xfe end") == "ok \ufffd\ufffd end"


def test_pane_diff_matches_terminus_incremental_output():
    first = ["root@h:/app# ls", "a.txt", "root@h:/app#", "", ""]
    assert terminus.pane_diff(first, 0, "root@h:/app#") == "root@h:/app# ls\na.txt\nroot@h:/app#"
    later = ["old output", "root@h:/app# echo hi", "hi", "root@h:/app#"]
    assert terminus.pane_diff(later, 1, "root@h:/app#") == "\nroot@h:/app# echo hi\nhi\nroot@h:/app#"
    assert terminus.pane_diff(later, 1, "root@other:/#") is None  # the line the keys were typed at is gone
    assert terminus.pane_diff(later, 9, "root@h:/app#") is None
    assert terminus.visible_screen(["x"] * 50 + ["root@h:/app#", "", ""], rows=4) == "x\nroot@h:/app#\n"


# ---------------------------------------------------------------------------------------------- wrapper / payload

def test_every_observation_of_the_real_rows_splits():
    for row in nemotron_rows():
        for obs in observations(row["conversations"]):
            wrapper, payload = split_observation(obs)
            assert "root@" not in wrapper and wrapper.startswith(obs[:20])


def test_split_of_each_form_is_exact():
    out = "root@h:/app# cat big\n" + "x" * 12_000 + "\nroot@h:/app# "
    cut = terminus.OUTPUT_HEADER + terminus.truncate_output(out)
    notice = "\n[... output limited to 10000 bytes; 2035 interior bytes omitted ...]\n"
    assert split_observation(cut) == (terminus.OUTPUT_HEADER + notice, [out[:5000], out[-5000:]])
    warned = terminus.with_warnings(terminus.SCREEN_HEADER + "$ \n", ["w1", "w2"])
    assert split_observation(warned)[1] == ["w1", "w2", "$ \n"]
    assert split_observation(terminus.confirm_message(terminus.SCREEN_HEADER + "$ \n"))[1] == ["$ \n"]
    assert split_observation(terminus.parse_error_message(None, ["w1", "w2"]))[1] == ["w1", "w2"]
    assert split_observation(terminus.cut_message(64, ["w1", "w2"]))[1] == ["w1", "w2"]
    no_such_form = terminus.with_warnings(terminus.confirm_message(terminus.SCREEN_HEADER + "$ \n"), ["w"])
    assert terminus.wrapper_spans(no_such_form) is None  # Terminus-2 shows no warnings on a completion turn
    err = terminus.parse_error_message("Invalid JSON: Expecting value: line 1 column 2 (char 1)",
                                       ["No valid JSON object found"])
    assert split_observation(err)[1] == ["Invalid JSON: Expecting value: line 1 column 2 (char 1)",
                                         "No valid JSON object found"]
    assert terminus.wrapper_spans("plain text from another harness") is None


def expert_replies():
    """Every reply of the toy expert (the SFT data's) over five tasks of each kind, five turns each, with observations
    made by the protocol's functions."""
    out = []
    for kind in taskgen.GENERATORS:
        for seed in range(5):
            spec = taskgen.generate(kind, random.Random(seed))
            msgs = [{"role": "user", "content": terminus.fill_prompt(terminus.DEFAULT_PROMPT, spec.instruction,
                                                                     terminus.SCREEN_HEADER + "root@h:/app#\n")}]
            for _ in range(5):
                out.append(taskgen.expert_reply(msgs))
                msgs += [{"role": "assistant", "content": out[-1]},
                         {"role": "user", "content": terminus.OUTPUT_HEADER + "root@h:/app# ls\na.txt\nroot@h:/app#"}]
    return out


def test_the_reply_grammar_admits_the_sft_replies_and_nothing_looser(tokenizer):
    """grammar.reply_grammar (compiled as the engine compiles it) admits every reply of the toy expert, each of
    which parses without a warning, and nothing looser: no whitespace of its own, no other key order or
    separators, no '<think>' or '</think>' inside a value (parse_reply would trip on it; a '<' before anything else
    passes, as in a heredoc), no block before the JSON; the think form also admits a <think> block first."""
    from actobs import engine
    xgr = pytest.importorskip("xgrammar")
    plain, think = (engine.compile_grammar(tokenizer, grammar.reply_grammar(t), len(tokenizer)) for t in (False, True))

    def admits(compiled, text):
        m = xgr.GrammarMatcher(compiled)
        return m.accept_string(text) and m.accept_token(tokenizer.eos_token_id) and m.is_terminated()
    replies = expert_replies()
    assert len(replies) >= 200 and all(admits(plain, r) for r in replies)
    assert all(terminus.parse_reply(r)[1:] == (None, []) for r in replies)
    reply = replies[1]
    obj = json.loads(reply)
    for text in (json.dumps(obj, indent=2), json.dumps(obj, separators=(",", ":")), reply + " ", " " + reply,
                 json.dumps(dict(reversed(list(obj.items())))), reply.replace('"plan": "', '"plan": "<think>', 1),
                 reply.replace('"plan": "', '"plan": "</think>', 1), "<think>hm\n</think>\n\n" + reply):
        assert not admits(plain, text), text
    assert admits(plain, reply.replace('"plan": "', '"plan": "cat << EOF < in', 1))
    assert admits(think, "<think>hm\n</think>\n\n" + reply) and admits(think, reply)


def test_every_observation_of_an_expert_episode_splits():
    """The expert's episode with observations made by the protocol's functions (Docker runs the real ones in
    test_envs_docker's corpus test): look, act, check, confirm, including a parse error and warnings."""
    spec = taskgen.generate("find_copy", random.Random(0))
    msgs = [{"role": "user", "content": terminus.fill_prompt(terminus.DEFAULT_PROMPT, spec.instruction,
                                                             terminus.SCREEN_HEADER + "root@h:/app#\n")}]
    screen = "\nroot@h:/app# ls\n" + "a.txt\n" * 3000 + "root@h:/app#"
    while len(msgs) < 20:
        reply = taskgen.expert_reply(msgs)
        parsed, err, warnings = terminus.parse_reply(reply)
        if parsed.task_complete and terminus.is_completion_check(msgs[-1]["content"]):
            break
        obs = terminus.OUTPUT_HEADER + terminus.truncate_output(screen)
        obs = terminus.confirm_message(obs) if parsed.task_complete else terminus.with_warnings(obs, ["w"])
        msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": obs}]
    msgs += [{"role": "assistant", "content": "oops"},
             {"role": "user", "content": terminus.parse_error_message(*terminus.parse_reply("oops")[1:])}]
    obs = observations(msgs)
    assert len(obs) >= 5 and terminus.is_completion_check(obs[-2])
    for o in obs:
        wrapper, payload = split_observation(o)
        assert "root@" not in wrapper and "a.txt" not in wrapper


def test_close_reply_completes_every_cut_reply_at_its_shortest(tokenizer):
    """A reply cut anywhere (as --max-new-tokens cuts one under the grammar) plus grammar.close_reply's text is a
    whole reply the grammar admits and parse_reply reads without a warning, and the completion is the shortest:
    the cut value closed (an escape's missing digits as 0, a duration's missing decimal as 0), every later part at
    its shortest (no further command, empty strings, task_complete false). A whole reply needs nothing; a text the
    grammar does not begin is refused."""
    from actobs import engine
    xgr = pytest.importorskip("xgrammar")
    plain, think = (engine.compile_grammar(tokenizer, grammar.reply_grammar(t), len(tokenizer)) for t in (False, True))

    def admits(compiled, text):
        m = xgr.GrammarMatcher(compiled)
        return m.accept_string(text) and m.accept_token(tokenizer.eos_token_id) and m.is_terminated()
    crafted = [json.dumps({"analysis": 'a "q" \\ é\n<<', "plan": "", "commands": [
        {"keystrokes": "ls -la\n", "duration": d} for d in (0.1, 10.25, 5)], "task_complete": True})]
    replies = expert_replies()[::10] + crafted
    for reply in replies:
        assert grammar.close_reply(reply) == ""
        for k in range(len(reply)):
            text = reply[:k] + grammar.close_reply(reply[:k])
            assert admits(plain, text), (reply[:k], text)
            assert terminus.parse_reply(text)[1:] == (None, []), text
    shortest = '{"analysis": "", "plan": "", "commands": [], "task_complete": false}'
    cases = {"": shortest, '{"analysis": "ab\\': 'n", "plan": "", "commands": [], "task_complete": false}',
             '{"analysis": "\\u00': '00", "plan": "", "commands": [], "task_complete": false}',
             crafted[0][:crafted[0].index("0.1") + 2]: '0}], "task_complete": false}',
             crafted[0][:crafted[0].index("true") + 2]: 'ue}',
             crafted[0][:crafted[0].index("}, {") + 2]: ' {"keystrokes": "", "duration": 0}], "task_complete": false}'}
    for cut, completion in cases.items():
        assert grammar.close_reply(cut) == completion, cut
    block = "<think>hm, a plan\n</think>\n\n" + replies[0]
    for k in range(len(block)):
        assert admits(think, block[:k] + grammar.close_reply(block[:k], think=True)), block[:k]
    with pytest.raises(ValueError, match="not a prefix"):
        grammar.close_reply('{"analysis": 1')
